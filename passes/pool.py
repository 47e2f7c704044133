"""Pool pass: one arena per graph, every pooled intermediate written into a view of it at an offset
planned by `fxmem.pack_buffers` from its lifetime in node order.

Reads `meta["val"]` (FakeTensors) of a graph fxmem runs itself (a plan's forward or backward graph, or
an inference graph run under `torch.no_grad()`); rewrites pooled nodes to their `.out` overload writing
into an `as_strided` view of one uint8 arena, or, for ops without one (and random ops, whose `.out`
overload may draw numbers differently), computes as before and `copy_`s into the slot. Intermediates
that are graph inputs, reach an output (views included), or come from multi-output ops stay with the
allocator. Writes `gm.meta["fxmem"]["pool"]` (`PoolStats`) and `node.meta["fxmem"]["pool"]` (offset, path).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.errors import PackingError
from fxmem.price.memory import storage_key, storages_of
from fxmem.passes.runner import StepGraphs
from fxmem.solve.packing import Packing, pack_buffers
from fxmem.meta_keys import NAMESPACE, POOL, tag, tags



@dataclass(frozen=True)
class PoolStats:
    """What pooling one graph did. Bytes: `no_reuse_bytes` (one allocation per pooled intermediate,
    all alive at once), `lower_bound_bytes` (most pooled bytes alive at one node), `arena_bytes` (the
    one arena). `allocations_avoided`: allocator calls no longer made (`.out` writes minus the arena).
    `unpooled`: intermediates that cannot be pooled (multi-output ops...); `kept_for_peak`: poolable
    ones left to the allocator because pooling them would raise the graph's peak."""

    no_reuse_bytes: int
    lower_bound_bytes: int
    arena_bytes: int
    allocations_avoided: int
    pooled: int
    out_variant: int
    copied: int
    unpooled: int
    kept_for_peak: int
    solver_status: str
    solve_time_s: float


def pool_stats(gm: torch.fx.GraphModule) -> PoolStats | None:
    """The stats `pool_graph` recorded on `gm`, or None if it was not pooled."""
    return tag(gm, POOL)


def out_overload(op: Any) -> tuple[Any, str] | None:
    """(the `.out` overload taking the same arguments as `op` plus one out tensor, its name) or None."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        outs = [a for a in cand._schema.arguments if a.is_out]
        args = [(a.name, str(a.type)) for a in cand._schema.arguments if not a.is_out]
        if len(outs) == 1 and args == want and len(cand._schema.returns) == 1:
            return cand, outs[0].name
    return None


def _poolable(node: torch.fx.Node) -> torch.Tensor | None:
    """The node's fake value if it is one freshly allocated dense tensor made by an aten op."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if not isinstance(val, torch.Tensor) or val._is_view() or val.layout != torch.strided:
        return None
    if node.target._schema.is_mutable or any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
        return None
    return val


def _lifetimes(nodes: list[torch.fx.Node]) -> tuple[dict[Hashable, torch.fx.Node], dict[Hashable, int]]:
    """Producer node and last step (exclusive) of every storage, over all nodes referring to it."""
    position = {n: i for i, n in enumerate(nodes)}
    producer: dict[Hashable, torch.fx.Node] = {}
    end: dict[Hashable, int] = {}
    for i, node in enumerate(nodes):
        last = max((position[u] for u in node.users), default=i) + 1
        for key in storages_of(node):
            producer.setdefault(key, node)
            end[key] = max(end.get(key, 0), last)
    return producer, end


