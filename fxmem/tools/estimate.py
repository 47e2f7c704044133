"""Memory estimate of one training step without running it: parameters, gradients, optimizer
state, activations saved for backward, and the modules whose activations are largest.

Reads the model's parameters and buffers (sizes only), the optimizer's class and state, PyTorch eager's
step on fake tensors (its peak, by MemTracker), and the eager plan `fxmem.plan` makes on fake tensors (its
joint-graph rows and simulated peak).
Returns a frozen `Estimate`; writes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tabulate import tabulate

from fxmem.trace.call_check import check_model
from fxmem.trace.capture import example_args
from fxmem.run.engine import plan_step, signature_of
from fxmem.error_boundary import public
from fxmem.errors import fmt_bytes
from fxmem.trace.step import planned_step
from fxmem.trace.meta_device import planned_on
from fxmem.price.optimizer_state import model_state_bytes, unique_bytes
from fxmem.planner.planner import PlanRequest
from fxmem.trace.step_module import LossStep


@dataclass(frozen=True)
class Estimate:
    """Bytes of one training step, with the two peaks the plan table names, each by its name there:
    `eager_peak` is "PyTorch eager's peak", eager PyTorch's step measured by MemTracker on fake tensors (None
    where it cannot run on them); `peak_step` is the "keep-all peak", the simulated peak of fxmem's step with
    nothing recomputed (AOTAutograd's forward and backward graphs, which save some values differently from
    eager: usually a little less), the figure a plan's "activation memory removed" counts from.
    `activations` are the values that step saves for backward. `total` is PyTorch eager's peak (the
    keep-all peak where eager's is unknown) with the optimizer state, alive across steps, added."""

    model: str
    signature: str
    parameters: int
    buffers: int
    inputs: int
    gradients: int
    optimizer_state: int
    optimizer: str
    activations: int
    peak_step: int
    by_module: tuple[tuple[str, int], ...]  # (module path, saved activation bytes), largest first
    loss: str = ""  # where the step's loss is (the plan table's "loss" row): loss_fn, the model's `loss`, outside
    policies: tuple = ()  # fxmem.tools.policy_table.PolicyRow per named policy (and the budget), with policies=True
    eager_peak: int | None = None  # PyTorch eager's step (forward+backward), MemTracker on fake tensors

    @property
    def total(self) -> int:
        return (self.eager_peak if self.eager_peak is not None else self.peak_step) + self.optimizer_state

    def rows(self) -> list[list[str]]:
        eager = [] if self.eager_peak is None else [
            ["PyTorch eager's peak", f"{fmt_bytes(self.eager_peak)} (one step, forward+backward; MemTracker on "
                                     "fake tensors)"]]
        return [
            ["parameters", fmt_bytes(self.parameters)],
            ["buffers", fmt_bytes(self.buffers)],
            ["inputs", fmt_bytes(self.inputs)],
            ["gradients", fmt_bytes(self.gradients)],
            [f"optimizer state ({self.optimizer})", fmt_bytes(self.optimizer_state)],
            ["activations saved for backward", f"{fmt_bytes(self.activations)} (by fxmem's step with nothing "
                                               "recomputed)"],
            *eager,
            ["keep-all peak", f"{fmt_bytes(self.peak_step)} (fxmem's step with nothing recomputed; what a plan's "
                              "'activation memory removed' counts from)"],
            [("PyTorch eager's" if self.eager_peak is not None else "keep-all") + " peak with optimizer state",
             fmt_bytes(self.total)],
        ]

    def table(self, top: int = 10) -> str:
        head = f"fxmem estimate for {self.model} {self.signature}" + (f"\nloss: {self.loss}" if self.loss else "")
        summary = tabulate(self.rows(), headers=["memory", "size"], tablefmt="simple", maxcolwidths=[None, 72])
        share = lambda b: f"{100.0 * b / self.activations:.1f}%" if self.activations else "-"  # noqa: E731
        modules = [[name or "(top level)", fmt_bytes(nbytes), share(nbytes)] for name, nbytes in self.by_module[:top]]
        largest = tabulate(modules, headers=["module", "saved activations", "share"], tablefmt="simple")
        text = f"{head}\n\n{summary}\n\nlargest activations by module\n{largest}"
        if self.policies:
            from fxmem.tools.policy_table import format_policies

            text += "\n\n" + format_policies(self.policies)
        return text


