"""Stage costs: units of a captured graph priced from AOTAutograd's joint graph, as a StageProblem.

Reads the captured graph (units tagged by `passes/shard.py`), the joint graph's `meta["fxmem"]["cost"]`,
`meta["from_node"]` and `meta["seq_nr"]`, and the eager plan's saved bytes; returns the torch-free
`StageProblem` the stage solver reads, and other frameworks' splits of the same units. Writes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx

from fxmem.errors import FxmemError
from fxmem.price.optimizer_state import bytes_per_param_byte
from fxmem.passes.shard import Unit, crossing, value_bytes
from fxmem.planner.plan import Plan
from fxmem.solve.stages import StageProblem, min_max_cuts
from fxmem.meta_keys import COST, UNIT, tag, has_tag

# Bytes/s between neighbouring stages: gloo over loopback on CPU, NVLink-class links on GPUs.
LINK_BYTES_PER_S = {"cpu": 5e9}
DEFAULT_LINK_BYTES_PER_S = 100e9


@dataclasses.dataclass(frozen=True)
class PipelineRequest:
    num_stages: int
    schedule: str = "1f1b"
    n_microbatches: int | None = None
    optimizer: str | float | None = None


def _source(node: torch.fx.Node, names: set[str]) -> str | None:
    """The captured-graph node a joint forward node was traced from (`meta["from_node"]` provenance)."""
    todo = list(node.meta.get("from_node") or ())
    while todo:
        src = todo.pop(0)
        if src.name in names:
            return src.name
        todo.extend(getattr(src, "from_node", None) or ())
    return None


def unit_costs(joint: torch.fx.GraphModule, gm: torch.fx.GraphModule, num_units: int, saved_bytes: dict[str, int]):
    """Per unit: forward seconds, backward seconds, bytes saved for backward. Seconds from the joint
    graph's `meta["fxmem"]["cost"]`; backward nodes follow their forward node through `meta["seq_nr"]`.
    `saved_bytes`: per joint node, the storage bytes the eager step keeps for backward (a view's
    base counted once), as the whole model's eager plan rows give them."""
    unit_by_name = {n.name: tag(n, UNIT) for n in gm.graph.nodes if has_tag(n, UNIT)}
    names = set(unit_by_name)
    fwd, bwd, saved = [0.0] * num_units, [0.0] * num_units, [0] * num_units
    by_seq: dict[int, int] = {}
    backward = []
    for node in joint.graph.nodes:
        cost = tag(node, COST)
        if cost is None:
            continue
        if node.meta.get("partitioner_tag") == "is_backward":
            backward.append((node, cost))
            continue
        src = _source(node, names)
        if src is None:
            continue
        u = unit_by_name[src]
        fwd[u] += cost.seconds
        saved[u] += saved_bytes.get(node.name, 0)
        if "seq_nr" in node.meta:
            by_seq.setdefault(node.meta["seq_nr"], u)
    for node, cost in backward:
        u = by_seq.get(node.meta.get("seq_nr"))
        if u is not None:
            bwd[u] += cost.seconds
    return fwd, bwd, saved


