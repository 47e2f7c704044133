"""fxmem.inductor_time: Inductor's step priced by the kernels it runs: fused code by its traffic and one
launch, an aten kernel Inductor calls by the kernel timer where one is given, a step's fixed costs once."""
from __future__ import annotations

import torch
import torch.fx

from fxmem.cost import DEVICE_PRESETS
from fxmem.inductor_memory import KernelWork, ScheduledGraph
from fxmem.inductor_time import graph_seconds, kernel_seconds, step_seconds


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
    assert kernel_seconds(matmul, cpu, timer=lambda n: 0.25 if n is node else None) == 0.25
    assert kernel_seconds(matmul, cpu, timer=lambda n: None) == roofline  # the timer could not run it
    # fused code has no aten op to time: the timer is not asked
    fused = KernelWork(bytes_moved=1000, flops=0)
    assert kernel_seconds(fused, cpu, timer=lambda n: 1.0) == kernel_seconds(fused, cpu)


def test_a_step_is_its_two_graphs_kernels_and_its_fixed_costs():
    cpu, node = DEVICE_PRESETS["cpu"], _matmul_node()
    forward = ScheduledGraph((), ("buf0",), (KernelWork(1_000_000, 0), KernelWork(0, 10**9, origin=node)))
    backward = ScheduledGraph((), ("buf1",), (KernelWork(2_000_000, 0),))
    timer = lambda n: 0.01  # noqa: E731
    total = step_seconds(forward, backward, cpu, num_parameters=4, timer=timer)
    assert total == graph_seconds(forward, cpu, timer) + graph_seconds(backward, cpu, timer) + cpu.fixed_seconds(4)
    assert graph_seconds(forward, cpu, timer) == kernel_seconds(forward.work[0], cpu) + 0.01
