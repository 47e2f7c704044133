"""Where the training step's loss is: the one rule (`is_loss`, `loss_field`, `loss_of`) and what a model's
outputs say of it (`classify`). A model that returns its scalar loss is planned as it is; one whose output
has a differentiable scalar `loss` field (transformers' `labels=`, a dict, a dataclass) is planned as
`OwnLossStep`, which returns the same output with every other field detached, so backward starts at the
loss and the logits get no zero gradient. Reads outputs only; writes nothing.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxmem.errors import fmt_bytes
from fxmem.trace.wrapper import ModelWrapper

log = logging.getLogger("fxmem")

LOSS_FN = "loss_fn (in the plan)"
DROP_OUTPUTS = "keep_outputs=False drops them"
RETURNED = "the model's output (in the plan)"
OUTSIDE = "outside the plan"


@dataclass(frozen=True)
class Boundary:
    """`kind`: "returned" (the output is the loss), "field" (a scalar `loss` field with a gradient),
    "outside" (outputs with gradients and no scalar loss) or "unknown" (could not run on fake tensors).
    `outside_bytes`: bytes of the outputs with gradients that leave the step, for "outside";
    `other_bytes`: bytes of the outputs beside the `loss` field, for "field"."""

    kind: str
    outside_bytes: int = 0
    other_bytes: int = 0

    def text(self, keep_outputs: bool = True) -> str:
        """The plan table's "loss" row."""
        if self.kind == "returned":
            return RETURNED
        if self.kind == "field" and keep_outputs:
            return (f"the model's `loss` output; other outputs returned detached ({fmt_bytes(self.other_bytes)}, "
                    f"held to the step's end; {DROP_OUTPUTS})")
        if self.kind == "field":
            return "the model's `loss` output; other outputs not returned (keep_outputs=False)"
        if self.kind == "outside":
            return (f"{OUTSIDE}: {fmt_bytes(self.outside_bytes)} of outputs with gradients leave the step; "
                    "loss_fn= plans the loss")
        return ""


def is_loss(value: Any) -> bool:
    """The one rule for a loss: a floating-point tensor of one element with a gradient."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad \
        and value.is_floating_point()


def loss_field(out: Any) -> Any:
    """The output's `loss` field (a mapping's key or a dataclass's attribute, as transformers' outputs
    have), or None."""
    if isinstance(out, dict):
        return out.get("loss")
    return getattr(out, "loss", None) if dataclasses.is_dataclass(out) else None


def loss_of(out: Any) -> torch.Tensor:
    """The scalar to call backward on: the output itself or its `loss` field where `is_loss` holds, else the
    sum of its floating-point tensors with gradients."""
    if is_loss(out):
        return out
    loss = loss_field(out)
    if is_loss(loss):
        return loss
    return sum(t.float().sum() for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)


def classify(out: Any) -> Boundary:
    """Where the loss is, from what the model returned."""
    if is_loss(out):
        return Boundary("returned")
    loss = loss_field(out)
    if is_loss(loss):
        return Boundary("field", other_bytes=_bytes(out, lambda t: t.untyped_storage() is not loss.untyped_storage()))
    outside = _bytes(out, lambda t: t.requires_grad)
    return Boundary("outside", outside) if outside else Boundary("returned")


def _bytes(out: Any, counted: Any) -> int:
    """Bytes of the distinct storages of `out`'s tensors for which `counted(tensor)` holds."""
    storages = {}
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and counted(leaf):
            storages[id(leaf.untyped_storage())] = leaf.untyped_storage().nbytes()
    return sum(storages.values())


def detached_except_loss(out: Any, keep_outputs: bool = True) -> Any:
    """`out` with its `loss` field as it is and every other tensor detached (None without `keep_outputs`)."""
    detach = (lambda t: t.detach() if isinstance(t, torch.Tensor) else t) if keep_outputs else (  # noqa: E731
        lambda t: None)
    if isinstance(out, dict):
        fields = {k: v if k == "loss" else pytree.tree_map(detach, v) for k, v in out.items()}
        if type(out) is dict:
            return fields
        for key, value in fields.items():  # a ModelOutput keeps its type, keys and attributes
            out[key] = value
        return out
    return dataclasses.replace(out, **{f.name: pytree.tree_map(detach, getattr(out, f.name))
                                       for f in dataclasses.fields(out) if f.name != "loss" and f.init})


class OwnLossStep(ModelWrapper):
    """The model, its output's `loss` the step's only output with a gradient; the other outputs are
    returned detached with `keep_outputs`, else left out (None)."""

    def __init__(self, model: torch.nn.Module, keep_outputs: bool = True):
        super().__init__(model, fxmem_keep_outputs=bool(keep_outputs))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return detached_except_loss(self.fxmem_model(*args, **kwargs), self.fxmem_keep_outputs)

    @property
    def display_name(self) -> str:
        return getattr(self.fxmem_model, "display_name", type(self.fxmem_model).__qualname__)


