"""Models built on the meta device (`with torch.device("meta"): model = ...`), planned as if their
tensors were on the device they are planned for.

A meta model has shapes, dtypes and strides but no data, which is all planning needs: planning runs on
fake tensors. But fake tensors made from meta tensors stay on the meta device, where the step differs
from the real one (other kernels, no device to mix CPU inputs with). While `planned_on` is active,
every fake tensor made from a real meta tensor (the model's parameters and buffers, meta inputs), by
any FakeTensorMode (capture, export, AOTAutograd, the eager meter), is made on the planning device
instead: the CPU, or CUDA when the target is a GPU and this machine has one; there, CPU inputs become
CUDA fakes too. Reads the model's tensors (their metadata only); writes nothing, allocates nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator

import torch
from torch._subclasses.meta_utils import MetaConverter

# The device fakes of real meta tensors are made on, while a meta model is planned; None otherwise.
_PLANNING_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "fxmem_planning_device", default=None)
_installed = False


def is_meta_model(model: torch.nn.Module) -> bool:
    """True when any of the model's parameters or buffers is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def planning_device(device: Any) -> torch.device:
    """The device a meta model's step is traced on, for a `fxmem.price.cost.DeviceSpec`: CUDA when the spec
    models CUDA's allocator (the GPU presets) and this machine has a GPU, so the graph has the GPU's
    kernels and autocast rules; the CPU otherwise (fake CUDA tensors cannot run autograd without a
    GPU). The bytes the target's allocator holds beside the tensors (block rounding, BLAS
    workspaces) come from the spec either way."""
    gpu = device.block_bytes > 1 or device.blas_workspace_bytes > 0
    return torch.device("cuda") if gpu and torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def planned_on(model: torch.nn.Module, device: Any) -> Iterator[torch.device | None]:
    """Within this block, a meta `model`'s fake tensors are made on `planning_device(device)` (yields
    it); for a model with real tensors, nothing changes (yields None)."""
    if not is_meta_model(model):
        yield None
        return
    target = planning_device(device)
    _install()
    token = _PLANNING_DEVICE.set(target)
    try:
        yield target
    finally:
        _PLANNING_DEVICE.reset(token)


def refuse_meta_model(model: torch.nn.Module) -> None:
    """One line for `fxmem.optimize` on a meta model: it has no weights to train."""
    if isinstance(model, torch.nn.Module) and is_meta_model(model):
        raise ValueError("the model is on the meta device (built under torch.device('meta')): it has no weights "
                         "to train; plan it with fxmem.plan(model, example_inputs, budget_gb=..., target=...), then "
                         "build it with real weights and train with fxmem.optimize(model, plan=that_plan)")


def _redirected(device: Any, target: torch.device) -> Any:
    """`target` for the meta device (and, planning on CUDA, for the CPU); `device` otherwise."""
    if device is None:
        return device
    kind = torch.device(device).type
    return target if kind == "meta" or (kind == "cpu" and target.type == "cuda") else device


def _install() -> None:
    """Wrap `MetaConverter.__call__` (what every FakeTensorMode's `from_tensor` goes through) once: while
    a planning device is set, the fake tensors it makes from real meta tensors are on that device. With
    none set, it is torch's own."""
    global _installed
    if _installed:
        return
    original = MetaConverter.__call__

    @functools.wraps(original)
    def convert(self: MetaConverter, t: torch.Tensor, *args: Any, callback: Any = None, **kwargs: Any) -> Any:
        target = _PLANNING_DEVICE.get()
        if target is None or callback is None or not isinstance(t, torch.Tensor) \
                or _redirected(t.device, target) == t.device:
            return original(self, t, *args, callback=callback, **kwargs)
        made = callback

        def on_target(make_meta: Any, *rest: Any, **options: Any) -> Any:
            if rest:
                rest = (_redirected(rest[0], target), *rest[1:])
            if "device" in options:
                options["device"] = _redirected(options["device"], target)
            return made(make_meta, *rest, **options)

        return original(self, t, *args, callback=on_target, **kwargs)

    MetaConverter.__call__ = convert
    _installed = True
