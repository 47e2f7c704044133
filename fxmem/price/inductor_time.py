"""What Inductor's step costs in time: its kernels priced as they run, after fusion.

A planned graph priced op by op (`fxmem.price.cost.estimate`) counts a kernel and its memory traffic for
every op; Inductor runs far fewer kernels. Here the kernels of the step as Inductor schedules it
(`fxmem.price.inductor_memory.ScheduledGraph`, its `work`) are priced instead: an aten kernel Inductor
calls (a matmul, attention; `KernelWork.origin`) is timed on the device here where a kernel timer is
given (`fxmem.price.kernel_timer`, the planner's `calibrate`), else priced by the device's roofline; fused
code is priced by the roofline on the bytes it reads and writes (Inductor's count), which is what
a pointwise chain costs once fused: its memory traffic, and one launch, plus, where a timer is given,
the arithmetic of its costly ops (exp, tanh, log: on a CPU, more than their traffic) as timed in cache,
and its loads and stores of one-byte values (masks), which on a CPU cost far more than their bytes.

Reads `ScheduledGraph`s and a `fxmem.price.cost.DeviceSpec`; writes nothing.
"""
from __future__ import annotations

from fxmem.price.cost import DeviceSpec
from fxmem.price.inductor_memory import KernelWork, ScheduledGraph
from fxmem.price.kernel_timer import KernelTimer


def kernel_seconds(work: KernelWork, device: DeviceSpec, timer: KernelTimer | None = None) -> float:
    """Seconds of one kernel: an aten kernel as `timer` measures its op, where it can; else the slower
    of its FLOPs and its bytes at the device's rates, plus the device's per-kernel overhead, and for fused
    code, where a timer is given, its ops' arithmetic as the timer measures it in cache (`compute_seconds`:
    an exp, a tanh cost more than the bytes they read on a CPU) and its one-byte loads and stores
    (`access_seconds`)."""
    if work.origin is not None and timer is not None:
        measured = timer.seconds(work.origin)
        if measured is not None:
            return measured
    roofline = device.seconds(work.flops, work.bytes_moved, work.dtype)
    if timer is None:
        return roofline
    return (roofline + sum(timer.compute_seconds(part) for part in work.parts)
            + sum(timer.access_seconds(*access) for access in work.narrow))


def graph_seconds(graph: ScheduledGraph, device: DeviceSpec,
                  timer: KernelTimer | None = None) -> float:
    """Seconds of one graph's kernels, run one after another as Inductor's code runs them."""
    return sum(kernel_seconds(work, device, timer) for work in graph.work)


def step_seconds(forward: ScheduledGraph, backward: ScheduledGraph, device: DeviceSpec, num_parameters: int,
                 timer: KernelTimer | None = None) -> float:
    """Seconds of a training step that runs `forward` and `backward` as Inductor scheduled them: their
    kernels, and the step's fixed costs (per step and per parameter trained, `DeviceSpec.fixed_seconds`)."""
    return (graph_seconds(forward, device, timer) + graph_seconds(backward, device, timer)
            + device.fixed_seconds(num_parameters))
