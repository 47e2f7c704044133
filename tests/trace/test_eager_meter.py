"""PyTorch eager's peak measured on fake tensors (`fxmem.trace.eager_meter`) against MemTracker on the real
step, and in the plan table."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.measure import measure_peak_bytes


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny", "mlp-tiny"])
def test_fake_step_meters_what_the_real_step_uses(name):
    torch.manual_seed(0)
    model, inputs = models.from_name(name), models.example_inputs(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake = eager_peak_bytes(model, inputs, {})
    real = measure_peak_bytes(copy.deepcopy(model), inputs, warmup=False)
    assert abs(fake - real) <= 0.01 * real, (fake, real)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model is untouched"


def test_plan_table_sets_eager_beside_the_keep_all_step():
    torch.manual_seed(0)
    model, inputs = models.from_name("resnet-tiny"), models.example_inputs("resnet-tiny")
    plan = fxmem.plan(model, inputs, eager_meter=True)
    assert plan.eager_peak_bytes == measure_peak_bytes(copy.deepcopy(model), inputs, warmup=False)
    assert "PyTorch eager's peak" in plan.table()
    assert fxmem.plan(model, inputs).eager_peak_bytes is None
