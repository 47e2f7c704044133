"""Plan tables (fxmem/planner/report.py): rows that carry bytes or decisions, a totals row that adds up, units in
the headers, a legend of the columns shown, a solver line that says what its gap means, tables within 120 columns
that cut op names before module paths, stage and device summaries."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import fxmem
from fxmem import models
from fxmem.errors import fmt_bytes
from fxmem.dist.placement import place_plan
from fxmem.planner.report import plan_rows, short_signature
from tests.conftest import GIB

MIB = 2**20


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    eager = fxmem.plan(model, inputs)
    return fxmem.plan(model, inputs, budget_gb=0.85 * eager.baseline_peak_bytes / GIB, time_limit_s=2)


def test_rows_carry_bytes_and_the_totals_add_up(gpt_plan):
    plan = gpt_plan
    rows, headers, hidden = plan_rows(plan)
    assert headers == ["module", "ops", "kept (MiB)", "recomputed (MiB)", "recompute cost (MFLOP)", "decision"]
    *body, total = rows
    assert all(kept > 0 or recomputed > 0 for _, _, kept, recomputed, _, _ in body)
    modules = {r.module or "(top level)" for r in plan.nodes}
    assert hidden > 0 and len(body) + hidden == len(modules) and total[0] == f"total ({len(modules)} modules)"
    assert total[2] == pytest.approx(sum(r[2] for r in body)) == pytest.approx(plan.saved_bytes / MIB)
    recomputed = [r for r in plan.nodes if r.decision == "recompute" and r.bytes]
    assert total[3] == pytest.approx(sum(r.bytes for r in recomputed) / MIB)
    assert total[5] == f"recompute {len(recomputed)} of {sum(r.bytes > 0 for r in plan.nodes)}"
    every, _, none_hidden = plan_rows(plan, all_rows=True)
    assert none_hidden == 0 and len(every) - 1 == len(modules)


def test_decisions_legend_and_gap(gpt_plan):
    text = gpt_plan.table()
    assert re.search(r"recompute \d+ of \d+", text) and not re.search(r"recompute \d+/\d+", text)
    assert "recompute k of n: k of the n values backward needs" in text
    assert "kept: bytes saved for backward" in text and "not shown; --all" in text
    solver = {status: dataclasses.replace(gpt_plan, solver="layered", solver_status=status, solver_gap=gap).table()
              for status, gap in (("optimal", 0.0), ("feasible", 1.0))}
    assert "layered: optimal (proven)" in solver["optimal"]
    assert "layered: feasible, not proven optimal (no lower bound, gap unknown)" in solver["feasible"]
    assert "100.00%" not in solver["feasible"]
    bounded = dataclasses.replace(gpt_plan, solver="cpsat", solver_status="feasible", solver_gap=0.031).table()
    assert "cpsat: feasible, gap 3.10% (the plan's recompute cost is at most that share above the least possible)" \
        in " ".join(bounded.split())  # the gap is explained where it is shown: the table has no gap column
    for text in (*solver.values(), bounded):
        assert "gap:" not in text and "gap" not in text.split("\n\n")[1]
    eager = dataclasses.replace(gpt_plan, solver="none", solver_status="optimal", solver_gap=0.0).table()
    assert "not run: the eager step fits the budget" in eager


def test_summary_counts_match_the_table(gpt_plan):
    text = gpt_plan.table()
    values = [r for r in gpt_plan.nodes if r.bytes > 0]
    recomputed = sum(r.decision == "recompute" for r in values)
    assert f"{recomputed} of the {len(values)} values backward needs ({len(gpt_plan.recompute)} ops run again)" in text
    assert f"budget                                   {fmt_bytes(gpt_plan.budget_bytes)}" in text
    by_op = gpt_plan.table(by="op")
    assert "native_dropout" in by_op and "\ngetitem" not in by_op  # a multi-output op's outputs count for it


def test_placement_summary_is_per_device():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 1024)
    eager = fxmem.plan(model, inputs)
    whole = place_plan(model, eager, ["cpu:0", "cpu:1"], [2**30, 2**30])
    per_device = int(0.6 * sum(e.peak_bytes for e in whole.devices))  # neither device holds the whole model
    placed = place_plan(model, eager, ["cpu:0", "cpu:1"], [per_device, per_device])
    text = placed.table()
    largest = max(placed.devices, key=lambda e: e.peak_bytes)
    assert eager.baseline_peak_bytes > per_device >= largest.peak_bytes
    summary = text.split("save for backward\n\n")[1]
    assert f"budget per device          {fmt_bytes(per_device)}" in summary
    assert f"largest device peak        {fmt_bytes(largest.peak_bytes)} ({largest.device})" in summary
    assert "predicted peak" not in summary and "activation memory removed" not in summary


def test_long_signatures_are_shortened():
    sig = "(" + ", ".join(f"float32[{i},8]" for i in range(30)) + ") eval"
    assert short_signature(sig) == "(float32[0,8], float32[1,8], float32[2,8], ... 30 inputs) eval"
    assert short_signature("(int64[8,32], int64[8,32])") == "(int64[8,32], int64[8,32])"


def test_compile_backend_verbose_names_the_signature_once(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": 1.0, "inner": "aot_eager",
                                                              "verbose": True})
    compiled(torch.randn(2, 8)).sum().backward()
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("fxmem: graph 0"))
    assert "float32" not in header and "budget 1.0000 GiB for the step" in header
    assert out.count("float32[2,8]") == 1 and "inputs)" in out  # 9 inputs: the title shortens them


def test_a_transformers_gpt2_plan_table_fits_120_columns():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 512, (2, 32))
    kwargs = {"labels": ids}
    eager = fxmem.plan(model, (ids,), example_kwargs=kwargs)
    plan = fxmem.plan(model, (ids,), 0.85 * eager.baseline_peak_bytes / GIB, example_kwargs=kwargs, eager_meter=True,
                      time_limit_s=2)
    wide = dataclasses.replace(plan, loss="x " * 150, nodes=tuple(  # a longer loss text and module path than any
        dataclasses.replace(r, module="transformer.h.0.attn.a_very_long_module_name_" + "x" * 60)
        if r.module == "transformer.h.0.attn" else r for r in plan.nodes))
    for shown in (plan, wide):
        for table in (shown.table(), shown.table(by="op"), shown.table(all_rows=True)):
            widths = [len(line) for line in table.splitlines()]
            assert max(widths) <= 120, "\n".join(line for line in table.splitlines() if len(line) > 120)
    text = plan.table()
    assert "transformer.h.0.attn" in text and "native_layer_norm" in text
    assert re.search(r"transformer\.h\.0\.\S*\.\.\S*xxxx ", wide.table())  # shortened in the middle: both ends kept
    assert max(len(line) for line in plan.table(width=160).splitlines()) > 120  # the knob widens it
    assert text.count("PyTorch eager's peak") == 1 and "keep-all peak" in text  # one figure to compare with
    with pytest.raises(ValueError, match="width must be"):
        plan.table(width=10)


def test_a_transformers_llama_table_keeps_module_paths_whole_within_120_columns():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False,
                                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 256, (2, 32))
    plan = fxmem.plan(transformers.LlamaForCausalLM(config), (), example_kwargs={"input_ids": ids, "labels": ids})
    for table in (plan.table(), plan.table(by="op"), plan.table(all_rows=True)):
        assert max(len(line) for line in table.splitlines()) <= 120, table
    text = plan.table(all_rows=True)
    paths = {r.module for r in plan.nodes if r.module}
    assert "model.layers.0.post_attention_layernorm" in paths
    for path in paths:  # whole, never cut in the middle
        assert re.search(rf"^{re.escape(path)} ", text, re.M), path
    modules = len({r.module for r in plan.nodes})
    assert f"total ({modules} modules)" in text
    assert re.search(r"  _scaled_dot\S*\.\. \+\d+ ", text)  # the op name is what is cut
    narrow = plan.table(width=105)  # too narrow for the ops column: it goes before any module path is cut
    assert "model.layers.0.post_attention_layernorm" in narrow and "_scaled_dot" not in narrow.split("\n\n")[1]
    assert "the ops column is left out" in narrow and max(len(line) for line in narrow.splitlines()) <= 105
