"""Before a step is planned: is the model a module fxmem plans (not FSDP2-sharded: `fxmem.fsdp` plans those
ranks), do the inputs fit the model, and, with `loss_fn`, is the target where it goes?

Reads the model's `forward` signature and, for a `loss_fn` step called without `target=`, runs the model
and `loss_fn(outputs, None)` once on fake tensors (nothing real is computed; the model's buffers and
random state are untouched). Raises `CallError` in one line; writes nothing.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._dynamo.eval_frame import _set_in_optimized_module
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.trace.capture import describe_input
from fxmem.errors import CallError

HOW = "a step planned with loss_fn= is called as opt(*inputs, target=y) (fxmem.plan: example_target=y)"


def outputs_on_fakes(model: torch.nn.Module, args: tuple, kwargs: dict,
                     then: Callable[[Any], Any] | None = None) -> Any:
    """`model(*args, **kwargs)` on fake stand-ins for its parameters, buffers and inputs (gradients on,
    as in training), and `then(outputs)` in the same fake mode when given."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        state = {name: fake(p.detach()).requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
        state |= {name: fake(b) for name, b in model.named_buffers()}
        with torch.enable_grad(), _set_in_optimized_module():  # a meter around the caller keeps its modules
            out = torch.func.functional_call(model, state, pytree.tree_map(fake, tuple(args)),
                                             pytree.tree_map(fake, dict(kwargs)))
            return then(out) if then is not None else out


def check_model(model: Any) -> None:
    """fxmem plans the training step of a module: anything else is refused in one line."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sharded = next((name or "the model" for name, m in model.named_modules() if _is_fsdp2(m)), None)
    if sharded is not None:
        raise ValueError(f"{sharded} is fully_shard-ed (FSDP2): fxmem plans an FSDP2 rank from the unsharded model; "
                         "pass it with mesh= (fxmem.optimize(model, budget_gb=..., mesh=mesh, example_inputs=...) "
                         "shards it), or plan offline with fxmem.fsdp.plan_fsdp (docs/fsdp.md)")


def _is_fsdp2(module: torch.nn.Module) -> bool:
    """`torch.distributed.fsdp.fully_shard` has made `module` an FSDP2 unit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed: nothing is sharded
        return False
    return isinstance(module, FSDPModule)


def check_solver(solver: Any) -> str:
    """`solver` is "auto" or a name in `fxmem.solve.recompute.SOLVERS`, checked before planning (at a budget
    that keeps everything no solver runs, and a misspelt name would pass unnoticed)."""
    from fxmem.solve.recompute import SOLVERS

    if solver != "auto" and solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of: auto, {', '.join(sorted(SOLVERS))}")
    return solver


def check_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before anything is traced, a call whose inputs `model`'s forward cannot take; for a
    `loss_fn` step (`fxmem.trace.step_module.LossStep`) called without `target=`, one whose model or loss_fn
    fails without it (a target passed positionally, or forgotten)."""
    loss_fn = getattr(model, "fxmem_loss_fn", None)
    inner = model.fxmem_model if loss_fn is not None else model
    inputs = {k: v for k, v in kwargs.items() if k != "target"} if loss_fn is not None else kwargs
    name = getattr(model, "display_name", type(model).__qualname__)
    call = f"{name} called with ({', '.join([describe_input(a) for a in args] + [f'{k}=...' for k in kwargs])})"
    without_target = loss_fn is not None and kwargs.get("target") is None
    hint = f"; {HOW}" if without_target else ""
    try:
        signature = inspect.signature(inner.forward)
    except (TypeError, ValueError):  # a forward Python cannot read the signature of: traced as it is
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **inputs)
        except TypeError as exc:
            raise CallError(f"{call}: {type(inner).__qualname__}.forward does not take these inputs ({exc})"
                            f"{hint}") from None
    if not without_target:
        return
    failing = ["the model"]

    def loss_without_target(outputs: Any) -> Any:
        failing[0] = "loss_fn(outputs, None)"
        return loss_fn(outputs, None)

    try:
        outputs_on_fakes(inner, args, inputs, loss_without_target)
    except Exception as exc:  # noqa: BLE001 - said in one line: the call, what failed, the fix
        said = str(exc).strip().splitlines()[0][:200].replace("FakeTensor", "Tensor") if str(exc).strip() else ""
        raise CallError(f"{call}, without target=, and {failing[0]} fails "
                        f"({type(exc).__name__}: {said}); {HOW}") from None
