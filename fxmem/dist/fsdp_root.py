"""The root of an FSDP2 rank as a step fxmem plans: the model's code after its last block (the final norm,
the head and the loss) as a module of its own, and the model's forward handing it the last block's output.

Reads the unsharded model and the module path of its blocks; writes nothing. `RootTail(model, path)` is a
module whose forward takes the last block's output (the hidden state) and the model's inputs and returns
what the model returns: the model's own forward, run on a twin of the model whose blocks pass their input
through and whose last block returns the given hidden state. What runs before the blocks (the
embeddings) is then dead code that the capture drops, and what runs after is the model's own code, so
fxmem finds its lm head and cross-entropy and plans the loss in chunks as on one device. The twin holds
the root's parameters only, shared with the model (its modules are the model's own, or twins sharing
their parameter dicts along the path to the blocks), so under FSDP2 it reads what the root unit gathered.

`run_tail(model, path, step)` makes the model's forward stop at its last block's output and return
`step(hidden, *inputs, **kwargs)`: a forward hook on the last block (after its own FSDP2 hooks) raises the
output out of the model's forward, which the replaced forward catches; the embeddings and the blocks run
as before. The logits are never made whole where `step`'s plan computes the loss in chunks.
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch

_HIDDEN: contextvars.ContextVar = contextvars.ContextVar("fxmem_root_hidden")  # the tail's given hidden state
_STOPPING: contextvars.ContextVar = contextvars.ContextVar("fxmem_root_stopping", default=False)


class PassThrough(torch.nn.Module):
    """A block of the tail's twin: returns its input (`last`: the hidden state the tail was given)."""

    def __init__(self, last: bool = False):
        super().__init__()
        self.last = last

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return _HIDDEN.get() if self.last else x


def twin(module: torch.nn.Module, modules: dict) -> torch.nn.Module:
    """A module of `module`'s class sharing its parameters, buffers and attributes, with `modules` as children."""
    made = type(module).__new__(type(module))
    torch.nn.Module.__init__(made)
    for key, value in module.__dict__.items():
        if key in ("_parameters", "_buffers") or not key.startswith("_"):
            made.__dict__[key] = value
    made.__dict__["_modules"] = modules
    return made


def without_blocks(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """A twin of `model` whose ModuleList at `path` is pass-through blocks (as many; one module in every place
    but the last, so the twin's modules, which a compiled step's signature counts, do not grow with the
    depth), the rest shared."""
    name, _, rest = path.partition(".")
    child = model.get_submodule(name)
    if rest:
        replaced = without_blocks(child, rest)
    else:
        # one module for every block but the last: the twin's modules are the same whatever the depth
        replaced = torch.nn.ModuleList([PassThrough()] * (len(child) - 1) + [PassThrough(last=True)])
    return twin(model, {**model._modules, name: replaced})


class RootTail(torch.nn.Module):
    """`model`'s forward from its last block's output on: `tail(hidden, *inputs, **kwargs)` returns what
    `model(*inputs, **kwargs)` returns where that block returned `hidden`."""

    def __init__(self, model: torch.nn.Module, path: str):
        super().__init__()
        self.root = without_blocks(model, path)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        token = _HIDDEN.set(hidden)
        try:
            return self.root(*args, **kwargs)
        finally:
            _HIDDEN.reset(token)


class _LastBlockOutput(Exception):
    def __init__(self, hidden: Any):
        super().__init__("the model's forward stops at its last block: the root's planned step takes over")
        self.hidden = hidden


def run_tail(model: torch.nn.Module, path: str, step: Callable[..., Any]) -> None:
    """From now on `model(*inputs, **kwargs)` runs up to its last block's output and returns
    `step(hidden, *inputs, **kwargs)` (see the module docstring). Call after the blocks are `fully_shard`-ed
    and before the root is: the root's FSDP2 hooks then stand around the replaced forward."""
    last = model.get_submodule(path)[-1]
    if getattr(model, "fxmem_root_step", None) is not None:
        raise RuntimeError("the model's root already runs a planned step")

    def stop(module: torch.nn.Module, args: Any, output: Any) -> None:
        if _STOPPING.get():
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"{path}'s last block returned {type(output).__name__}, not the hidden state "
                                "as a tensor: the root cannot run a planned step from it")
            raise _LastBlockOutput(output)

    last.register_forward_hook(stop)
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        token = _STOPPING.set(True)
        try:
            return original(*args, **kwargs)  # returns only where the last block never ran
        except _LastBlockOutput as stopped:
            hidden = stopped.hidden  # the exception and its frames (the forward's locals) go at the except's end
        finally:
            _STOPPING.reset(token)
        return step(hidden, *args, **kwargs)

    model.forward = forward
    model.__dict__["fxmem_root_step"] = step  # what the root runs after the blocks (its `.plan`); not a submodule
