"""The step fxmem plans for a call `model(*args, **kwargs)`, for a model planned without `loss_fn`.

Reads the model's outputs from one forward on fake tensors (nothing real is computed; the model's
buffers are untouched); with `measure`, from PyTorch eager's whole step on fakes, whose peak
(`fxmem.trace.eager_meter`) the planner compares with its budget: the model runs on fakes once, not twice.
Where the loss is follows `fxmem.trace.loss`. Any other model leaves its loss outside the plan: one
`UserWarning` per model names `loss_fn=` and the bytes that leave the step. Writes nothing else.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch

from fxmem.error_boundary import warn_at_caller
from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.trace.call_check import check_call, outputs_on_fakes
from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.trace.loss import LOSS_FN, Boundary, OwnLossStep, classify, detached_except_loss

log = logging.getLogger("fxmem")
_warned: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def find_boundary(model: torch.nn.Module, args: tuple, kwargs: dict) -> Boundary:
    """Run `model` once on fake stand-ins for its parameters, buffers and inputs and classify its output."""
    try:
        return classify(outputs_on_fakes(model, args, kwargs))
    except Exception as exc:  # the planner will say what fails; here only the loss's place is unknown
        log.info("fxmem: the model's outputs could not be read on fake tensors: %s", exc)
        return Boundary("unknown")


class Step:
    """The module to plan for a call (`module`), the plan table's "loss" row (`loss`) and PyTorch eager's
    peak for that module's step (`eager_peak()`: measured with the outputs' reading, else when first asked).
    `held_bytes`: the outputs beside the loss that are returned, so held to the step's end, and that
    `keep_outputs=False` would drop (the logits of a language model called with `labels=`)."""

    _UNMEASURED = object()

    def __init__(self, module: torch.nn.Module, loss: str, args: tuple, kwargs: dict,
                 eager_peak: Any = _UNMEASURED, held_bytes: int = 0):
        self.module, self.loss, self._args, self._kwargs, self._peak = module, loss, args, kwargs, eager_peak
        self.held_bytes = held_bytes

    def eager_peak(self) -> int | None:
        """`fxmem.trace.eager_meter.eager_peak_bytes` of the step (None where it cannot run on fakes), measured once."""
        if self._peak is Step._UNMEASURED:
            self._peak = eager_peak_bytes(self.module, self._args, self._kwargs)
        return self._peak

    @contextlib.contextmanager
    def naming_held_outputs(self):
        """An InfeasibleBudgetError raised inside also names `keep_outputs=False`, where outputs are held."""
        try:
            yield
        except InfeasibleBudgetError as exc:
            if self.held_bytes and not getattr(exc, "names_held_outputs", False):
                exc.names_held_outputs = True
                exc.args = (f"{exc.args[0]}; the model's outputs beside its loss ({fmt_bytes(self.held_bytes)}) are "
                            "returned, so held to the step's end: keep_outputs=False drops them (the loss alone "
                            "is returned) and lets the loss be computed in chunks",)
            raise


def step_module(model: torch.nn.Module, args: tuple, kwargs: dict, model_loss: bool = True,
                keep_outputs: bool = True) -> tuple[torch.nn.Module, str]:
    """`planned_step`'s module and "loss" row, the outputs read from a forward on fakes alone."""
    step = planned_step(model, args, kwargs, model_loss, keep_outputs, measure=False)
    return step.module, step.loss


def planned_step(model: torch.nn.Module, args: tuple, kwargs: dict, model_loss: bool = True,
                 keep_outputs: bool = True, measure: bool = True) -> Step:
    """The step to plan for a call `model(*args, **kwargs)` (refused in one line where the inputs do not
    fit: `fxmem.trace.call_check`): the module, the plan table's "loss" row and eager's peak. With
    `model_loss` a `loss` field becomes the step's loss (logged once), the other outputs returned
    detached with `keep_outputs`; outputs with gradients and no scalar loss warn once per model.
    With `measure` the outputs are read in PyTorch eager's step on fakes, which measures its peak too."""
    check_call(model, args, kwargs)
    if getattr(model, "fxmem_loss_fn", None) is not None:
        return Step(model, LOSS_FN, args, kwargs)
    if measure:
        boundary, peak = _read_in_eager_step(model, args, kwargs, model_loss, keep_outputs)
    else:
        boundary, peak = find_boundary(model, args, kwargs), Step._UNMEASURED
    if boundary.kind == "field" and model_loss:
        log.info("fxmem: planning %s with its `loss` output as the step's loss; its other outputs are "
                 "returned detached (model_loss=False to backpropagate through them)", type(model).__qualname__)
        return Step(OwnLossStep(model, keep_outputs), boundary.text(keep_outputs), args, kwargs, peak,
                    boundary.other_bytes if keep_outputs else 0)
    if not keep_outputs and boundary.kind != "unknown":
        raise ValueError("keep_outputs=False goes with loss_fn= or a model whose output has a scalar `loss` "
                         "(model_loss=True)")
    if boundary.kind == "field":
        return Step(model, "the model's outputs, every one with a gradient (model_loss=False)", args, kwargs, peak)
    if boundary.kind == "outside" and model not in _warned:
        _warned.add(model)
        warn_at_caller(
            f"fxmem: {type(model).__qualname__} returns no scalar loss, so its loss is computed outside the plan: "
            f"{fmt_bytes(boundary.outside_bytes)} of outputs with gradients leave the step after forward, and what "
            "the loss makes of them (and their gradients) is not in the budget. Pass loss_fn=(outputs, target) -> "
            "loss and call the module with target= to plan the loss too.")
    return Step(model, boundary.text(), args, kwargs, peak)


def _read_in_eager_step(model: torch.nn.Module, args: tuple, kwargs: dict, model_loss: bool,
                        keep_outputs: bool) -> tuple[Boundary, int | None]:
    """The model's outputs classified, and the peak of the step it is planned as (its outputs as
    `OwnLossStep` returns them, for a `loss` field), from one eager step on fakes."""
    seen = []

    def read(out: Any) -> Any:
        seen.append(classify(out))
        return detached_except_loss(out, keep_outputs) if seen[0].kind == "field" and model_loss else out

    peak = eager_peak_bytes(model, args, kwargs, read)
    if not seen:  # the planner will say what fails; here only the loss's place is unknown
        log.info("fxmem: the model's outputs could not be read on fake tensors")
        return Boundary("unknown"), None
    return seen[0], peak