def _candidates(gm: torch.fx.GraphModule, alignment: int, inputs_freed: bool
                ) -> tuple[list[tuple[torch.fx.Node, int, int]], int, list[tuple[int, int, int]]]:
    """(node, start, end) of each poolable intermediate, how many intermediates cannot be pooled, and
    (start, end, bytes) of every other storage the graph makes (outputs held to the end)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    producer, end = _lifetimes(nodes)
    held: set[Hashable] = set()
    inputs: list[tuple[int, int, int]] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        for key, nbytes in storages_of(node).items():
            if key not in held:
                inputs.append((0, end[key] if inputs_freed else len(nodes), nbytes))
            held.add(key)
    for arg in pytree.tree_leaves(gm.graph.output_node().args):
        if isinstance(arg, torch.fx.Node):
            held.update(storages_of(arg))
    chosen, unpooled, device, others = [], 0, None, inputs
    for key, node in producer.items():
        if node.op != "call_function":
            continue
        if key in held:
            others.append((position[node], len(nodes), _bytes_of(node, key)))
            continue
        val = _poolable(node)
        if val is None or storage_key(val) != key or alignment % val.element_size() \
                or (device is not None and val.device != device):
            unpooled += 1
            others.append((position[node], end[key], _bytes_of(node, key)))
            continue
        device = val.device
        chosen.append((node, position[node], end[key]))
    return chosen, unpooled, others


def _bytes_of(node: torch.fx.Node, key: Hashable) -> int:
    return storages_of(node).get(key, 0)


def _profile(buffers: list[tuple[int, int, int]], steps: int) -> np.ndarray:
    delta = np.zeros(steps + 1, dtype=np.int64)
    for s, e, z in buffers:
        delta[s] += z
        delta[e] -= z
    return np.cumsum(delta)[:-1]


def _trim(buffers: list[tuple[int, int, int]], others: list[tuple[int, int, int]], steps: int) -> list[bool]:
    """Which buffers to pool. The arena is held from the first pooled value to the last, so pooling a
    buffer alive when the pooled bytes peak can raise the graph's own peak; drop such buffers (one at
    a time, the best first) while that lowers the peak of: other storages + dropped buffers + arena."""
    base = _profile(others, steps)
    keep = [True] * len(buffers)

    def peak(keep: list[bool]) -> tuple[int, np.ndarray]:
        pooled = _profile([b for b, k in zip(buffers, keep) if k], steps)
        total = base + _profile([b for b, k in zip(buffers, keep) if not k], steps)
        kept = [b for b, k in zip(buffers, keep) if k]
        if kept:
            total[min(b[0] for b in kept):max(b[1] for b in kept)] += int(pooled.max())
        return int(total.max(initial=0)), pooled

    current, pooled = peak(keep)
    best_keep, best_peak, sideways = keep, current, 0
    while any(keep) and sideways < 64:  # a plateau of equal peaks may hide a lower one beyond it
        t = int(pooled.argmax())
        move = None
        for i, (s, e, _) in enumerate(buffers):
            if keep[i] and s <= t < e:
                trial = keep.copy()
                trial[i] = False
                value = peak(trial)
                if move is None or value[0] < move[1][0]:
                    move = (i, value)
        if move is None or move[1][0] > current:
            break
        keep = keep.copy()
        keep[move[0]] = False
        current, pooled = move[1]
        sideways = sideways + 1 if current >= best_peak else 0
        if current < best_peak:
            best_keep, best_peak = keep, current
    return best_keep


def _slot(graph: torch.fx.Graph, typed: torch.fx.Node, offset: int, val: torch.Tensor) -> torch.fx.Node:
    """`as_strided` view of the arena (viewed as `val.dtype`) holding `val` at byte `offset`."""
    start = offset // val.element_size() + val.storage_offset()
    slot = graph.call_function(torch.ops.aten.as_strided.default, (typed, list(val.shape), list(val.stride()), start))
    typed_val = typed.meta.get("val")
    if typed_val is not None:
        with typed_val.fake_mode:
            slot.meta["val"] = typed_val.as_strided(val.shape, val.stride(), start)
    return slot


def _refresh_aliases(node: torch.fx.Node, old_key: Hashable) -> None:
    """Recompute the fake values of `node`'s views (transitively), so they share the arena's storage as
    the real tensors will (the memory simulator counts storages)."""
    for user in list(node.users):
        leaves = [t for t in pytree.tree_leaves(user.meta.get("val")) if isinstance(t, torch.Tensor)]
        if user.op != "call_function" or not any(storage_key(t) == old_key for t in leaves):
            continue
        fake_mode = getattr(leaves[0], "fake_mode", None)
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (user.args, user.kwargs))
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                user.meta["val"] = user.target(*args, **kwargs)
        except Exception:  # the value stays as traced: only the simulator's byte count is affected
            continue
        _refresh_aliases(user, old_key)


def _arena(graph: torch.fx.Graph, before: torch.fx.Node, nbytes: int, dtypes: list[torch.dtype],
           device: torch.device, fake_mode: Any) -> dict[torch.dtype, torch.fx.Node]:
    """One uint8 `aten.empty` of `nbytes` made just before `before`, and a view of it per dtype."""
    with graph.inserting_before(before):
        arena = graph.call_function(torch.ops.aten.empty.memory_format, ([nbytes],),
                                    {"dtype": torch.uint8, "device": device})
        typed = {dtype: graph.call_function(torch.ops.aten.view.dtype, (arena, dtype)) for dtype in dtypes}
    if fake_mode is not None:
        with fake_mode:
            arena.meta["val"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for dtype, node in typed.items():
                node.meta["val"] = arena.meta["val"].view(dtype)
    return typed


def pool_graph(gm: torch.fx.GraphModule, *, alignment: int = 64, time_limit_s: float = 2.0,
               keep_peak: bool = False, inputs_freed: bool = False) -> torch.fx.GraphModule:
    """Rewrite `gm` in place so its pooled intermediates live in one arena; returns `gm`. With
    `keep_peak`, intermediates whose pooling would raise the graph's own peak stay with the allocator;
    `inputs_freed` says the graph frees each input after its last use (an AOTAutograd backward graph
    with boxed inputs) rather than its caller holding them, which moves that peak.

    The arena (`aten.empty`, uint8) is made just before the first pooled node; its storage is freed
    when the last view of it dies. Its size is the packing's `arena_bytes`."""
    if not any(isinstance(n.meta.get("val"), torch.Tensor) for n in gm.graph.nodes if n.op == "call_function"):
        raise PackingError("pool_graph needs node.meta['val'] (fake tensors) on the graph's nodes to size and "
                           "place intermediates; pass a graph from AOTAutograd or fxmem.capture, or run "
                           "torch.fx.passes.fake_tensor_prop.FakeTensorProp on it first")
    chosen, unpooled, others = _candidates(gm, alignment, inputs_freed)
    sizes = [int(_poolable(n).untyped_storage().nbytes()) for n, _, _ in chosen]
    dropped = 0
    if keep_peak:
        keep = _trim([(s, e, z) for (_, s, e), z in zip(chosen, sizes)], others, len(gm.graph.nodes))
        dropped = keep.count(False)
        chosen, sizes = [c for c, k in zip(chosen, keep) if k], [z for z, k in zip(sizes, keep) if k]
    packing: Packing = pack_buffers([(s, e, z) for (_, s, e), z in zip(chosen, sizes)], alignment=alignment,
                                     time_limit_s=time_limit_s)
    graph, out_count, copied = gm.graph, 0, 0
    live = [(n, o) for (n, _, _), z, o in zip(chosen, sizes, packing.offsets) if z > 0]
    if live:
        first = live[0][0].meta["val"]
        dtypes = list(dict.fromkeys(n.meta["val"].dtype for n, _ in live))
        typed = _arena(graph, live[0][0], packing.arena_bytes, dtypes, first.device, getattr(first, "fake_mode", None))
    for node, offset in live:
        val, target = node.meta["val"], node.target
        old_key = storage_key(val)
        out = None if torch.Tag.nondeterministic_seeded in target.tags else out_overload(target)
        with graph.inserting_before(node):
            slot = _slot(graph, typed[val.dtype], offset, val)
            if out is not None:
                new = graph.call_function(out[0], node.args, {**node.kwargs, out[1]: slot})
        if out is None:
            with graph.inserting_after(node):
                new = graph.call_function(torch.ops.aten.copy_.default, (slot, node))
            node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
            copied += 1
        else:
            node.replace_all_uses_with(new)
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", NAMESPACE)})
            graph.erase_node(node)
            out_count += 1
        new.meta["val"] = slot.meta.get("val", val)
        _refresh_aliases(new, old_key)
        tag = {"offset": offset, "path": "out" if out else "copy", "of": node.name}
        new.meta[NAMESPACE] = {**node.meta.get(NAMESPACE, {}), POOL: tag}
    gm.recompile()
    tags(gm)[POOL] = PoolStats(
        no_reuse_bytes=packing.no_reuse_bytes, lower_bound_bytes=packing.lower_bound_bytes,
        arena_bytes=packing.arena_bytes if live else 0, allocations_avoided=max(0, out_count - 1),
        pooled=len(live), out_variant=out_count, copied=copied, unpooled=unpooled, kept_for_peak=dropped,
        solver_status=packing.status, solve_time_s=packing.solve_time_s)
    return gm


def pool_pass(graphs: StepGraphs, plan: Any) -> StepGraphs:
    """The step's forward and backward graphs pooled as `graphs.pool` asks (False: unchanged; True:
    the intermediates whose pooling keeps each graph's peak; "all": every intermediate). AOTAutograd's
    backward frees saved values as it goes; its forward's inputs stay with the caller."""
    if not graphs.pool:
        return graphs
    keep_peak = graphs.pool != "all"
    return graphs.replace(fw=pool_graph(graphs.fw, keep_peak=keep_peak, inputs_freed=False),
                          bw=pool_graph(graphs.bw, keep_peak=keep_peak, inputs_freed=True))


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a copy of `gm`'s graph (same submodules and attributes), to pool apart."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(gm.graph._codegen)  # keeps pytree calling conventions (make_fx, export)
    return torch.fx.GraphModule(gm, graph)
