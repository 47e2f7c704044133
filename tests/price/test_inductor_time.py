"""fxmem.price.inductor_time: Inductor's step priced by the kernels it runs: fused code by its traffic and one
launch (and its costly arithmetic, where a kernel timer is given), an aten kernel Inductor calls by the
kernel timer where one is given, a step's fixed costs once."""
from __future__ import annotations

import pytest
import torch
import torch.fx

from functorch.compile import default_partition

from fxmem.price.cost import DEVICE_PRESETS
from fxmem.price.inductor_memory import KernelWork, ScheduledGraph
from fxmem.run.inductor.planning import compile_with_partitioner, schedule
from fxmem.price.inductor_time import graph_seconds, kernel_seconds, step_seconds
from fxmem.price.kernel_timer import KernelTimer
from fxmem.run.inductor.step import has_cxx_compiler

needs_compiler = pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor on CPU needs a C++ compiler")


class _Timer:
    """A kernel timer that answers `seconds` with a given function and prices no arithmetic."""

    def __init__(self, seconds):
        self.seconds = seconds

    def compute_seconds(self, node):
        return 0.0

    def access_seconds(self, direction, dtype, elements):
        return 0.0


def _matmul_node() -> torch.fx.Node:
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    return graph.call_function(torch.ops.aten.mm.default, (a, b))


def test_fused_code_costs_its_traffic_and_one_launch():
    cpu = DEVICE_PRESETS["cpu"]
    fused = KernelWork(bytes_moved=30_000_000, flops=0, dtype=torch.float32)
    assert kernel_seconds(fused, cpu) == cpu.op_overhead_s + 30_000_000 / cpu.bytes_per_s
    # twice the bytes, one launch: the overhead is paid once
    doubled = KernelWork(bytes_moved=60_000_000, flops=0, dtype=torch.float32)
    assert kernel_seconds(doubled, cpu) - kernel_seconds(fused, cpu) == 30_000_000 / cpu.bytes_per_s


def test_an_aten_kernel_is_timed_where_a_timer_can_and_priced_by_the_roofline_where_not():
    cpu, node = DEVICE_PRESETS["cpu"], _matmul_node()
    matmul = KernelWork(bytes_moved=3 * 4 * 512 * 512, flops=2 * 512**3, dtype=torch.float32, origin=node)
    roofline = cpu.seconds(matmul.flops, matmul.bytes_moved, torch.float32)
    assert kernel_seconds(matmul, cpu) == roofline
    assert kernel_seconds(matmul, cpu, timer=_Timer(lambda n: 0.25 if n is node else None)) == 0.25
    assert kernel_seconds(matmul, cpu, timer=_Timer(lambda n: None)) == roofline  # the timer could not run it
    # fused code has no aten op to time: the timer is not asked
    fused = KernelWork(bytes_moved=1000, flops=0)
    assert kernel_seconds(fused, cpu, timer=_Timer(lambda n: 1.0)) == kernel_seconds(fused, cpu)


