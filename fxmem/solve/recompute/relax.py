"""Searches on the in-order peak: spend a decision's slack (`relax`: stop recomputing values while
the peak stays in budget) and lower its peak (`lower_peak`: recompute more where that lowers it).

Reads a `MemoryProblem` and a valid decision; returns a decision. Torch-free. Peaks here are the
phase model's (`fxmem.solve.recompute.phases`), where each step's recomputation runs in order. The
solvers count every value recomputed for a step as alive at once, so their decisions leave budget
unused: checkpointing every layer of gpt-small (batch 8) is 240 MiB to them, 169 MiB in order and
172 MiB simulated on the rewritten graphs. Moves keep one value of the layer in every repeated layer
at once, or one value; the move saving most recompute time per byte it raises the peak goes first.
At the least budget the same blindness hides lower peaks: on a GPT-2 of 24 layers x 1024 at 4 x 1024
tokens the solvers' least is 4976 MiB, 4130 MiB in order. Limits are counted (`fxmem.solve.effort`):
each decision tried costs `TRY_US` per value and step, so a search stops at the same move on every run.
"""
from __future__ import annotations

import heapq

from fxmem.solve.effort import Effort
from fxmem.solve.problem import (
    MemoryProblem,
    is_valid,
    lifetimes,
    recompute_cost,
    repair,
    saved_set,
)
from fxmem.solve.recompute.layers import Layers
from fxmem.solve.recompute.phases import in_order_spans, phase_peak, phase_profile

TRY_US = 1.3  # effort units per value and step of a decision tried: made values, validity, in-order profile


def relax(problem: MemoryProblem, recompute, budget: int, time_limit_s: float | Effort,
          layers: Layers | None = None) -> frozenset[int]:
    """`recompute` less what the budget lets backward keep (unchanged when it is over `budget`), within
    about `time_limit_s` seconds.

    Lazy greedy: a move's worth is the recompute time it saves per byte it raises the peak by (a
    move that does not raise it is taken at once); worths are first guessed from the move's bytes and
    re-priced when they come up, since earlier moves change them. Guessing from the bytes, not from
    the time alone, takes good moves at once instead of pricing every move first: a GPT-2 of 24 layers
    x 1024 at 4 x 1024 tokens relaxes in 2 s instead of 5, to the same decisions."""
    effort, sweep = Effort.of(time_limit_s), TRY_US * (problem.num_values + problem.num_steps)
    rec = drop_unmade(problem, frozenset(recompute))
    peak = phase_peak(problem, rec)
    if peak > budget:
        return frozenset(recompute)
    cost = recompute_cost(problem, rec)
    # first guess at a move's worth: as if it raised the peak by all its bytes (it raises it by at most that,
    # unless what it keeps outlives a recomputed chain); the lazy greedy re-prices it when it comes up
    heap = [(-sum(problem.cost[v] for v in move) / (sum(problem.size[v] for v in move) + 1), k, move)
            for k, move in enumerate(_moves(problem, rec, layers))]
    heapq.heapify(heap)
    while heap and not effort.done():
        _, k, move = heapq.heappop(heap)
        effort.spend(sweep)
        trial = drop_unmade(problem, rec - move)
        if trial == rec or not is_valid(problem, trial):
            continue
        trial_peak, trial_cost = phase_peak(problem, trial), recompute_cost(problem, trial)
        if trial_peak > budget or trial_cost >= cost:
            continue
        worth = (cost - trial_cost) / (max(0, trial_peak - peak) + 1)
        if not heap or worth >= -heap[0][0]:
            rec, peak, cost = trial, trial_peak, trial_cost
        else:
            heapq.heappush(heap, (-worth, k, move))
    return rec


def lower_peak(problem: MemoryProblem, recompute, time_limit_s: float | Effort) -> frozenset[int]:
    """`recompute` plus what lowers the in-order peak: each round recomputes the value alive at the
    peak step whose recomputation (alone, or with its inputs back to values kept already) lowers the
    peak most, until none does or its limit (about `time_limit_s` seconds) is spent. With the inputs: a
    GPT-2 of 124M shape at 8 x 1024 tokens, 5450.5 -> 5354.5 MiB in order (the bound is 5186.5)."""
    effort, sweep = Effort.of(time_limit_s), TRY_US * (problem.num_values + problem.num_steps)
    rec = drop_unmade(problem, frozenset(recompute))
    profile = phase_profile(problem, rec)
    peak = max(profile, default=0)
    while not effort.done():
        effort.spend(sweep)
        step = profile.index(peak)
        spans, size = in_order_spans(problem, rec)
        alive = [v for v, (first, last) in spans.items() if first <= step <= last and size[v]
                 and v not in rec and problem.can_recompute[v]]
        best = None
        for v in sorted(alive, key=lambda v: -size[v]):
            if effort.done():
                break
            for move in {rec | {v}, _cone(problem, rec, v)}:  # one move when `v` needs no inputs made
                effort.spend(sweep)
                trial = drop_unmade(problem, repair(problem, move))
                if is_valid(problem, trial):
                    trial_profile = phase_profile(problem, trial)
                    trial_peak = max(trial_profile)
                    if trial_peak < (best[0] if best else peak):
                        best = (trial_peak, trial, trial_profile)
        if best is None:
            break
        peak, rec, profile = best
    return rec


def _cone(problem: MemoryProblem, rec: frozenset[int], v: int) -> frozenset[int]:
    """`rec` with `v` and its inputs recomputed, back to values kept already: recomputing `v` alone
    keeps its inputs instead, which may be alive at the same step (a layer's output recomputed alone
    keeps a value inside the layer across the loss's backward)."""
    kept = saved_set(problem, rec)
    cone, frontier = set(rec) | {v}, [v]
    while frontier:
        for j in problem.inputs[frontier.pop()]:
            if j not in cone and j not in kept and problem.can_recompute[j]:
                cone.add(j)
                frontier.append(j)
    return frozenset(cone)


def drop_unmade(problem: MemoryProblem, recompute: frozenset[int]) -> frozenset[int]:
    """`recompute` without the values no backward step reads, directly or through a recomputed
    value: they are never made, yet their inputs would count as saved."""
    rec = frozenset(recompute)
    while True:
        made = frozenset(rec & lifetimes(problem, rec).keys())
        if made == rec:
            return rec
        rec = made


def _moves(problem: MemoryProblem, rec: frozenset[int], layers: Layers | None) -> list[frozenset[int]]:
    """Candidate sets to stop recomputing: the same offset in every layer, and single values."""
    keepable = [v for v in rec if problem.can_save[v] and problem.cost[v] > 0]
    singles = sorted(keepable, key=lambda v: -problem.cost[v] / max(1, problem.size[v]))
    if layers is None:
        return [frozenset([v]) for v in singles]
    in_layers = range(layers.start, layers.start + layers.length * layers.count)
    by_offset: dict[int, set[int]] = {}
    for v in keepable:
        if v in in_layers:
            by_offset.setdefault((v - layers.start) % layers.length, set()).add(v)
    spread = sorted((frozenset(g) for g in by_offset.values() if len(g) > 1),
                    key=lambda g: -sum(problem.cost[v] for v in g) / max(1, sum(problem.size[v] for v in g)))
    return spread + [frozenset([v]) for v in singles]
