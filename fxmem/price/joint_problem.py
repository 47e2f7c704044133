"""Joint graph -> MemoryProblem: which forward values backward needs, when, and what they cost.

Reads an AOTAutograd joint forward/backward GraphModule (`meta["val"]`, `meta["partitioner_tag"]`)
and a `CostTable` (and the device's `AllocatorModel`: sizes rounded, workspaces in the base);
returns a torch-free `MemoryProblem` whose steps are the joint graph's call_function nodes in order
(forward, then backward) plus the node of each candidate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.fx

from fxmem.price.cost import CostTable, is_pointwise, is_view
from fxmem.price.memory import EXACT, AllocatorModel, Walker, storages_of
from fxmem.solve.problem import NEVER, MemoryProblem, enable_offload


@dataclass(frozen=True)
class JointSplit:
    """The joint graph cut into its forward and backward call_function nodes."""

    forward: tuple[torch.fx.Node, ...]
    backward: tuple[torch.fx.Node, ...]
    primals: tuple[torch.fx.Node, ...]
    tangents: tuple[torch.fx.Node, ...]
    user_outputs: tuple[torch.fx.Node, ...]
    grads: tuple[torch.fx.Node, ...]
    mutated: frozenset[torch.fx.Node]  # primals written back after forward (BatchNorm running stats)


def split_joint(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> JointSplit:
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    primals = [p for p in placeholders if p not in tangents]
    in_backward: set[torch.fx.Node] = set(tangents)
    forward, backward = [], []
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("partitioner_tag") == "is_backward" or any(i in in_backward for i in node.all_input_nodes):
            in_backward.add(node)
            backward.append(node)
        else:
            forward.append(node)
    output = joint.graph.output_node()
    outs = list(torch.utils._pytree.tree_leaves(output.args[0]))
    is_node = lambda n: isinstance(n, torch.fx.Node)  # noqa: E731
    written = {repr(d.mutated_input) for d in output.meta.get("desc") or () if hasattr(d, "mutated_input")}
    mutated = frozenset(p for p in primals if repr(p.meta.get("desc")) in written)
    return JointSplit(tuple(forward), tuple(backward), tuple(primals), tuple(tangents),
                      tuple(filter(is_node, outs[:num_fwd_outputs])), tuple(filter(is_node, outs[num_fwd_outputs:])),
                      mutated)


def can_recompute(node: torch.fx.Node, mutated: frozenset[torch.fx.Node] = frozenset(), replay: bool = True) -> bool:
    """Random ops are recomputed with the generator state they drew from (`passes/rng.py`; with
    `replay` False they are kept unless called to draw nothing). Side effects are kept, and so are
    ops that read an input written back after forward (backward would see the new value)."""
    if node.op != "call_function" or any(i in mutated for i in node.all_input_nodes):
        return False
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):  # fx counts these impure too
        return draws_nothing(node) or (replay and replayable(node))
    return not node.is_impure()


def replayable(node: torch.fx.Node) -> bool:
    """A random op `passes/rng.py` can recompute with the same numbers: an aten op whose values live
    on the CPU or a CUDA device (generators whose state can be saved and set)."""
    values = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return (isinstance(node.target, torch._ops.OpOverload) and bool(values)
            and all(v.device.type in ("cpu", "cuda") for v in values))


def draws_nothing(node: torch.fx.Node) -> bool:
    """A random-tagged op called so that it draws no random numbers: attention with `dropout_p=0`
    (every `scaled_dot_product_*` kernel is tagged for its dropout), dropout with p=0 or not training."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    given = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
             for i, a in enumerate(schema.arguments)}
    if "dropout_p" in given:
        return given["dropout_p"] == 0
    if schema.name == "aten::native_dropout":
        return given.get("p") == 0 or given.get("train") is False
    return False


