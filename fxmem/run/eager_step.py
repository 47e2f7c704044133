"""PyTorch's own eager step, where it serves a budget better than any plan: the budget covers eager's
peak and fxmem's keep-all step would hold more (its graphs keep a value eager frees, or hold outputs
longer). Then recomputing to fit would only cost time, so the step runs eagerly, and its plan says so.

Reads the plan made for the step and PyTorch eager's peak (`fxmem.trace.eager_meter`, MemTracker on fake
tensors); writes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.planner.margin import margin_for
from fxmem.planner.plan import Plan


def eager_peak_within(module: torch.nn.Module, args: tuple, kwargs: dict, budget: int | None,
                      resident: int = 0, measured: Callable[[], int | None] | None = None) -> int | None:
    """PyTorch eager's peak for the step (with `resident` bytes, the optimizer's state) when `budget`
    covers it; None without a budget, above it, or where the meter cannot run. `measured`: the step's
    peak as measured already (`fxmem.trace.step.Step.eager_peak`), instead of measuring it here."""
    if budget is None:
        return None
    peak = measured() if measured is not None else eager_peak_bytes(module, args, kwargs)
    if peak is None or peak + resident > budget:
        return None
    return peak + resident


def eager_plan(plan: Plan, eager_peak: int) -> Plan | None:
    """`plan` marked to run eagerly when fxmem's keep-all step holds more than PyTorch eager's
    `eager_peak` and eager's step (with the BLAS workspaces the plan counts, and the planning margin)
    fits the plan's budget; None otherwise."""
    total = eager_peak + plan.breakdown.get("BLAS workspaces", 0)
    if plan.baseline_peak_bytes <= total or total + margin_for(plan.device).bytes_for(plan.budget_bytes) \
            > plan.budget_bytes:
        return None
    nodes = tuple(dataclasses.replace(r, decision="save") if r.decision == "recompute" else r for r in plan.nodes)
    if plan.host_state_bytes:  # eager's peak was measured with the whole optimizer state on the device
        state = plan.optimizer_state_bytes + plan.host_state_bytes
        plan = dataclasses.replace(plan, optimizer_state_bytes=state, host_state_bytes=0, host_parameters=(),
                                   host_update_s=0.0, host_copy_s=0.0, host_gradients=(), host_gradient_bytes=0,
                                   breakdown={**plan.breakdown, "optimizer state": state},
                                   host_options=tuple({**row, "chosen": False} for row in plan.host_options))
    return dataclasses.replace(plan, runs_eagerly=True, predicted_peak_bytes=total,
                               eager_peak_bytes=total, recompute=(), extra_flops=0, nodes=nodes,
                               predicted_step_s=plan.baseline_step_s, offload=(), offloaded_bytes=0,
                               exposed_transfer_s=0.0)


class EagerStep:
    """Runs `module` as PyTorch does; `plans` is the plan that chose it."""

    def __init__(self, module: torch.nn.Module, plan: Plan):
        self.module, self.plan = module, plan

    @property
    def plans(self) -> list[Plan]:
        return [self.plan]

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.module(*args, **kwargs)
