"""Checking a saved plan against a model and inputs without running the model.

Reads a `Plan` and traces the model's joint graph on fake tensors (capture + AOTAutograd, no
solving); raises `PlanMismatchError` naming what differs (model, input signature, autocast,
torch version, graph). Writes nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fxmem.trace.capture import example_args
from fxmem.run.engine import plan_step, signature_of
from fxmem.planner.plan import Plan
from fxmem.planner.planner import PlanRequest


def check_plan(model: torch.nn.Module, example_inputs: Sequence[Any], plan: Plan, *,
               example_kwargs: dict[str, Any] | None = None) -> None:
    """Raise PlanMismatchError unless `plan` applies to a training step of `model` on these inputs
    (under the current autocast state), exactly as `fxmem.optimize(model, plan=plan)` would check it."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an fxmem.Plan (see fxmem.Plan.load), got {type(plan).__name__}")
    args, kwargs = example_args(example_inputs), dict(example_kwargs or {})
    signature = signature_of(model, args, kwargs)
    plan.check_applies(model=type(model).__qualname__, signature=signature, fingerprint=plan.fingerprint,
                       torch_version=torch.__version__)  # cheap checks first: no tracing
    plan_step(model, args, kwargs, PlanRequest(plan=plan, model=type(model).__qualname__, signature=signature))