def _multi_output(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


@dataclass(frozen=True)
class Lowered:
    problem: MemoryProblem
    nodes: tuple[torch.fx.Node, ...]  # candidate index -> joint node
    primals: tuple[torch.fx.Node, ...]


def build_problem(joint: torch.fx.GraphModule, split: JointSplit, costs: CostTable, budget: int,
                  allocator: AllocatorModel = EXACT, replay_random: bool = True, fused: bool = False) -> Lowered:
    """`fused`: the step runs as Inductor's code, so a recomputed pointwise op whose readers all fuse it
    (`fuses_when_recomputed`) holds no bytes of its own (`MemoryProblem.fused`)."""
    steps = list(split.forward) + list(split.backward)
    step_of = {n: i for i, n in enumerate(steps)}
    num_fw = len(split.forward)
    forward_set = set(split.forward)

    static: dict[Hashable, int] = {}
    for p in split.primals:
        static.update(storages_of(p))
    held = {k for n in split.user_outputs for k in storages_of(n)}
    output_node = joint.graph.output_node()
    walker = Walker(static, allocator, allocator.workspaces(split.forward, split.backward))
    walker.walk(list(split.forward) + [output_node], "forward", keep=held,
                counted_users=lambda u: u in forward_set or u is output_node)
    fw_death = _storage_death(split.forward, step_of, lambda u: u in forward_set)
    forward_keys = {k for n in split.forward for k in storages_of(n)}
    walker.retain(held)
    grads = {k for n in split.grads for k in storages_of(n)}
    walker.exclude = forward_keys - held
    walker.walk(list(split.tangents) + list(split.backward) + [output_node], "backward",
                keep=held | grads)
    base = _with_rng_states(walker.levels, split, step_of, replay_random, allocator, costs.device.gpu)

    bw_death = _storage_death(split.backward, step_of, lambda u: u in step_of)
    relevant = _needed_transitively(split.forward, step_of, num_fw)
    nodes = [n for n in split.forward if n in relevant]
    index = {n: i for i, n in enumerate(nodes)}
    columns: dict[str, list] = {k: [] for k in (
        "size", "cost", "inputs", "aliases", "needed", "can_save", "can_recompute",
        "saved_from", "need_first", "need_last", "multi_output", "fused")}
    for node in nodes:
        view = is_view(node)
        own = {k: b for k, b in storages_of(node).items() if k not in static and k not in held}
        reads = [step_of[u] for u in node.users if step_of.get(u, -1) >= num_fw]
        columns["size"].append(0 if view else sum(allocator.round(b) for b in own.values()))
        columns["cost"].append(int(round(costs[node.name].seconds * 1e9)) if node.name in costs.nodes else 0)
        columns["inputs"].append(tuple(index[i] for i in node.all_input_nodes if i in index))
        columns["aliases"].append(view)
        columns["needed"].append(bool(reads))
        multi = _multi_output(node)
        columns["can_save"].append(not view and not multi)
        columns["multi_output"].append(multi)
        columns["can_recompute"].append(can_recompute(node, split.mutated, replay_random))
        columns["saved_from"].append(max((fw_death.get(k, step_of[node]) for k in own), default=step_of[node]) + 1)
        columns["need_first"].append(min(reads) if reads else NEVER)
        last = max(reads + [bw_death[k] for k in storages_of(node) if k in bw_death]) if reads else NEVER
        columns["need_last"].append(last)
        columns["fused"].append(fused and fuses_when_recomputed(node, relevant, step_of, num_fw))
    problem = MemoryProblem(names=tuple(n.name for n in nodes), base=base, budget=int(budget),
                            **{k: tuple(v) for k, v in columns.items()})
    return Lowered(problem, tuple(nodes), split.primals)


def _with_rng_states(levels, split: JointSplit, step_of, replay_random: bool, allocator: AllocatorModel,
                     for_gpu: bool = False) -> tuple[int, ...]:
    """Levels with the generator state of every random op that may be recomputed held from the op
    to the end of the step: the state `passes/rng.py` saves is priced conservatively in the base,
    whether the plan keeps the op's output or recomputes it (5056 bytes per op on the CPU; a CUDA
    state lives on the host and costs the device nothing, also where a step `for_gpu` was traced on
    the CPU: it runs with CUDA's state)."""
    if for_gpu:
        return tuple(levels)
    levels = list(levels)
    for node in split.forward:
        random = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if not (replay_random and random and replayable(node) and not draws_nothing(node)
                and can_recompute(node, split.mutated, replay_random)):
            continue
        size = allocator.round(rng_state_bytes(node))
        for i in range(step_of[node], len(levels)):
            levels[i] += size
    return tuple(levels)


def rng_state_bytes(node: torch.fx.Node) -> int:
    """Bytes on the node's device of the generator state saved to replay it: CPU's
    `torch.get_rng_state()`; 0 for CUDA, whose (seed, offset) is a host tensor."""
    values = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return torch.get_rng_state().numel() if values and values[0].device.type == "cpu" else 0


def fuses_when_recomputed(node: torch.fx.Node, relevant: set[torch.fx.Node], step_of, num_fw: int) -> bool:
    """Whether Inductor computes `node`, recomputed in backward, inside the kernels that read it there: a
    pointwise op whose readers there (backward's, and forward's that may be recomputed) are pointwise ops
    and reductions, through views. A reader that is a matmul, attention or another aten kernel needs it in
    a buffer of its own."""
    if not is_pointwise(node) or _multi_output(node):
        return False
    reads_it = lambda u: step_of.get(u, -1) >= num_fw or u in relevant  # noqa: E731
    readers = list(filter(reads_it, node.users))
    while readers:
        user = readers.pop()
        if is_view(user):
            readers += filter(reads_it, user.users)
        elif not ({torch.Tag.pointwise, torch.Tag.reduction} & set(getattr(user.target, "tags", ()))):
            return False
    return True


def _needed_transitively(forward, step_of, num_fw) -> set[torch.fx.Node]:
    """Forward nodes that backward reads, and everything they are computed from."""
    needed: set[torch.fx.Node] = set()
    for node in reversed(forward):
        if any(step_of.get(u, -1) >= num_fw or u in needed for u in node.users):
            needed.add(node)
    return needed


def _storage_death(nodes, step_of, counted) -> dict[Hashable, int]:
    """Per storage: the last step at which any node referring to it is used (or produced)."""
    death: dict[Hashable, int] = {}
    for node in nodes:
        last = max([step_of[u] for u in node.users if counted(u)] + [step_of[node]])
        for key in storages_of(node):
            death[key] = max(death.get(key, -1), last)
    return death


def allow_offload(lowered: Lowered, split: JointSplit, costs: CostTable, min_bytes: int) -> Lowered:
    """The problem with offload over the device's host link allowed (unchanged without a link)."""
    link = costs.device.host_link
    if link is None:
        return lowered
    steps = list(split.forward) + list(split.backward)
    step_ns = [round(costs.nodes[n.name].seconds * 1e9) if n.name in costs.nodes else 0 for n in steps]
    problem = lowered.problem
    transfer_ns = [round(link.seconds(b) * 1e9) for b in problem.size]
    overhead_ns = round(2 * costs.device.op_overhead_s * 1e9)
    return dataclasses.replace(lowered, problem=enable_offload(problem, step_ns, transfer_ns, min_bytes, overhead_ns))