@public
def estimate(model: torch.nn.Module, example_inputs: Sequence[Any] = (),
             optimizer: torch.optim.Optimizer | str | float | None = None, *,
             example_kwargs: dict[str, Any] | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             example_target: Any = None, model_loss: bool = True, policies: bool = False,
             budget_gb: float | None = None, time_limit_s: float = 10.0) -> Estimate:
    """The memory breakdown of one eager training step of `model` on `example_inputs`, from fake
    tensors: nothing runs. Under `torch.autocast` the activations have autocast's dtypes.
    The step is the one `fxmem.plan` plans: with `loss_fn`, `loss_fn(model(*inputs), example_target)`
    (the logits, their log-softmax and gradients counted); without it, a model with a scalar `loss`
    output (transformers' `labels=`) is the step up to that loss (`fxmem.trace.loss`).
    `optimizer`: an optimizer, a name such as "adamw", or state bytes per parameter byte.
    `policies`: also plan the step under each named policy (`fxmem.planner.policies`) and, with `budget_gb`,
    under that budget, and list their peaks and extra step time side by side (`Estimate.policies`, a table
    under the breakdown); the "memory" policy searches the least budget for up to `time_limit_s`."""
    check_model(model)
    args, kwargs = example_args(example_inputs), dict(example_kwargs or {})
    module: torch.nn.Module = model
    if loss_fn is not None:
        module, kwargs = LossStep(model, loss_fn), {**kwargs, "target": example_target}
    elif example_target is not None:
        raise ValueError("example_target= goes with loss_fn=")
    request = PlanRequest(signature=signature_of(model, args, kwargs))
    with planned_on(model, request.device):  # a meta model's outputs are read on the device it is planned for
        eager_step = planned_step(module, args, kwargs, model_loss)  # in PyTorch eager's step, whose peak it measures
        module, loss = eager_step.module, eager_step.loss
        eager_peak = eager_step.eager_peak()
    name = getattr(module, "display_name", type(model).__qualname__)
    eager = plan_step(module, args, kwargs, dataclasses.replace(request, model=name, loss=loss))
    params = [p for p in model.parameters()]
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    by_module: dict[str, int] = {}
    for row in eager.nodes:
        if row.kept_on_device and row.bytes:
            by_module[row.module] = by_module.get(row.module, 0) + row.bytes
    stepped = model if loss_fn is None else LossStep(model, loss_fn)
    compared = _policies(stepped, args, kwargs, optimizer, budget_gb, time_limit_s) if policies else ()
    return Estimate(
        model=eager.model, signature=eager.signature,
        parameters=unique_bytes(params), buffers=unique_bytes(list(model.buffers())),
        inputs=unique_bytes([x for x in leaves if isinstance(x, torch.Tensor)]),
        gradients=unique_bytes([p for p in params if p.requires_grad]),
        optimizer_state=model_state_bytes(optimizer, model),
        optimizer=_optimizer_name(optimizer),
        activations=sum(by_module.values()), peak_step=eager.baseline_peak_bytes,
        by_module=tuple(sorted(by_module.items(), key=lambda kv: -kv[1])), loss=loss, policies=compared,
        eager_peak=eager_peak)


def _optimizer_name(optimizer: Any) -> str:
    if optimizer is None:
        return "none"
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, (int, float)):
        return f"{optimizer:g} bytes per parameter byte"
    return type(optimizer).__name__


def _policies(model: torch.nn.Module, args: tuple, kwargs: dict, optimizer: Any, budget_gb: float | None,
              time_limit_s: float) -> tuple:
    """Each named policy's plan (and the budget's) for the step as `fxmem.plan` makes it."""
    from fxmem.api import check_time_limit, device_spec, make_request
    from fxmem.budget import budget_bytes
    from fxmem.tools.policy_table import compare_policies

    step = planned_step(model, args, kwargs, True, True)
    request = make_request(step.module, args, kwargs, budget=budget_bytes(budget_gb),
                           device=device_spec(None, model=model), solver="auto",
                           time_limit_s=check_time_limit(time_limit_s), optimizer=optimizer)
    return compare_policies(step.module, args, kwargs, dataclasses.replace(request, loss=step.loss),
                            eager_peak=step.eager_peak)
