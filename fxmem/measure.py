"""Independent memory meter for one training step: on CPU MemTracker, and for compiled code also the CPU
allocator (the profiler's memory events above the step's start, plus what was allocated before it:
Inductor's code allocates its buffers where no dispatch mode sees them), the larger of the two; on GPU the CUDA
allocator's (`max_memory_allocated` after a warm-up step, workspaces the step's kernels allocate included).

Reads nothing of fxmem's predictions; runs the step it is given (after one warm-up step) and
returns the peak bytes it saw (parameters, gradients, activations and temporaries). Writes nothing.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Sequence

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fxmem.trace.loss import loss_of


def training_step(module: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None = None) -> Any:
    """Forward, loss, backward; the outputs stay referenced until backward ends, as in a training loop."""
    out = module(*inputs, **(kwargs or {}))
    loss_of(out).backward()
    return out


def measure_peak_bytes(module: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None = None,
                       step: Callable[..., Any] = training_step, warmup: bool = True, keep_grads: bool = False,
                       allocator: bool = False) -> int:
    """Peak bytes of one step, gradients set to None first (as after `zero_grad()`); with `keep_grads`
    the gradients are left as they are (an accumulating micro-batch: they count, and backward adds
    into them). With `warmup` a first, unmeasured step runs before, from the same gradients (it
    compiles and plans the signature measured; it also trains the module once). On CPU, `allocator` also
    reads the CPU allocator (the profiler's memory events), as compiled code needs: Inductor's generated
    code allocates its buffers where MemTracker does not see them (`inner="inductor"`, `torch.compile`)."""
    def zero_grad() -> None:
        for p in module.parameters():
            p.grad = None

    if not keep_grads:
        zero_grad()
    if warmup:  # from the gradients the measured step starts with: it plans that step's signature
        step(module, inputs, kwargs)
        if not keep_grads:
            zero_grad()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return _cuda_peak(device, module, inputs, kwargs, step)
    resident = _resident_bytes(module, inputs) if allocator else 0
    tracker = _StepTracker()
    tracker.track_external(module, *[x for x in inputs if isinstance(x, torch.Tensor)])
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) \
        if allocator else None
    with tracker, profiler or contextlib.nullcontext():
        step(module, inputs, kwargs)
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return max(peak, resident + _allocator_growth(profiler)) if allocator else peak


def _allocator_growth(prof: torch.profiler.profile) -> int:
    """The most bytes the CPU allocator held above the step's start, from the profiler's memory events:
    every allocation, also those of compiled code (Inductor's buffers) that no dispatch mode sees."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _cuda_peak(device: torch.device, module: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None,
               step: Callable[..., Any]) -> int:
    """What `torch.cuda.max_memory_allocated` reports for the step (an out-of-memory error counts the
    same bytes), less only what the caller holds outside it (other models, optimizer state). cuBLAS
    workspaces are freed first, so that the step allocates them again and they count inside it;
    unreachable objects (an earlier model in a reference cycle) are collected first, and the blocks
    the allocator caches are released: a request over 1 MiB takes the smallest cached block that
    holds it and is counted whole when less than 1 MiB more would be left over, so a block cached
    by earlier work (a 32 MiB workspace served from a block 0.9 MiB larger) would count in the step."""
    gc.collect()
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    outside = torch.cuda.memory_allocated(device) - _resident_bytes(module, inputs, block=512)
    step(module, inputs, kwargs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - max(0, outside)


class _StepTracker(MemTracker):
    """MemTracker that Dynamo does not step aside for: Dynamo runs frames eagerly under any other
    TorchDispatchMode, so a plain tracker would measure a compiled module's eager step instead.
    Higher-order ops (torch's rng replay ops in Inductor's graphs, passes/rng.py) come to it whole,
    and their outputs are counted as any op's."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _resident_bytes(module: torch.nn.Module, inputs: Sequence[Any], block: int = 1) -> int:
    """Parameters, buffers, inputs and existing gradients allocated before the step (MemTracker counts them too), each
    rounded up to the allocator's `block` bytes."""
    seen: dict[Any, int] = {}
    tensors = list(module.parameters()) + list(module.buffers()) + [x for x in inputs if isinstance(x, torch.Tensor)]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]  # accumulated into: inside the step
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(-(-n // block) * block for n in seen.values())
