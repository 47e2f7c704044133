"""fxmem-plan driven as a user would: a subprocess for a plan (exit code, messages, files) and for what
must not run in the test's process (imports, a model too large to build), main(argv) in-process for the
rest, errors included (the same code, without starting Python and importing torch again)."""
from __future__ import annotations

import copy
import json
import re
import struct
import os
import subprocess
import sys
import textwrap

import pytest

import fxmem
from fxmem import models
from fxmem.cli.main import main
from fxmem.errors import fmt_bytes, gb_at_least
from tests.conftest import assert_trains_like


def run(*args):
    return subprocess.run([sys.executable, "-m", "fxmem.cli.main", *args], capture_output=True, text=True, timeout=300)


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
    # the budget the progress lines name is the table's
    table_budget = next(line.split(None, 1)[1] for line in result.stdout.splitlines() if line.startswith("budget "))
    assert f", budget {table_budget} less a" in result.stderr
    plan = fxmem.Plan.load(out)
    assert plan.model == "MLP" and plan.budget_bytes == int(0.0007 * 2**30) and plan.recompute
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and min(struct.unpack(">II", data[16:24])) > 100
    model = models.from_name("mlp-tiny")
    assert_trains_like(copy.deepcopy(model), fxmem.optimize(model, plan=plan), models.example_inputs("mlp-tiny", 512))


def test_infeasible_budget_is_one_clear_message(capsys):
    code, _, err = cli(capsys, "mlp-tiny", "--budget-gb", "0.00001", "--time-limit", "1", "--solver", "greedy")
    assert code == 2 and "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("fxmem-plan: budget 10.5 KiB is below the minimum feasible budget")
    assert "gradients" in message and "smallest activation set" in message and "--budget-gb 0.000" in message


@pytest.mark.parametrize("budget", ["inf", "nan", "0"])
def test_budget_that_is_not_a_positive_finite_number_is_one_line(budget):
    result = run("mlp-tiny", "--budget-gb", budget)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"fxmem-plan: --budget-gb must be a positive, finite number of GiB "
                                          f"(2**30 bytes), got {float(budget)}; --estimate shows the memory of a "
                                          "step with nothing recomputed"]


