"""PyTorch eager's peak for one training step, measured without running it: MemTracker (PyTorch's own
meter) around the eager step on fake tensors.

Reads the model and example inputs; runs the model's own forward with fake stand-ins for its
parameters, buffers and inputs (`torch.func.functional_call`), so nothing real is computed or
allocated and the model is left untouched; returns the peak bytes MemTracker saw, or None where the
model cannot run on fakes. Independent of fxmem's own cost model: it is what eager PyTorch would hold, for the plan table to
set beside fxmem's no-recompute step. A caller that also needs the model's outputs (`fxmem.trace.loss`: where the
loss is) reads them in the same fake step (`read=`), so the model runs on fakes once per input signature.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._dynamo.eval_frame import _set_in_optimized_module
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from fxmem.trace.loss import loss_of
from fxmem.stage_times import stage

log = logging.getLogger("fxmem")


def eager_peak_bytes(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                     read: Callable[[Any], Any] | None = None) -> int | None:
    """Peak bytes of one eager training step (forward, `fxmem.trace.loss.loss_of`, backward, the outputs
    held until backward ends) of `model` on `args`/`kwargs`, as MemTracker sees it on fake tensors.
    `read(outputs)`, called on the model's fake outputs before backward, returns the outputs the step
    holds instead (a wrapper's forward that detaches some)."""
    try:
        with stage("eager meter"), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            state = {name: fake(p.detach()).requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
            state |= {name: fake(b) for name, b in model.named_buffers()}
            fargs, fkwargs = pytree.tree_map(fake, tuple(args)), pytree.tree_map(fake, dict(kwargs))
            tracker = MemTracker()
            tracker.track_external(*state.values(), *[x for x in pytree.tree_leaves((fargs, fkwargs))
                                                       if isinstance(x, torch.Tensor)])
            # module hooks step aside (as for compiled modules), so a meter the caller runs around this
            # call keeps its module hierarchy; the peak per device needs none
            with tracker, torch.enable_grad(), _set_in_optimized_module():
                out = torch.func.functional_call(model, state, fargs, fkwargs)
                if read is not None:
                    out = read(out)
                loss_of(out).backward()  # the outputs held until backward ends, as fxmem counts them
                del out
            return max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    except Exception as exc:  # a meter that cannot run says so and leaves the row out
        log.info("fxmem: PyTorch eager's peak could not be measured on fake tensors: %s", exc)
        return None