def test_a_step_is_its_two_graphs_kernels_and_its_fixed_costs():
    cpu, node = DEVICE_PRESETS["cpu"], _matmul_node()
    forward = ScheduledGraph((), ("buf0",), (KernelWork(1_000_000, 0), KernelWork(0, 10**9, origin=node)))
    backward = ScheduledGraph((), ("buf1",), (KernelWork(2_000_000, 0),))
    timer = _Timer(lambda n: 0.01)
    total = step_seconds(forward, backward, cpu, num_parameters=4, timer=timer)
    assert total == graph_seconds(forward, cpu, timer) + graph_seconds(backward, cpu, timer) + cpu.fixed_seconds(4)
    assert graph_seconds(forward, cpu, timer) == kernel_seconds(forward.work[0], cpu) + 0.01


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.tanh(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class _Partitioned(Exception):
    pass


def _forward_as_inductor_runs_it(model: torch.nn.Module, x: torch.Tensor) -> ScheduledGraph:
    """The forward graph Inductor's pipeline partitions (after its decompositions), as Inductor schedules it."""
    graphs = {}

    def partition(joint, inputs, **kwargs):
        graphs["fw"], _ = default_partition(joint, inputs, **kwargs)
        raise _Partitioned

    with pytest.raises(_Partitioned):
        compile_with_partitioner(torch.fx.symbolic_trace(model), [x], partition)
    return schedule(graphs["fw"], False)


@needs_compiler
def test_attention_is_timed_as_the_kernel_it_calls_and_a_fused_tanh_costs_its_arithmetic():
    """Attention's kernel returns a tuple: it is timed as the attention op (not as the getitem picking its
    output, which is free); a fused tanh is priced by its traffic plus what the timer measures its arithmetic at."""
    cpu, timer = DEVICE_PRESETS["cpu"], KernelTimer("cpu")
    forward = _forward_as_inductor_runs_it(_Attention(), torch.randn(2, 64, 32))
    timed = {str(w.origin.target) for w in forward.work if w.origin is not None}
    assert any("scaled_dot_product" in t for t in timed) and not any("getitem" in t for t in timed)
    (fused,) = [w for w in forward.work if torch.ops.aten.tanh.default in {p.target for p in w.parts}]
    (tanh,) = [p for p in fused.parts if p.target is torch.ops.aten.tanh.default]
    assert kernel_seconds(fused, cpu, timer) == kernel_seconds(fused, cpu) + sum(
        timer.compute_seconds(p) for p in fused.parts)


class _Dropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.dropout(self.linear(x), 0.1, training=True))


@needs_compiler
def test_fused_code_that_stores_a_mask_pays_for_its_one_byte_stores():
    """A dropout's mask, saved for backward, is stored as bools by fused code: on a CPU far dearer than its
    bytes, so the kernel pays what the timer measures per bool stored."""
    cpu = DEVICE_PRESETS["cpu"]
    forward = _forward_as_inductor_runs_it(_Dropout(), torch.randn(2, 64, 32))
    (masked,) = [w for w in forward.work if w.narrow]
    assert masked.narrow == (("store", torch.bool, 2 * 64 * 96),)

    class Priced(_Timer):
        def access_seconds(self, direction, dtype, elements):
            return 1e-9 * elements if (direction, dtype) == ("store", torch.bool) else 0.0

    timer = Priced(lambda n: None)
    assert kernel_seconds(masked, cpu, timer) == pytest.approx(kernel_seconds(masked, cpu) + 1e-9 * 2 * 64 * 96)


class _Normed(torch.nn.Module):
    """Layer norm, softmax, dropout and log-softmax: reductions Inductor's C++ code loops over."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 512)
        self.norm = torch.nn.LayerNorm(512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.nn.functional.dropout(torch.softmax(self.norm(self.linear(x)), -1), 0.1, training=True)
        return torch.nn.functional.log_softmax(scores, -1).sum()


def _described(graph: ScheduledGraph) -> tuple:
    return graph.events, graph.outputs, tuple(
        (w.bytes_moved, w.flops, w.dtype, getattr(w.origin, "name", None), tuple(p.name for p in w.parts), w.narrow)
        for w in graph.work)


@needs_compiler
def test_a_schedule_read_off_scalar_code_is_the_one_vectorized_code_gives(monkeypatch):
    """Plans are scheduled with Inductor's C++ code unvectorized (30% less time): the buffers, their reuse
    and each kernel's work read off it are those of the vectorized code the step runs."""
    import fxmem.run.inductor.planning as inductor_plan

    graphs = {}

    def partition(joint, inputs, **kwargs):
        graphs["fw"], graphs["bw"] = default_partition(joint, inputs, **kwargs)
        raise _Partitioned

    with pytest.raises(_Partitioned):
        compile_with_partitioner(torch.fx.symbolic_trace(_Normed()), [torch.randn(8, 64)], partition)
    scalar = [schedule(graphs["fw"], False), schedule(graphs["bw"], True)]
    assert inductor_plan.SCHEDULE_CONFIG == {"cpp.simdlen": 1}
    monkeypatch.setattr(inductor_plan, "SCHEDULE_CONFIG", {})
    vectorized = [schedule(graphs["fw"], False), schedule(graphs["bw"], True)]
    assert [_described(g) for g in scalar] == [_described(g) for g in vectorized]
    assert any(w.parts for w in scalar[1].work) and any(event[0] == "share" for g in scalar for event in g.events)