def test_incomplete_plan_file_is_named_by_check(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["mlp-tiny", "--budget-gb", "1", "--quiet", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    del data["budget_bytes"], data["solver"]
    path.write_text(json.dumps(data))
    with pytest.raises(fxmem.PlanMismatchError, match="lacks budget_bytes, solver"):
        fxmem.Plan.load(path)
    capsys.readouterr()
    code, _, err = cli(capsys, "mlp-tiny", "--check", str(path))
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [f"fxmem-plan: {path} is an incomplete plan file: it lacks budget_bytes, "
                                          "solver; make the plan again with fxmem.plan(...) or fxmem-plan --out"]


@pytest.mark.parametrize("argv", [["--help"], ["--list-models"]])
def test_help_and_list_models_load_no_torch(argv):
    code = ("import sys\nfrom fxmem.cli.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'ortools' not in sys.modules, 'torch loaded'\n" % argv)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "gpt-small    batch 64" in result.stdout or "examples:" in result.stdout


def test_too_long_sequence_is_refused_with_the_memory_it_needs():
    """gpt-tiny at 100000 tokens holds a 100000 x 100000 causal mask per layer: counted on the meta device
    and refused before it is built (the machine is told it has 1 GiB left, whatever it has)."""
    code = ("import sys, fxmem.cli.main as cli, fxmem.cli.models as cli_models\n"
            "cli_models.available_memory_bytes = lambda: 2**30\n"
            "sys.exit(cli.main(['gpt-tiny', '--seq-len', '100000', '--budget-gb', '1']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    masks = fmt_bytes(2 * 100_000**2)  # two layers' boolean masks
    assert line.startswith("fxmem-plan: building gpt-tiny at --seq-len 100000 for planning needs about ")
    assert f"buffers {masks}, held twice while capturing" in line and "blocks.0.attn.future_mask" in line
    assert "more than the 1.00 GiB available; use a smaller --seq-len" in line


def test_available_memory_is_read():
    from fxmem.cli.models import available_memory_bytes
    available = available_memory_bytes()
    assert available is None or 0 < available < 2**50


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
    code, some, _ = cli(capsys, "gpt-tiny", "--budget-gb", "1", "--quiet")
    code, every, _ = cli(capsys, "gpt-tiny", "--budget-gb", "1", "--quiet", "--all")
    assert "blocks.0.attn.c_attn " not in some and "not shown; --all" in some  # keeps and recomputes nothing
    assert "blocks.0.attn.c_attn " in every and "not shown" not in every
    assert "total (30 modules)" in some and "total (30 modules)" in every


def test_stages_reach_the_planner(capsys, tmp_path):
    path = tmp_path / "plan.json"
    # 3.1 MiB per stage: the first stage (3.4 MiB eager with two microbatches in flight) must recompute
    code, out, err = cli(capsys, "gpt-tiny", "--budget-gb", "0.003", "--stages", "2", "--microbatches", "4",
                         "--time-limit", "1", "--out", str(path))
    assert code == 0, err
    plan = fxmem.Plan.load(path)
    assert len(plan.pipeline.stages) == 2 and plan.pipeline.balance >= 1.0 and "pipeline: 2 stages" in out
    first = plan.pipeline.stages[0]
    assert first.recompute and f"recompute {len(first.plan['recompute'])} values" in out
    assert re.search(rf"recomputed values +{len(first.plan['recompute'])} in stage 0 ", out)
    assert "activation memory removed" not in out  # a whole-model figure, not what the stages do
    assert "(top-level ops: " in out and "(size)" not in out and "(flatten)" not in out
    assert "fxmem.pipeline_stage(model, fxmem.Plan.load(" in out and "fxmem.optimize(" not in out


def test_meta_builds_the_model_without_weights_and_plans_it_alike(capsys, tmp_path, monkeypatch):
    code, with_weights, err = cli(capsys, "gpt-tiny", "--dtype", "bf16", "--estimate")
    assert code == 0, err
    code, on_meta, err = cli(capsys, "gpt-tiny", "--dtype", "bf16", "--estimate", "--meta")
    assert code == 0 and on_meta == with_weights, err
    (tmp_path / "my_meta_models.py").write_text(textwrap.dedent("""
        import torch
        from fxmem import models
        def make(batch_size=2):
            assert torch.empty(0).device.type == "meta", "not built under torch.device('meta')"
            return models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny", batch_size, device="meta")
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, _, err = cli(capsys, "my_meta_models:make", "--estimate")
    assert code == 2 and "not built under torch.device('meta')" in err
    code, factory_out, err = cli(capsys, "my_meta_models:make", "--estimate", "--meta", "--batch-size", "8")
    assert code == 0, err
    assert factory_out.split("\n", 1)[1] == cli(capsys, "gpt-tiny", "--estimate")[1].split("\n", 1)[1]


def test_help_shows_meta():
    out = run("--help").stdout
    assert "--meta --target h100" in out and "torch.device(\"meta\")" in out


def test_plot_without_matplotlib_is_refused_before_planning(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(fxmem, "plan", lambda *a, **k: pytest.fail("planned before checking for matplotlib"))
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--plot", str(tmp_path / "t.png"))
    assert code == 2 and out == "" and not (tmp_path / "t.png").exists()
    assert err.splitlines() == ["fxmem-plan: drawing the memory timeline needs matplotlib: pip install 'fxmem[plot]' "
                                "(or pip install matplotlib)"]


def test_optimizer_counts_in_the_plan(capsys, tmp_path):
    counted, plain = tmp_path / "adamw.json", tmp_path / "none.json"
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--optimizer", "adamw", "--quiet", "--out", str(counted))
    assert code == 0, err
    code, _, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--quiet", "--out", str(plain))
    assert code == 0, err
    with_state, without = fxmem.Plan.load(counted), fxmem.Plan.load(plain)
    parameters = sum(p.numel() * p.element_size() for p in models.from_name("mlp-tiny").parameters())
    assert with_state.optimizer_state_bytes == 2 * parameters and without.optimizer_state_bytes == 0  # exp_avg, exp_avg_sq
    assert with_state.predicted_peak_bytes == without.predicted_peak_bytes + 2 * parameters
    assert "of which optimizer state" in out
    # the least budget the refusal names counts the state too
    least = with_state.predicted_peak_bytes / 2**30 / 2
    code, _, err = cli(capsys, "mlp-tiny", "--budget-gb", f"{least:.6f}", "--optimizer", "adamw", "--quiet")
    assert code == 2 and "optimizer" in err, err


def test_profile_says_where_the_time_went_and_no_cache_keeps_no_plan(tmp_path):
    env = {**os.environ, "FXMEM_CACHE": "1", "FXMEM_CACHE_DIR": str(tmp_path)}
    argv = ["gpt-tiny", "--budget-gb", "0.003", "--time-limit", "2", "--quiet", "--profile"]
    done = subprocess.run([sys.executable, "-m", "fxmem.cli.main", *argv, "--no-cache"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("where the ", 1)[1].splitlines()
    assert lines[0].endswith("s of this command went:")
    stages = {line.split()[0] for line in lines[1:] if line.strip()}
    assert {"capture", "solve", "simulate", "price"} <= stages
    assert not list(tmp_path.rglob("*.json"))  # --no-cache: nothing kept
    kept = subprocess.run([sys.executable, "-m", "fxmem.cli.main", *argv], capture_output=True, text=True,
                          timeout=300, env=env)
    assert kept.returncode == 0, kept.stderr
    assert len(list(tmp_path.rglob("*.json"))) == 1


@pytest.mark.parametrize("argv, text", [
    (["--estimate", "--plot", "x.png"], "--plot does nothing with --estimate"),
    (["--estimate", "--budget-gb", "2"], "--budget-gb does nothing with --estimate (it is read by a plan, "),
    (["--check", "p.json", "--out", "x.json"], "--out does nothing with --check"),
    (["--budget-gb", "2", "--max-overhead", "0.2"], "--max-overhead does nothing with a plan (it is read by --max-batch)"),
    (["--budget-gb", "2", "--schedule", "gpipe"], "--schedule goes with --stages (pipeline stages)"),
])
def test_a_flag_the_run_would_ignore_is_refused_before_any_work(capsys, argv, text):
    code, out, err = cli(capsys, "mlp-tiny", *argv)
    assert code == 2 and out == "" and err.startswith(f"fxmem-plan: {text}"), err


def test_optimizer_state_on_the_host_offline(capsys, tmp_path, monkeypatch):
    """`--optimizer adamw --offload` plans where the state lives, for a GPU not here, and the table says it."""
    monkeypatch.setenv("FXMEM_HOST_UPDATE_GBPS", "1")
    path = tmp_path / "plan.json"
    parameters = sum(p.numel() * p.element_size() for p in models.from_name("mlp-tiny").parameters())
    code, out, err = cli(capsys, "mlp-tiny", "--budget-gb", "1", "--optimizer", "adamw", "--offload", "--target", "h100",
                         "--time-limit", "1", "--out", str(path))
    assert code == 0, err
    plan = fxmem.Plan.load(path)
    assert plan.optimizer_state_bytes + plan.host_state_bytes == 2 * parameters
    assert "optimizer state" in out and "all on the host" in out and "all on the device" in out
    assert any(row["chosen"] for row in plan.host_options)
