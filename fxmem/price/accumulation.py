"""Gradients that exist when a training step starts: gradient accumulation over micro-batches, and
`zero_grad(set_to_none=False)`, which leaves every gradient allocated (zeros).

From the second micro-batch on, every parameter's `.grad` is on the device during forward, and backward
makes each new gradient beside the existing one until AccumulateGrad adds it in (in place). A step
planned with every `.grad` None does not count them; one planned with `GradientState.bytes` resident
does (`fxmem.planner.resident`). Reads the model's `.grad` tensors (only whether they exist, their storages,
and whether all are zero); writes nothing but a warning where a given plan did not count them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.price.optimizer_state import unique_bytes

ACCUMULATING = "accumulating"
ZEROS = "zeros from zero_grad(set_to_none=False)"


@dataclass(frozen=True)
class GradientState:
    """Which trainable parameters (by position in `model.parameters()`) have a `.grad` at the step's start,
    the bytes of their distinct storages, and whether they are all zeros."""

    present: tuple[bool, ...]
    bytes: int
    zeros: bool

    @property
    def resident(self) -> bool:
        return self.bytes > 0

    @property
    def description(self) -> str:
        """'' (every .grad None), 'accumulating', or zeros (`zero_grad(set_to_none=False)`)."""
        if not self.resident:
            return ""
        return ZEROS if self.zeros else ACCUMULATING

    @property
    def key(self) -> tuple:
        """For a cache of plans: a step with other gradients resident is planned apart."""
        return (self.present, self.zeros) if self.resident else ()


NONE = GradientState((), 0, False)


def gradient_state(model: torch.nn.Module) -> GradientState:
    """The gradients `model`'s trainable parameters hold now. Whether they are all zeros is read with
    one reduction per gradient until the first non-zero one (an accumulating micro-batch: usually one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return NONE
    zeros = all(not bool(g.any()) for g in grads)
    return GradientState(tuple(p.grad is not None for p in params), unique_bytes(grads), zeros)


def accumulated_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes every trainable parameter's gradient takes (the parameter's size and dtype; shared
    parameters once): what an accumulating micro-batch holds from its start, planned offline."""
    return unique_bytes(p for p in model.parameters() if p.requires_grad)


def accumulating_state(model: torch.nn.Module) -> GradientState:
    """The state of an accumulating micro-batch of `model` (every trainable parameter's gradient
    resident, not zeros), for planning before any gradient exists."""
    params = [p for p in model.parameters() if p.requires_grad]
    return GradientState(tuple(True for _ in params), accumulated_gradient_bytes(model), False)


def warn_unplanned_gradients(plan: Any, grads: GradientState) -> None:
    """`plan` (a given `fxmem.planner.plan.Plan`, or None) made with every .grad None, applied while gradients are
    resident: say in a warning when the gradients take the step over the plan's budget."""
    if plan is None or not grads.resident or plan.resident_gradient_bytes >= grads.bytes:
        return
    peak = plan.predicted_peak_bytes - plan.resident_gradient_bytes + grads.bytes
    if peak > plan.budget_bytes:
        warnings.warn(f"fxmem: plan= was made for a step with {'no' if not plan.resident_gradient_bytes else 'fewer'} "
                      f"gradients resident, but {grads.description} gradients of {grads.bytes / 2**20:.1f} MiB exist "
                      f"now: this step is predicted to peak at {peak / 2**20:.1f} MiB, over the plan's budget of "
                      f"{plan.budget_bytes / 2**20:.1f} MiB. Plan the accumulating step with fxmem.plan(..., "
                      "accumulating=True) or let fxmem.optimize(model, budget_gb=...) plan it", stacklevel=4)
