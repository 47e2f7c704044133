"""Memory estimate of one training step without running it: parameters, gradients, optimizer
state, activations saved for backward, and the modules whose activations are largest.

Reads the model's parameters and buffers (sizes only), the optimizer's class and state, and the
eager plan `fxmem.plan` makes on fake tensors (its joint-graph rows and simulated peak).
Returns a frozen `Estimate`; writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tabulate import tabulate

from fxmem.errors import fmt_bytes

# Per-parameter state tensors (each the size of the parameter) a fresh optimizer creates at its
# first step, by class name; `None` means "depends on its options" (see _state_per_param).
STATE_PER_PARAM: dict[str, int | None] = {
    "Adam": None, "AdamW": None, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2,
    "Adagrad": 1, "Rprop": 2, "ASGD": 2, "SGD": None, "RMSprop": None, "Adafactor": 2, "LBFGS": 0,
}


@dataclass(frozen=True)
class Estimate:
    """Bytes of one training step as fxmem runs it with nothing recomputed (AOTAutograd's forward and
    backward graphs; eager PyTorch saves some values differently: its measured peak is 12% higher on gpt-tiny).
    `activations` are the values saved for backward; `peak_step` is the simulated peak of
    forward+backward (parameters, inputs, gradients and activations included); `total` adds the
    optimizer state, alive across steps."""

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

    @property
    def total(self) -> int:
        return self.peak_step + self.optimizer_state

    def rows(self) -> list[list[str]]:
        return [
            ["parameters", fmt_bytes(self.parameters)],
            ["buffers", fmt_bytes(self.buffers)],
            ["inputs", fmt_bytes(self.inputs)],
            ["gradients", fmt_bytes(self.gradients)],
            [f"optimizer state ({self.optimizer})", fmt_bytes(self.optimizer_state)],
            ["activations saved for backward", fmt_bytes(self.activations)],
            ["peak of one step (forward+backward)", fmt_bytes(self.peak_step)],
            ["peak with optimizer state", fmt_bytes(self.total)],
        ]

    def table(self, top: int = 10) -> str:
        head = f"fxmem estimate for {self.model} {self.signature}"
        summary = tabulate(self.rows(), headers=["memory", "size"], tablefmt="simple")
        share = lambda b: f"{100.0 * b / self.activations:.1f}%" if self.activations else "-"  # noqa: E731
        modules = [[name or "(top level)", fmt_bytes(nbytes), share(nbytes)] for name, nbytes in self.by_module[:top]]
        largest = tabulate(modules, headers=["module", "saved activations", "share"], tablefmt="simple")
        return f"{head}\n\n{summary}\n\nlargest activations by module\n{largest}"


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[Any, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr()) if storage.data_ptr() else id(storage)] = storage.nbytes()
    return sum(seen.values())


def _state_per_param(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    known = STATE_PER_PARAM.get(name)
    if known is None:
        raise ValueError(f"fxmem.estimate does not know the state of optimizer {name}; take one step first "
                         "(its existing state is counted) or leave optimizer=None")
    return known


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's state: counted from its state when it has taken a step, else inferred
    from its class (Adam/AdamW 2 tensors per parameter, SGD with momentum 1, ...), each the
    parameter's size and dtype, as torch.optim allocates them. Scalar step counters are left out."""
    if optimizer is None:
        return 0
    if optimizer.state:
        return _unique_bytes([t for state in optimizer.state.values() for t in state.values()
                              if isinstance(t, torch.Tensor) and t.dim() > 0])
    total = 0
    for group in optimizer.param_groups:
        per_param = _state_per_param(optimizer, group)
        total += per_param * sum(p.numel() * p.element_size() for p in group["params"] if p.requires_grad)
    return total


def estimate(model: torch.nn.Module, example_inputs: Sequence[Any] = (),
             optimizer: torch.optim.Optimizer | None = None, *,
             example_kwargs: dict[str, Any] | None = None) -> Estimate:
    """The memory breakdown of one eager training step of `model` on `example_inputs`, from fake
    tensors: nothing runs. Under `torch.autocast` the activations have autocast's dtypes."""
    from fxmem.runtime import plan as make_plan

    eager = make_plan(model, example_inputs, None, example_kwargs=example_kwargs, solver="greedy")
    params = [p for p in model.parameters()]
    leaves = torch.utils._pytree.tree_leaves((tuple(example_inputs), example_kwargs or {}))
    by_module: dict[str, int] = {}
    for row in eager.nodes:
        if row["decision"] == "save" and row["bytes"]:
            by_module[row["module"]] = by_module.get(row["module"], 0) + row["bytes"]
    return Estimate(
        model=eager.model, signature=eager.signature,
        parameters=_unique_bytes(params), buffers=_unique_bytes(list(model.buffers())),
        inputs=_unique_bytes([x for x in leaves if isinstance(x, torch.Tensor)]),
        gradients=_unique_bytes([p for p in params if p.requires_grad]),
        optimizer_state=optimizer_state_bytes(optimizer),
        optimizer=type(optimizer).__name__ if optimizer is not None else "none",
        activations=sum(by_module.values()), peak_step=eager.baseline_peak_bytes,
        by_module=tuple(sorted(by_module.items(), key=lambda kv: -kv[1])))
