"""Recompute pass: cut a joint forward/backward graph into the forward and backward graphs a plan asks for.

Reads the plan's saved and recomputed node names; tags each joint node with torch's
`meta["recompute"]` (`CheckpointPolicy`: MUST_SAVE or MUST_RECOMPUTE, which torch's own
partitioner obeys under compile), then extracts the forward graph (returns outputs + saved values)
and the backward graph, where each recomputed value is placed just before its first use (as the
autograd engine would order it). Graphs extracted only to be read (the planner simulates each candidate
decision's graphs) can be made lazy: their Python code is generated when they first run, not at extraction.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch.fx
from torch._functorch.partitioners import _extract_fwd_bwd_modules, reordering_to_mimic_autograd_engine
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.passes.runner import StepGraphs


def recompute_pass(graphs: StepGraphs, plan: Any) -> StepGraphs:
    """The forward and backward graphs that keep `plan.saved` and recompute `plan.recompute`."""
    tag_decisions(graphs.joint, plan.saved, plan.recompute)
    fw, bw = partition(graphs.joint, plan.saved, num_fwd_outputs=graphs.num_fwd_outputs)
    return graphs.replace(fw=fw, bw=bw)


def tag_decisions(joint: torch.fx.GraphModule, saved: Iterable[str], recomputed: Iterable[str]) -> torch.fx.GraphModule:
    saved, recomputed = set(saved), set(recomputed)
    for node in joint.graph.nodes:
        if node.name in saved:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif node.name in recomputed:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return joint


def partition(joint: torch.fx.GraphModule, saved: Iterable[str], *, num_fwd_outputs: int, lazy: bool = False
              ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Forward and backward graphs that keep exactly `saved` (joint node names) between them. `lazy`: as
    torch's lazy graph modules, whose code is generated at their first run (graphs that are only read and
    rewritten, as the planner's simulation does, never pay for it)."""
    by_name = {n.name: n for n in joint.graph.nodes}
    missing = [name for name in saved if name not in by_name]
    if missing:
        raise KeyError(f"saved values not in the joint graph: {missing[:5]}")
    order = {name: i for i, name in enumerate(by_name)}
    saved_nodes = [by_name[name] for name in sorted(saved, key=order.__getitem__)]
    with _use_lazy_graph_module(lazy):
        fw, bw = _extract(joint, saved_nodes, num_fwd_outputs, lazy)
        # A saved value backward ends up not reading (reordering drops its only reader, a node no gradient
        # needs) would still be held from forward to the end of backward: extract again without it. Lazy
        # graphs, only read, need not where each such value is a parameter, buffer or input: on the device
        # for the whole step, so held or not the same bytes.
        unread = {p.name for p in bw.graph.find_nodes(op="placeholder")
                  if not p.users and not p.name.startswith("tangents")}
        if unread and not (lazy and unread <= {p.name for p in joint.graph.find_nodes(op="placeholder")}):
            saved_nodes = [n for n in saved_nodes if n.name not in unread]
            fw, bw = _extract(joint, saved_nodes, num_fwd_outputs, lazy)
    return fw, bw


def _extract(joint: torch.fx.GraphModule, saved_nodes: list[torch.fx.Node], num_fwd_outputs: int, lazy: bool
             ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    fw, bw = _extract_fwd_bwd_modules(joint, saved_nodes, [], num_fwd_outputs=num_fwd_outputs)
    bw = reordering_to_mimic_autograd_engine(bw)  # a GraphModule whatever the flag: made lazy below
    return fw, _LazyGraphModule.from_graphmodule(bw) if lazy else bw
