"""Repeated identical layers in a `MemoryProblem`, and windows that cut a part of it out.

Reads a `MemoryProblem`; writes nothing. `find_layers` looks for the longest run of candidates
that repeats with a fixed period (same sizes, costs, rules and in-layer wiring), from the
problem alone. `window` makes a small problem of some candidates with the rest decided: the
rest's bytes join the base, so the window's peak is the whole problem's peak under that decision.
`fxmem.solve.recompute.layered` builds on both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxmem.solve.problem import NEVER, MemoryProblem, held_sizes, lifetimes

MIN_LAYERS, MIN_LENGTH = 2, 4


@dataclass(frozen=True)
class Layers:
    """`count` layers of `length` candidates each, the first starting at candidate `start`."""

    start: int
    length: int
    count: int

    def layer(self, k: int) -> range:
        first = self.start + k * self.length
        return range(first, first + self.length)

    def spread(self, offsets: frozenset[int], which: range | None = None) -> set[int]:
        """Candidates at `offsets` within each layer of `which` (all layers by default)."""
        return {self.start + k * self.length + o for k in (which or range(self.count)) for o in offsets}


def _signatures(p: MemoryProblem) -> np.ndarray:
    """One integer per candidate for what a layer's copy must share (wiring is checked later)."""
    ids: dict[tuple, int] = {}
    out = []
    for i in range(p.num_values):
        key = (p.size[i], p.cost[i], p.aliases[i], p.needed[i], p.can_save[i], p.can_recompute[i],
               p.inlined(i), len(p.inputs[i]))
        out.append(ids.setdefault(key, len(ids)))
    return np.asarray(out, dtype=np.int64)


def _longest_run(eq: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in `eq`."""
    padded = np.concatenate(([0], eq.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    if not len(edges):
        return 0, 0
    starts, stops = edges[::2], edges[1::2]
    best = int(np.argmax(stops - starts))
    return int(starts[best]), int(stops[best] - starts[best])


def _wired_alike(p: MemoryProblem, layers: Layers) -> bool:
    """Inputs inside a layer sit at the same offsets in every layer."""
    first = layers.layer(0)
    for k in range(1, layers.count):
        shift = k * layers.length
        for i in first:
            mine = sorted(j - i for j in p.inputs[i] if j >= first.start)
            theirs = sorted(j - i - shift for j in p.inputs[i + shift] if j >= first.start + shift)
            if mine != theirs:
                return False
    return True


def find_layers(problem: MemoryProblem, min_count: int = MIN_LAYERS) -> Layers | None:
    """The period covering the most candidates (ties: the shortest layer), or None when no run of
    at least `min_count` identical layers exists."""
    sig, n = _signatures(problem), problem.num_values
    best: tuple[int, int, int, int] | None = None  # (covered, -length, start, count)
    for length in range(MIN_LENGTH, n // min_count + 1):
        start, run = _longest_run(sig[:-length] == sig[length:])
        count = (run + length) // length
        if count < min_count or run < length:
            continue
        key = (count * length, -length, start, count)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    layers = Layers(start=best[2], length=-best[1], count=best[3])
    return layers if _wired_alike(problem, layers) else None


@dataclass(frozen=True)
class Window:
    """One layer as a problem of its own: its candidates, then the outside values they read."""

    problem: MemoryProblem
    members: tuple[int, ...]  # window index -> candidate of the whole problem
    own: frozenset[int]  # the members that belong to the layer (the rest are read from outside)


def window(p: MemoryProblem, layer, context: frozenset[int]) -> Window:
    """The candidates `layer` with everything else decided by `context` (a decision on the whole problem):
    the rest's bytes join the base, and the rest's recomputed readers of a member count as reads."""
    own = list(layer)
    boundary = sorted({j for i in own for j in p.inputs[i]} - set(own))
    members = own + boundary
    where = {v: k for k, v in enumerate(members)}
    spans, held = lifetimes(p, context), held_sizes(p, context)
    delta = [0] * (p.num_steps + 1)
    for v, (first, last) in spans.items():
        if v not in where and held[v] and first <= last:
            delta[first] += held[v]
            delta[last + 1] -= held[v]
    base, level = [], 0
    for b, d in zip(p.base, delta):
        level += d
        base.append(b + level)
    users = p.consumers()
    cols: dict[str, list] = {k: [] for k in ("names", "size", "cost", "inputs", "aliases", "needed", "can_save",
                                              "can_recompute", "saved_from", "need_first", "need_last", "fused")}
    order = sorted(range(len(members)), key=lambda k: members[k])  # inputs must come first
    renum = {members[k]: n for n, k in enumerate(order)}
    for k in order:
        v = members[k]
        first, last = p.need_first[v], p.need_last[v]
        for w in users[v]:
            if w in where or w not in context or w not in spans:
                continue
            made, end = spans[w]
            first = made if first == NEVER else min(first, made)
            last = max(last, end if p.holds_inputs(w) else made)
        inside = k < len(own)
        cols["names"].append(p.names[v])
        cols["size"].append(p.size[v])
        cols["cost"].append(p.cost[v])
        cols["inputs"].append(tuple(renum[j] for j in p.inputs[v]) if inside else ())
        cols["aliases"].append(p.aliases[v])
        cols["needed"].append(first != NEVER)
        cols["can_save"].append(p.can_save[v] or not inside)
        cols["can_recompute"].append(p.can_recompute[v] and inside)
        cols["saved_from"].append(p.saved_from[v])
        cols["need_first"].append(first)
        cols["need_last"].append(max(last, first) if first != NEVER else last)
        cols["fused"].append(p.inlined(v) and inside)
    sub = MemoryProblem(base=tuple(base), budget=p.budget, **{k: tuple(v) for k, v in cols.items()})
    return Window(sub, tuple(members[k] for k in order), frozenset(own))


