"""The memory profile with each backward step's recomputation played in order.

Reads a `MemoryProblem` and a decision; returns bytes per step. Torch-free.
`fxmem.solve.problem.memory_profile` counts every value recomputed for step t as alive at t together. The
rewritten backward graph makes them one after another just before step t, in forward order, and frees
each once its last reader among them is made, so a recomputed chain (matmul, scale, mask, softmax)
holds at most a few of its links at once. Here each step is preceded by a *phase*, one sub-step per
value made there; the phase's peak is what is alive before step t (values saved or made earlier,
`base[t]`, an upper bound on what the step inherits) plus the values of the phase alive at the
sub-step. Values that die inside the phase no longer count at step t itself.
Never above `memory_profile` at any step; solvers that model steps only (greedy, CP-SAT, exact)
stay conservative against it.
"""
from __future__ import annotations

from fxmem.solve.problem import MemoryProblem, held_sizes, lifetimes, profile_of


def phase_profile(problem: MemoryProblem, recompute, offload=()) -> list[int]:
    """Live bytes per step, each step at the larger of its recompute phase's peak and itself."""
    rec = frozenset(recompute)
    spans, size, order = _spans(problem, rec)
    profile = profile_of(problem, spans, size, offload)
    groups: dict[int, list[int]] = {}
    for v in rec:
        if v in spans:  # views (no bytes of their own) too: they keep their base alive
            groups.setdefault(spans[v][0], []).append(v)
    for step, group in groups.items():
        group.sort(key=order)
        inside, held = _phase(problem, spans, size, step, group)
        before = profile[step] - sum(size[v] for v in group)  # at the step, without the phase
        inherited = min(problem.base[step - 1], problem.base[step]) if step else problem.base[step]
        profile[step] = max(before - problem.base[step] + inherited + inside, before + held)
    return profile


def phase_peak(problem: MemoryProblem, recompute, offload=()) -> int:
    profile = phase_profile(problem, recompute, offload)
    return max(profile) if profile else 0


def in_order_spans(problem: MemoryProblem, recompute) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """Inclusive [first, last] steps and bytes of each saved or recomputed value, a recomputed tuple's
    bytes moved to its recomputed items (see `_spans`)."""
    spans, size, _ = _spans(problem, frozenset(recompute))
    return spans, size


def _spans(problem: MemoryProblem, rec: frozenset[int]):
    """`lifetimes`, with a recomputed tuple's bytes moved to the recomputed values that take its
    items (the problem counts the tuple until its last item is taken, and the items again): each
    item exists from the tuple's making until it dies or the tuple does, when its last item is
    taken; and the order values are made in within a phase (items right after their tuple)."""
    spans, size = dict(lifetimes(problem, rec)), held_sizes(problem, rec)
    owner: dict[int, int] = {}
    users = problem.consumers()
    for m in sorted(rec):
        if not (problem.multi_output and problem.multi_output[m] and m in spans):
            continue
        made, taken = spans[m]  # the tuple is held until its last item is taken from it
        parts = [w for w in users[m] if w in rec and w in spans and not problem.aliases[w]]
        for w in parts:
            spans[w], owner[w] = (made, max(spans[w][1], taken)), m
        size[m] = max(0, size[m] - sum(size[w] for w in parts))  # items kept from forward: made again
    return spans, size, lambda v: (owner.get(v, v), v)


def _phase(problem: MemoryProblem, spans: dict[int, tuple[int, int]], size: list[int], step: int,
           group: list[int]) -> tuple[int, int]:
    """(peak bytes of `group` during the phase, bytes of `group` still alive at `step` itself).

    A value survives the phase when backward reads it, a later step's recomputation reads it, or a
    surviving view of it does; otherwise it lives until the last value of the phase that reads it
    (or the end of a dying view of it) is made."""
    position = {v: k for k, v in enumerate(group)}
    users = problem.consumers()
    ends: dict[int, int] = {}  # position of the last sub-step a value is alive at; len(group) = survives
    for v in reversed(group):
        end = len(group) if problem.needed[v] or spans[v][1] > step else position[v]
        for w in users[v]:
            k = position.get(w)
            if k is not None and end < len(group):
                end = max(end, ends[w] if problem.holds_inputs(w) else k)
        ends[v] = end
    delta = [0] * (len(group) + 2)
    for k, v in enumerate(group):
        delta[k] += size[v]
        delta[ends[v] + 1] -= size[v]
    live = peak = 0
    for k in range(len(group)):
        live += delta[k]
        peak = max(peak, live)
    held = sum(size[v] for v in group if ends[v] == len(group))
    return peak, held