def _unit_params(gm: torch.fx.GraphModule, model: torch.nn.Module, num_units: int):
    """Parameters each unit reads, by the model's own (deduplicated) names."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    readers: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and _is_param(gm, node.target):
            params, users = [gm.get_parameter(node.target)], list(node.users)
        elif node.op == "call_module" and has_tag(node, UNIT):
            params, users = list(gm.get_submodule(node.target).parameters()), [node]
        else:
            continue
        for value in params:
            if id(value) not in canonical:
                continue
            name = canonical[id(value)]
            sizes[name] = value.numel() * value.element_size()
            for user in users:
                if has_tag(user, UNIT):
                    readers.setdefault(name, set()).add(tag(user, UNIT))
    return readers, sizes


def _is_param(gm: torch.fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def build_problem(gm, model, units: list[Unit], joint, saved_bytes, *, budget_bytes, request: PipelineRequest,
                  device_name: str, n_microbatches: int) -> tuple[StageProblem, dict[str, set[int]]]:
    n = len(units)
    fwd, bwd, saved = unit_costs(joint, gm, n, saved_bytes)
    readers, sizes = _unit_params(gm, model, n)
    own = [0] * n
    shared = []
    for name in sorted(readers):
        users = tuple(sorted(readers[name]))
        if len(users) == 1:
            own[users[0]] += sizes[name]
        else:
            shared.append((sizes[name], users))
    cuts = crossing(gm, n)
    cut_bytes = tuple(sum(value_bytes(v) for v in c) for c in cuts)
    entry = [0] * n  # what a checkpointed unit keeps: the values it reads from before it
    for u in range(1, n):
        entry[u] = cut_bytes[u - 1]
    entry[0] = sum(value_bytes(p) for p in gm.graph.find_nodes(op="placeholder"))
    problem = StageProblem(
        names=tuple(u.label for u in units), time_s=tuple(f + b for f, b in zip(fwd, bwd)),
        param_bytes=tuple(own), act_bytes=tuple(saved), cut_bytes=cut_bytes,
        num_stages=request.num_stages, budget_bytes=budget_bytes, schedule=request.schedule,
        n_microbatches=n_microbatches, recompute_s=tuple(fwd), ckpt_bytes=tuple(entry), shared=tuple(shared),
        opt_bytes_per_param_byte=bytes_per_param_byte(request.optimizer),
        link_bytes_per_s=LINK_BYTES_PER_S.get(device_name, DEFAULT_LINK_BYTES_PER_S))
    return problem, readers


def _input_specs(args: Sequence[Any]) -> list[dict[str, Any]]:
    specs = []
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            raise FxmemError(f"pipeline planning takes tensor inputs only; input {i} is {type(x).__name__}. "
                             "Bind other arguments in the model (functools.partial or a wrapper module)")
        specs.append({"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")})
    return specs


def _example(spec: dict[str, Any], requires_grad: bool = False) -> torch.Tensor:
    t = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    return t.requires_grad_(requires_grad and t.is_floating_point())


def problem_from_plan(plan: Plan, **changes: Any) -> StageProblem:
    """The stage problem a pipeline plan was solved from (to compare other splits with the same costs)."""
    info = plan.pipeline
    problem = StageProblem(
        names=info.units, time_s=info.unit_time_s, param_bytes=info.unit_param_bytes,
        act_bytes=info.unit_act_bytes, cut_bytes=info.cut_bytes, num_stages=info.num_stages,
        budget_bytes=info.budget_bytes, schedule=info.schedule, n_microbatches=info.n_microbatches,
        recompute_s=info.unit_recompute_s, ckpt_bytes=info.unit_ckpt_bytes, shared=info.shared,
        opt_bytes_per_param_byte=info.opt_bytes_per_param_byte, link_bytes_per_s=info.link_bytes_per_s)
    return dataclasses.replace(problem, **changes) if changes else problem


def layer_units(names: Sequence[str]) -> list[int]:
    """Units that are the repeated layers of the model's largest layer list: the units whose module
    path starts with the same name before its first index (`blocks.3`, `stages.1.0`, `layers.4`)."""
    groups: dict[str, list[int]] = {}
    indices: dict[str, set[str]] = {}
    for u, name in enumerate(names):
        parts = name.split(".")
        first_index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if first_index:
            key = ".".join(parts[:first_index])
            groups.setdefault(key, []).append(u)
            indices.setdefault(key, set()).add(parts[first_index])
    best = max(groups, key=lambda k: (len(indices[k]), len(groups[k])), default=None)
    return groups[best] if best is not None else []


def baseline_cuts(plan: Plan, method: str) -> tuple[int, ...]:
    """Other frameworks' splits of the same units: "uniform" (equal layers per stage, the embedding
    with the first and the head with the last; torchtitan, DeepSpeed partition_method='uniform') or
    "parameters" (equal parameter bytes; DeepSpeed's default)."""
    info = plan.pipeline
    S, names = info.num_stages, info.units
    if method == "parameters":
        weights = list(info.unit_param_bytes)
        for size, users in info.shared:
            weights[users[0]] += size
        return min_max_cuts(weights, S)
    if method != "uniform":
        raise ValueError(f"method must be 'uniform' or 'parameters', got {method!r}")
    layers = layer_units(names) or list(range(len(names)))
    if len(layers) < S:
        raise ValueError(f"{len(layers)} layers cannot fill {S} stages with the uniform split")
    return tuple(layers[(k * len(layers)) // S] for k in range(1, S))
