"""fxmem-plan driven as a user would: a subprocess for a plan and for an error (exit codes, messages,
files), main(argv) in-process for the rest (the same code, without starting Python again)."""
from __future__ import annotations

import copy
import struct
import subprocess
import sys
import textwrap

import pytest

import fxmem
from fxmem import models
from fxmem.cli import main
from fxmem.errors import gb_at_least
from tests.conftest import assert_trains_like


def run(*args):
    return subprocess.run([sys.executable, "-m", "fxmem.cli", *args], capture_output=True, text=True, timeout=300)


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_shows_worked_examples(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for text in ("examples:", "--budget-gb", "--out gpt.plan.json --plot gpt.png", "--estimate", "--max-batch",
                 "fxmem.optimize(model, plan=fxmem.Plan.load"):
        assert text in out


def test_plan_saves_json_and_png_that_optimize_reads(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "timeline.png"
    result = run("mlp-tiny", "--batch-size", "512", "--budget-gb", "0.0007", "--time-limit", "1",
                 "--out", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert "predicted peak" in result.stdout and f"plan written to {out}" in result.stdout
    assert result.stderr.startswith("fxmem: planning mlp-tiny (float32[512,32], int64[512])")
    plan = fxmem.Plan.load(out)
    assert plan.model == "MLP" and plan.budget_bytes == int(0.0007 * 2**30) and plan.recompute
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and min(struct.unpack(">II", data[16:24])) > 100
    model = models.from_name("mlp-tiny")
    assert_trains_like(copy.deepcopy(model), fxmem.optimize(model, plan=plan), models.example_inputs("mlp-tiny", 512))


def test_infeasible_budget_is_one_clear_message():
    result = run("mlp-tiny", "--budget-gb", "0.00001", "--time-limit", "1", "--solver", "greedy")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("fxmem-plan: budget 10.5 KiB is below the minimum feasible budget")
    assert "gradients" in message and "smallest activation set" in message and "--budget-gb 0.000" in message


def test_unknown_model_lists_presets(capsys):
    code, _, err = cli(capsys, "no-such-model", "--budget-gb", "1")
    assert code == 2 and "unknown model 'no-such-model'" in err and "gpt-tiny, gpt-small" in err


def test_suggested_budget_is_enough(capsys):
    code, _, err = cli(capsys, "mlp-tiny", "--budget-gb", "0.00001", "--solver", "greedy", "--time-limit", "1")
    suggested = err.strip().splitlines()[-1].split("--budget-gb ")[1].split()[0]
    assert code == 2 and float(suggested) >= float(gb_at_least(1))  # sanity of the parse
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", suggested, "--solver", "greedy", "--time-limit", "1")
    assert code == 0, err


def test_gb_at_least_rounds_up_to_three_digits():
    assert gb_at_least(int(2.341 * 2**30)) == "2.35" and gb_at_least(2**30) == "1.00"
    assert gb_at_least(150 * 1024) == "0.000144"


def test_bad_numbers_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["mlp-tiny", "--budget-gb", "1", "--batch-size", "0"])
    assert info.value.code == 2 and "expected a positive whole number, got '0'" in capsys.readouterr().err
    code, _, err = cli(capsys, "mlp-tiny", "--budget-gb", "-1")
    assert code == 2 and "--budget-gb must be a positive, finite number of GiB" in err


def test_list_models(capsys):
    code, out, _ = cli(capsys, "--list-models")
    assert code == 0 and "gpt-tiny" in out and "resnet18" in out


@pytest.mark.parametrize("spec, says", [
    ("nopkg_fxmem_test.mod:make", "cannot import 'nopkg_fxmem_test.mod'"),
    ("json:no_such_factory", "json has no callable 'no_such_factory'"),
    ("json:", "cannot read 'json:' as package.module:factory"),
    ("json:dumps", "dumps() raised TypeError"),
    ("os:getcwd", "must return (model, example_inputs) with an nn.Module model, got str"),
])
def test_bad_factory_is_one_line(capsys, spec, says):
    code, _, err = cli(capsys, spec, "--budget-gb", "1")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_user_factory_with_batch_and_seq_len(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_fxmem_models.py").write_text(textwrap.dedent("""
        from fxmem import models
        def make(batch_size=2, seq_len=32):
            return models.from_name("gpt-tiny", block_size=seq_len), models.example_inputs(
                "gpt-tiny", batch_size, block_size=seq_len)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = cli(capsys, "my_fxmem_models:make", "--batch-size", "3", "--seq-len", "16", "--estimate")
    assert code == 0, err
    assert "fxmem estimate for GPT (int64[3,16], int64[3,16])" in out and "optimizer state (AdamW)" in out


def test_seq_len_for_presets(capsys):
    code, out, err = cli(capsys, "gpt-tiny", "--seq-len", "8", "--batch-size", "2", "--estimate",
                         "--optimizer", "sgd-momentum")
    assert code == 0 and "(int64[2,8], int64[2,8])" in out and "optimizer state (SGD)" in out
    code, _, err = cli(capsys, "mlp-tiny", "--seq-len", "8", "--budget-gb", "1")
    assert code == 2 and "--seq-len applies to sequence models (gpt-tiny, gpt-small, gpt2), not mlp-tiny" in err


def test_bf16_plan_and_check(capsys, tmp_path):
    path = tmp_path / "bf16.json"
    code, out, err = cli(capsys, "mlp-tiny", "--dtype", "bf16", "--budget-gb", "1", "--out", str(path))
    assert code == 0, err
    assert "autocast(cpu:bfloat16)" in fxmem.Plan.load(path).signature
    code, out, err = cli(capsys, "mlp-tiny", "--dtype", "bf16", "--check", str(path))
    assert code == 0 and "applies to MLP" in out
    code, _, err = cli(capsys, "mlp-tiny", "--check", str(path))  # fp32 step, bf16 plan
    assert code == 2 and "this plan was made for another model or input signature" in err and "autocast" in err
    code, _, err = cli(capsys, "mlp-tiny", "--batch-size", "4", "--dtype", "bf16", "--check", str(path))
    assert code == 2 and "got (float32[4,32], int64[4])" in err


def test_max_batch(capsys, tmp_path):
    path = tmp_path / "best.json"
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "0.002", "--max-batch", "--batch-size", "512",
                         "--batch-multiple", "256", "--solver", "greedy", "--time-limit", "1", "--out", str(path))
    assert code == 0, err
    best = int(out.split("largest batch: ")[1].split()[0])
    assert best >= 512 and best % 256 == 0 and fxmem.Plan.load(path).signature.startswith(f"(float32[{best},")


def test_offload_reaches_the_planner(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--time-limit", "1", "--offload",
                         "--target", "h100", "--out", str(path))
    assert code == 0, err
    plan = fxmem.Plan.load(path)
    assert plan.device == "h100" and plan.host_link == "pcie5"


def test_plan_table_and_quiet(capsys):
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--by", "op", "--quiet")
    assert code == 0 and err == "" and "addmm" in out and "predicted peak" in out


def test_stages_reach_the_planner(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = cli(capsys, "gpt-tiny", "--budget-gb", "0.01", "--stages", "2", "--microbatches", "4",
                         "--time-limit", "1", "--out", str(path))
    assert code == 0, err
    plan = fxmem.Plan.load(path)
    assert len(plan.pipeline.stages) == 2 and plan.pipeline.balance >= 1.0 and "pipeline: 2 stages" in out
