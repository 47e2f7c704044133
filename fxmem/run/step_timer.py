"""What a planned step costs beyond its kernels, measured on the device here.

A step that fxmem runs is its kernels plus Python: the graphs' generated code calling one op at a
time (views included), AOTAutograd's wrappers, the autograd engine, one gradient accumulation per
parameter, and the optimized module's own bookkeeping. On a CPU, or a GPU whose kernels are shorter
than their launch, that is most of a small model's step, and it decides which micro-batch size is
fastest (`fxmem.fit_batch`). `measured_overheads` times two synthetic models (chains of k one-element
scale modules, each with one parameter) through `fxmem`'s own runtime, prices them with the same
device spec and kernel timer, and fits what the price list misses: seconds per step and per parameter
tensor; a view op's seconds come from timing one the way the generated code calls it.

The memory rate (`bytes_per_s`) is timed too, on an add of tensors larger than a CPU's caches (a step's
activations stream through memory: timed in cache, the rate was 4x what a GPT-2's fused kernels
reached in its step): what fused pointwise code costs per byte here.

Reads nothing of the user's model; returns the `DeviceSpec` with `step_overhead_s`,
`param_overhead_s`, `view_overhead_s` and `bytes_per_s` set; cached per device and spec in the process.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import torch

from fxmem.price.cost import DeviceSpec
from fxmem.run.engine import OptimizedModule, signature_of
from fxmem.planner.planner import PlanRequest

CHAIN_LENGTHS = (4, 32)  # modules per synthetic model
BANDWIDTH_NUMEL = 1 << 24  # elements per tensor timed for the memory rate: 64 MiB, past a CPU's caches
WARMUP, STEPS = 5, 25


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def measured_overheads(spec: DeviceSpec, device: torch.device | str) -> DeviceSpec:
    """`spec` with its per-step, per-parameter and per-view seconds measured on `device`."""
    return _measured(spec, torch.device(device).type)


@functools.cache
def _measured(spec: DeviceSpec, device_type: str) -> DeviceSpec:
    device = torch.device(device_type)
    bare = dataclasses.replace(spec, step_overhead_s=0.0, param_overhead_s=0.0, view_overhead_s=0.0)
    missed = {k: _unpriced_seconds(k, bare, device) for k in CHAIN_LENGTHS}
    short, long = CHAIN_LENGTHS
    per_param = max(0.0, (missed[long] - missed[short]) / (long - short))
    per_step = max(0.0, missed[short] - short * per_param)
    return dataclasses.replace(spec, step_overhead_s=per_step, param_overhead_s=per_param,
                               view_overhead_s=_view_seconds(device), bytes_per_s=_bytes_per_s(device))


def _unpriced_seconds(k: int, spec: DeviceSpec, device: torch.device) -> float:
    """Measured step time of a chain of `k` scale modules run by fxmem, less its predicted time."""
    model = torch.nn.Sequential(*[_Scale() for _ in range(k)]).to(device)
    x = torch.ones(1, device=device)

    def request(module: torch.nn.Module, args: tuple, kwargs: dict) -> PlanRequest:
        return PlanRequest(device=spec, calibrate=True, model="overhead probe",
                           signature=signature_of(module, args, kwargs))

    step = OptimizedModule(model, request, None)

    def run() -> float:
        started = time.perf_counter()
        step(x).sum().backward()
        step.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    for _ in range(WARMUP):
        run()
    measured = statistics.median(run() for _ in range(STEPS))
    return measured - step.plan.predicted_step_s


def _bytes_per_s(device: torch.device, numel: int = BANDWIDTH_NUMEL) -> float:
    """Bytes a memory-bound kernel moves per second here: an add of two float32 tensors of `numel`
    elements into a third, timed (the best of a few runs, its launch included); Inductor's fused
    code is priced by its traffic at this rate (`fxmem.price.inductor_time`)."""
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    out = torch.empty_like(a)
    times = []
    for _ in range(WARMUP + STEPS):
        started = time.perf_counter()
        torch.add(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return 3 * numel * a.element_size() / min(times[WARMUP:])


def _view_seconds(device: torch.device) -> float:
    """One view op called as the generated code calls it (through its OpOverload)."""
    view, x = torch.ops.aten.view.default, torch.ones(4, device=device)
    for _ in range(100):
        view(x, [2, 2])
    started = time.perf_counter()
    for _ in range(1000):
        view(x, [2, 2])
    return (time.perf_counter() - started) / 1000
