"""Checking a saved plan against a model and inputs without running the model.

Reads a `Plan` and traces the model's joint graph on fake tensors (capture + AOTAutograd, no
solving); raises `PlanMismatchError` naming what differs (model, input signature, autocast,
torch version, graph). Writes nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.capture import capture
from fxmem.plan import Plan
from fxmem.planner import Planner, PlanRequest
from fxmem.runtime import CompiledStep, signature_of


def check_plan(model: torch.nn.Module, example_inputs: Sequence[Any], plan: Plan, *,
               example_kwargs: dict[str, Any] | None = None) -> None:
    """Raise PlanMismatchError unless `plan` applies to a training step of `model` on these inputs
    (under the current autocast state), exactly as `fxmem.optimize(model, plan=plan)` would check it."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an fxmem.Plan (see fxmem.Plan.load), got {type(plan).__name__}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    signature = signature_of(model, args, kwargs)
    plan.check_applies(model=type(model).__qualname__, signature=signature, fingerprint=plan.fingerprint,
                       torch_version=torch.__version__)  # cheap checks first: no tracing
    request = PlanRequest(budget_bytes=plan.budget_bytes, plan=plan, model=type(model).__qualname__,
                          signature=signature)
    step = CompiledStep(model, capture(model, args, kwargs), Planner(request))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {k: fake(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())}
        step(state, pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs))
