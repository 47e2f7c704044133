"""What a plan reports of its joint graph: the memory breakdown, a row per value backward may need,
where its times come from, the gradients it returns and the device it was traced on.

Reads the joint graph's nodes and `meta["val"]`, the lowered problem and the cost table; writes nothing.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.price.cost import CostTable, DeviceSpec
from fxmem.price.kernel_timer import KernelTimer
from fxmem.price.memory import EXACT, AllocatorModel, storages_of
from fxmem.planner.plan import NodeRow
from fxmem.price.joint_problem import JointSplit, Lowered

HELD = "held by the step's other graphs"


def breakdown(split: JointSplit, allocator: AllocatorModel = EXACT) -> dict[str, int]:
    static, grads = {}, {}
    for node in split.primals:
        static.update(storages_of(node))
    for node in split.grads:
        grads.update(storages_of(node))
    parts = {"parameters, buffers and inputs": sum(static.values()), "gradients": sum(grads.values())}
    workspaces = allocator.workspaces(split.forward, split.backward)
    held = max(allocator.held_forward, allocator.held_backward)
    return parts | ({"BLAS workspaces": workspaces} if workspaces else {}) | ({HELD: held} if held else {})


def node_rows(lowered: Lowered, costs: CostTable, saved: set[str], recomputed: set[str],
               offloaded: set[str] = frozenset()) -> tuple[NodeRow, ...]:
    rows = []
    for i, node in enumerate(lowered.nodes):
        cost = costs[node.name]
        decision = "save" if node.name in saved else "recompute" if node.name in recomputed else "free"
        decision = "offload" if node.name in offloaded else decision
        kept = lowered.problem.size[i] if lowered.problem.can_save[i] else 0
        rows.append(NodeRow(node.name, cost.op, cost.module, kept, cost.flops, cost.seconds, decision))
    return tuple(rows)


def timing(device: DeviceSpec, timer: KernelTimer | None) -> str:
    if timer is None or not timer.measured:
        return f"{device.name} roofline"
    return f"{timer.measured} kernels measured on {timer.device}, the rest by the {device.name} roofline"


def trained_parameters(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """The gradients the joint graph returns (one per parameter the step trains, or input it differentiates)."""
    outputs = pytree.tree_leaves(joint.graph.find_nodes(op="output")[0].args)
    return sum(1 for out in outputs[num_fwd_outputs:] if out is not None)


def graph_device(joint: torch.fx.GraphModule) -> torch.device:
    """The device the joint graph's inputs live on (the first placeholder with a tensor value)."""
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")
