"""Saved plans checked against a model, inputs and autocast state; a bf16 autocast plan trains
like torch's own AOTAutograd step under the same autocast."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.tools.check_plan import check_plan
from tests.conftest import GIB, step

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    path = tmp_path_factory.mktemp("plans") / "mlp.json"
    fxmem.plan(model, inputs, budget_gb=1.0).save(path)
    return model, inputs, path


def test_a_saved_plan_applies_to_its_model(mlp_plan):
    model, inputs, path = mlp_plan
    check_plan(model, inputs, fxmem.Plan.load(path))


@pytest.mark.parametrize("change, says", [
    ("batch", "inputs: plan is for (float32[16,32], int64[16]), got (float32[4,32], int64[4])"),
    ("autocast", "got (float32[16,32], int64[16]) autocast(cpu:bfloat16)"),
    ("torch", "torch: plan made with 1.0.0"),
    ("model", "model: plan is for MLP, got GPT"),
    ("graph", "different traced graph"),
])
def test_a_mismatching_plan_says_what_differs(mlp_plan, tmp_path, change, says):
    model, inputs, path = mlp_plan
    plan = fxmem.Plan.load(path)
    if change == "batch":
        inputs = models.example_inputs("mlp-tiny", 4)
    if change == "torch":
        data = json.loads(path.read_text())
        data["torch_version"] = "1.0.0"
        plan = fxmem.Plan.from_json(json.dumps(data))
    if change == "model":
        model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    if change == "graph":  # same class and input shapes, another config
        model = models.from_name("mlp-tiny", dropout=0.0)
    with torch.autocast(**BF16, enabled=change == "autocast"):
        with pytest.raises(fxmem.PlanMismatchError) as info:
            check_plan(model, inputs, plan)
    assert says in str(info.value)


def _recomputing_budget(model, inputs) -> float:
    eager = fxmem.plan(model, inputs).baseline_peak_bytes
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, solver="greedy", time_limit_s=1)
    return (eager + info.value.min_budget_bytes) / 2 / GIB


def test_bf16_plan_trains_like_aot_autograd_under_the_same_autocast():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 256)
    reference, compiled_ref = copy.deepcopy(model), copy.deepcopy(model)
    with torch.autocast(**BF16):
        budget = _recomputing_budget(model, inputs)
        optimized = fxmem.optimize(model, budget_gb=budget, time_limit_s=2)
        out = step(optimized, inputs)
        eager_out = step(reference, inputs)
        torch_out = step(torch.compile(compiled_ref, backend="aot_eager"), inputs)
    plan = optimized.plans[0]
    assert plan.recompute and plan.predicted_peak_bytes <= plan.budget_bytes
    assert "autocast(cpu:bfloat16)" in plan.signature
    # the forward rounds like torch.compile's traced step, and the whole step (dropout's backward
    # included, passes/dropout_backward.py) like eager's, bit for bit
    torch.testing.assert_close(out, torch_out, atol=0, rtol=0)
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(fxmem.PlanMismatchError, match="autocast"):  # the plan needs its autocast
        step(fxmem.optimize(copy.deepcopy(reference), plan=plan), inputs)


def test_optimize_plans_again_when_autocast_changes():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    optimized = fxmem.optimize(model, budget_gb=1.0, solver="greedy")
    with torch.autocast(**BF16):
        step(optimized, inputs)
    step(optimized, inputs)
    assert ["autocast(cpu:bfloat16)" in p.signature for p in optimized.plans] == [True, False]
