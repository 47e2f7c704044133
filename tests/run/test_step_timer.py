"""A step's fixed costs (fxmem/run/step_timer.py, fxmem.price.cost.DeviceSpec): measured on the device here, cached,
and added to a plan's predicted step time per step and per parameter it trains; views priced as dispatched ops."""
from __future__ import annotations

import dataclasses

import torch

import fxmem
from fxmem import models
from fxmem.price.cost import DEVICE_PRESETS
from fxmem.run.step_timer import measured_overheads


def test_overheads_are_measured_once_per_device_and_spec():
    spec = dataclasses.replace(DEVICE_PRESETS["cpu"], step_overhead_s=0.0, param_overhead_s=0.0, view_overhead_s=0.0)
    measured = measured_overheads(spec, "cpu")
    assert measured.step_overhead_s >= 0 and measured.param_overhead_s >= 0 and measured.view_overhead_s > 0
    assert measured.step_overhead_s + measured.param_overhead_s > 0, "a step costs more than its kernels"
    assert measured_overheads(spec, torch.device("cpu")) is measured  # cached: nothing timed again
    assert 1e8 < measured.bytes_per_s < 1e13  # the memory rate of an add here, bytes per second
    assert dataclasses.replace(measured, step_overhead_s=0.0, param_overhead_s=0.0, view_overhead_s=0.0,
                               bytes_per_s=spec.bytes_per_s) == spec


def test_fixed_costs_enter_the_predicted_step_per_step_and_per_trained_parameter():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    bare = dataclasses.replace(DEVICE_PRESETS["cpu"], step_overhead_s=0.0, param_overhead_s=0.0)
    costly = dataclasses.replace(bare, step_overhead_s=1.0, param_overhead_s=0.25)
    plain, fixed = fxmem.plan(model, inputs, device=bare), fxmem.plan(model, inputs, device=costly)
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    for a, b in ((plain.baseline_step_s, fixed.baseline_step_s), (plain.predicted_step_s, fixed.predicted_step_s)):
        assert abs(b - a - (1.0 + 0.25 * trained)) < 1e-9
    frozen = models.from_name("mlp-tiny")
    first = next(frozen.parameters())
    first.requires_grad_(False)
    gap = (fxmem.plan(frozen, inputs, device=costly).baseline_step_s
           - fxmem.plan(frozen, inputs, device=bare).baseline_step_s)
    assert abs(gap - (1.0 + 0.25 * (trained - 1))) < 1e-9, "a frozen parameter accumulates no gradient"


def test_calibrated_plans_carry_the_measured_overheads():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    calibrated = fxmem.plan(model, inputs, calibrate=True)
    measured = measured_overheads(DEVICE_PRESETS["cpu"], "cpu")
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    assert calibrated.baseline_step_s > measured.fixed_seconds(trained) > 0
    assert "measured on cpu" in calibrated.timing
