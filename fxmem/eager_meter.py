"""PyTorch eager's peak for one training step, measured without running it: MemTracker (PyTorch's own
meter) around the eager step on fake tensors.

Reads the model and example inputs; copies the model and replaces the copy's parameters and buffers
with fake tensors of the same shapes, so nothing real is computed or allocated beyond the copy's
structure; returns the peak bytes MemTracker saw, or None where the model cannot run on fakes.
Independent of fxmem's own cost model: it is what eager PyTorch would hold, for the plan table to
set beside fxmem's no-recompute step.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from fxmem.measure import training_step

log = logging.getLogger("fxmem")


def eager_peak_bytes(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    """Peak bytes of `training_step(model, args, kwargs)` as PyTorch eager runs it (MemTracker, fakes)."""
    try:
        twin = copy.deepcopy(model)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            for module in twin.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = torch.nn.Parameter(mode.from_tensor(p.detach()),
                                                                      requires_grad=p.requires_grad)
                for name, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[name] = mode.from_tensor(b)
            fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            fargs = torch.utils._pytree.tree_map(fake, tuple(args))
            fkwargs = torch.utils._pytree.tree_map(fake, dict(kwargs))
            tracker = MemTracker()
            tracker.track_external(twin, *[x for x in torch.utils._pytree.tree_leaves((fargs, fkwargs))
                                           if isinstance(x, torch.Tensor)])
            with tracker:
                training_step(twin, fargs, fkwargs)
            return max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    except Exception as exc:  # a meter that cannot run says so and leaves the row out
        log.info("fxmem: PyTorch eager's peak could not be measured on fake tensors: %s", exc)
        return None
