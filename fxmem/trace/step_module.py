"""The training step as users write it, `loss = loss_fn(model(*inputs), target)`, as one module.

Reads the user's model and loss function; writes nothing. `LossStep` shares the model's parameters,
buffers and submodules (`fxmem.trace.wrapper.ModelWrapper`), so the captured graph names them exactly as
the model does, and the plan covers the loss region too: the logits, their log-softmax and their
gradients are kept, recomputed or freed like any other value. The model's outputs are not returned
(nor held after the loss) unless `keep_outputs`; outputs the loss does not read get no gradient.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.fx

from fxmem.errors import FxmemError
from fxmem.trace.wrapper import ModelWrapper, forward_signature


class LossFnError(FxmemError, ValueError):
    """`loss_fn` did not return one scalar."""


class LossStep(ModelWrapper):
    """forward(*inputs, target=..., **kwargs) -> loss, or (loss, outputs) with `keep_outputs`."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], keep_outputs: bool = False):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(outputs, target), got {type(loss_fn).__name__}")
        super().__init__(model, fxmem_loss_fn=loss_fn, fxmem_keep_outputs=bool(keep_outputs))

    def forward(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        outputs = self.fxmem_model(*args, **kwargs)
        loss = self.fxmem_loss_fn(outputs, target)
        if isinstance(loss, torch.fx.Proxy):  # symbolic tracing: the shape is checked when export runs it
            pass
        elif not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise LossFnError("loss_fn must return a tensor with one element (the loss), got "
                             + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__))
        if not self.fxmem_keep_outputs:
            return loss
        # kept for the caller to read (metrics), not to backpropagate: detached, backward gets no zero
        # tangent for them (an autograd.Function materializes one for every output given no gradient)
        return loss, torch.utils._pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outputs)

    def caller_signature(self) -> inspect.Signature | None:
        """The model's forward signature with a keyword `target` (before its `**kwargs`), returning the loss."""
        signature = forward_signature(self.fxmem_model)
        if signature is None:
            return None
        params = [p for p in signature.parameters.values() if p.name != "target"]  # the model's is shadowed
        target = inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY, default=None)
        rest = [p for p in params if p.kind is not p.VAR_KEYWORD]
        return signature.replace(parameters=[*rest, target, *(p for p in params if p.kind is p.VAR_KEYWORD)],
                                 return_annotation=inspect.Signature.empty)

    @property
    def display_name(self) -> str:
        return f"{type(self.fxmem_model).__qualname__} + loss"
