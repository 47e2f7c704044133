"""fxmem.estimate against an independent meter (MemTracker) and torch.optim's real state."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.estimate import estimate
from fxmem.measure import _StepTracker, measure_peak_bytes


def _bytes_after_forward(module, inputs) -> int:
    """Live bytes right after forward (parameters, inputs, saved activations, the loss), measured."""
    module(*inputs).backward()  # the first call plans
    for p in module.parameters():
        p.grad = None
    tracker = _StepTracker()
    tracker.track_external(module, *inputs)
    with tracker:
        out = module(*inputs)
        current = max(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
    del out
    return current


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_estimate_matches_the_measured_step(autocast):
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 64)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        est = estimate(model, inputs)
        step = fxmem.optimize(model, budget_gb=100.0)  # nothing recomputed: the step the estimate describes
        after_forward = _bytes_after_forward(step, inputs)
        peak = measure_peak_bytes(step, inputs)
    assert est.parameters == sum(p.numel() * 4 for p in model.parameters())
    assert est.gradients == est.parameters
    loss_bytes = 4
    assert abs(after_forward - (est.parameters + est.buffers + est.inputs + est.activations + loss_bytes)) <= 64
    assert abs(est.peak_step - peak) <= 0.01 * peak
    assert est.by_module[0][1] == max(b for _, b in est.by_module)
    assert abs(sum(b for _, b in est.by_module) - est.activations) == 0


def test_bf16_autocast_halves_matmul_and_activation_bytes():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 256)
    fp32 = fxmem.plan(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = fxmem.plan(model, inputs)
    assert "autocast(cpu:bfloat16)" in bf16.signature

    def saved(plan, ops):
        return sum(r.bytes for r in plan.nodes if r.decision == "save" and r.op in ops)

    lower_precision = {"addmm", "gelu"}
    assert saved(fp32, lower_precision) > 0
    assert saved(bf16, lower_precision) * 2 == saved(fp32, lower_precision)
    everything = {r.op for r in fp32.nodes} | {r.op for r in bf16.nodes}
    assert 0.45 < saved(bf16, everything) / saved(fp32, everything) < 0.75


def test_table_names_the_largest_modules_and_optimizer():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    est = estimate(model, inputs, torch.optim.AdamW(model.parameters()))
    assert est.optimizer_state == 2 * est.parameters
    assert est.total == est.peak_step + est.optimizer_state
    text = est.table()
    assert "optimizer state (AdamW)" in text and est.by_module[0][0] in text
