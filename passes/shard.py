"""Shard pass: group a captured graph's nodes into units, and cut it into a chain of stage modules.

Tags each node `meta["fxmem"]["unit"]` (index of its unit: a maximal run of nodes under the same
unit (`fxmem.trace.units`), e.g. `blocks.3` or `model.layers.3`, or a run of top-level ops), then builds one
GraphModule per stage. Stage k takes the values crossing cut k-1 (the model's inputs for stage 0)
and returns those crossing cut k (the model's outputs for the last stage): values a later stage
reads pass through the stages between, because a `torch.distributed.pipelining` stage receives
only from the previous one (`torch.fx.passes.split_module` would wire them to the reader directly).
Stage modules hold the model's own parameters under their original names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.trace.module_path import clean_path
from fxmem.errors import FxmemError
from fxmem.trace.units import unit_path
from fxmem.meta_keys import PARAM_NAMES, UNIT, has_tag, tag, tags

class ShardError(FxmemError, ValueError):
    """The graph cannot be cut where asked."""


@dataclass(frozen=True)
class Unit:
    """A run of graph nodes the stage solver will not cut: its label and node names."""

    label: str
    nodes: tuple[str, ...]


def _skipped(node: torch.fx.Node) -> bool:
    """Nodes that belong to no unit: inputs, parameters, the output, export's input guard."""
    return node.op in ("placeholder", "get_attr", "output") or (node.op == "call_module" and node.target == "_guards_fn")


def _unit_key(node: torch.fx.Node, model: torch.nn.Module) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [clean_path(p if isinstance(p, str) else str(p)) for p, _ in stack.values()]
    paths = [p for p in paths if p]
    if paths:
        return unit_path(model, paths[-1])
    if node.op == "call_module":
        return unit_path(model, str(node.target))
    return ""


def tag_units(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[Unit]:
    """Group `gm`'s nodes into units; a cut that a non-tensor value would cross merges its neighbours."""
    runs: list[tuple[str, list[torch.fx.Node]]] = []
    for node in gm.graph.nodes:
        if _skipped(node):
            continue
        key = _unit_key(node, model)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    index = {n: u for u, (_, nodes) in enumerate(runs) for n in nodes}
    merge_after = set()  # cut after unit u cannot carry a non-tensor value
    for node, u in index.items():
        if isinstance(node.meta.get("val"), torch.Tensor):
            continue
        last = max((_use_unit(user, index, len(runs)) for user in node.users), default=u)
        merge_after.update(range(u, last))
    units: list[Unit] = []
    labels: list[str] = []
    members: list[list[torch.fx.Node]] = []
    for u, (key, nodes) in enumerate(runs):
        if u - 1 in merge_after and members:
            members[-1].extend(nodes)
            if key and key not in labels[-1].split(" + "):
                labels[-1] += f" + {key}"
            continue
        members.append(list(nodes))
        labels.append(key or _top_level_label(nodes))
    for u, nodes in enumerate(members):
        for node in nodes:
            tags(node)[UNIT] = u
        units.append(Unit(labels[u], tuple(n.name for n in nodes)))
    return units


def _top_level_label(nodes: list[torch.fx.Node]) -> str:
    """A run of ops in the model's own forward, outside any submodule: '(top-level ops: size, arange +2)'."""
    names = [n.name for n in nodes if not n.name.startswith(("getattr", "getitem"))] or [nodes[0].name]
    return f"(top-level ops: {', '.join(names[:2])}" + (f" +{len(names) - 2})" if len(names) > 2 else ")")


def _use_unit(user: torch.fx.Node, index: dict, n: int) -> int:
    if user.op == "output":
        return n
    if user in index:
        return index[user]
    return max((_use_unit(u, index, n) for u in user.users), default=n)


def unit_of(node: torch.fx.Node, num_units: int) -> int:
    """The unit a node runs in (-1 for the model's inputs, num_units for the output)."""
    if node.op == "placeholder":
        return -1
    if node.op == "output":
        return num_units
    return tag(node, UNIT)


def crossing(gm: torch.fx.GraphModule, num_units: int) -> list[list[torch.fx.Node]]:
    """For each cut k (between units k and k+1), the values made at or before unit k and read after it."""
    cuts: list[list[torch.fx.Node]] = [[] for _ in range(num_units - 1)]
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output") or (node.op != "placeholder" and not has_tag(node, UNIT)):
            continue
        made = unit_of(node, num_units)
        readers = [unit_of(u, num_units) for u in node.users if u.op == "output" or has_tag(u, UNIT)]
        for k in range(max(made, 0), min(max(readers, default=made), num_units - 1)):
            cuts[k].append(node)
    return cuts


def value_bytes(node: torch.fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(node.meta.get("val"))
               if isinstance(t, torch.Tensor))


def split_stages(gm: torch.fx.GraphModule, first_units: list[int], num_units: int) -> list[torch.fx.GraphModule]:
    """One GraphModule per stage; stage k runs units first_units[k] .. first_units[k+1]-1."""
    bounds = [0, *first_units, num_units]
    cuts = crossing(gm, num_units)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stages = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        takes = inputs if k == 0 else cuts[lo - 1]
        gives = None if hi == num_units else cuts[hi - 1]
        stages.append(_stage_module(gm, lo, hi, takes, gives, num_units))
    return stages


def _stage_module(gm: torch.fx.GraphModule, lo: int, hi: int, takes: list[torch.fx.Node],
                  gives: list[torch.fx.Node] | None, num_units: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in takes:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and any(_runs_in(u, lo, hi, num_units) for u in node.users):
            env[node] = graph.node_copy(node, lambda n: env[n])
        elif not _skipped(node) and lo <= tag(node, UNIT) < hi:
            missing = [i.name for i in node.all_input_nodes if i not in env]
            if missing:
                raise ShardError(f"stage of units {lo}..{hi - 1}: node {node.name} reads {missing}, which no "
                                 "earlier stage passes on; the graph is not in topological order")
            env[node] = graph.node_copy(node, lambda n: env[n])
    if gives is None:
        out = gm.graph.output_node()
        leaves = [env[x] if isinstance(x, torch.fx.Node) else x for x in pytree.tree_leaves(out.args[0])]
        graph.output(leaves[0] if len(leaves) == 1 else tuple(leaves))
    else:
        graph.output(tuple(env[n] for n in gives))
    stage = torch.fx.GraphModule(gm, graph, class_name=f"Stage_{lo}_{hi - 1}")
    tags(stage)[PARAM_NAMES] = {name: name for name, _ in stage.named_parameters(remove_duplicate=False)}
    return stage


def _runs_in(node: torch.fx.Node, lo: int, hi: int, num_units: int) -> bool:
    return not _skipped(node) and lo <= tag(node, UNIT) < hi
