"""Greedy keep-or-recompute heuristic: fast, no optimality claim.

Reads a `MemoryProblem`; writes nothing. Starts from eager autograd's decision and, while the
peak is over budget, recomputes the value alive at the peak step that lowers it most per unit of
cost; then drops recomputations the budget no longer needs. Seeds CP-SAT and `min_peak`.
"""
from __future__ import annotations

import time

from fxmem.problem import MemoryProblem, eager_decision, is_valid, lifetimes, memory_profile, recompute_cost
from fxmem.solve import Solution, make_solution

MOVES_PER_STEP = 12  # candidate moves priced per iteration (largest values alive at the peak)


def _with(problem: MemoryProblem, rec: frozenset[int], value: int) -> frozenset[int] | None:
    """rec plus `value`, plus the unsaveable inputs its recomputation needs (recursively)."""
    out, stack = set(rec), [value]
    while stack:
        v = stack.pop()
        if v in out and v != value:
            continue
        if not problem.can_recompute[v]:
            return None
        out.add(v)
        stack.extend(j for j in problem.inputs[v] if not problem.can_save[j] and j not in out)
    return frozenset(out)


def _peak(profile: list[int]) -> tuple[int, int]:
    step = max(range(len(profile)), key=profile.__getitem__)
    return profile[step], step


def _moves(problem: MemoryProblem, rec: frozenset[int], step: int) -> list[int]:
    """Values alive at `step` whose recomputation could free them there, largest per cost first."""
    alive = [v for v, (first, last) in lifetimes(problem, rec).items()
             if first <= step <= last and problem.size[v] and v not in rec and problem.can_recompute[v]]
    alive.sort(key=lambda v: (-problem.size[v] / (problem.cost[v] + 1), v))
    return alive[:MOVES_PER_STEP]


def _descend(problem: MemoryProblem, rec: frozenset[int], target: int, deadline: float,
             weigh_cost: bool) -> frozenset[int]:
    """Add recomputations until the peak is <= target or no move lowers it. Each round prices the
    moves at the peak step, then applies them best first while each still lowers the peak."""
    peak, step = _peak(memory_profile(problem, rec))
    while peak > target and time.perf_counter() < deadline:
        ranked = []
        for v in _moves(problem, rec, step):
            trial = _with(problem, rec, v)
            if trial is None:
                continue
            new_peak = max(memory_profile(problem, trial))
            if new_peak < peak:
                added = recompute_cost(problem, trial - rec) if weigh_cost else 0
                ranked.append(((peak - new_peak) / (added + 1), -new_peak, -v))
        if not ranked:
            break
        progressed = False
        for _, _, neg_v in sorted(ranked, reverse=True):
            trial = _with(problem, rec, -neg_v)
            new_peak = max(memory_profile(problem, trial)) if trial is not None else peak
            if new_peak < peak:
                rec, peak, progressed = trial, new_peak, True
            if peak <= target or time.perf_counter() > deadline:
                break
        if not progressed:
            break
        peak, step = _peak(memory_profile(problem, rec))
    return rec


def _prune(problem: MemoryProblem, rec: frozenset[int], budget: int, deadline: float) -> frozenset[int]:
    """Drop recomputations, costliest first, while the decision stays valid and within budget."""
    for v in sorted(rec, key=lambda i: (-problem.cost[i], i)):
        if time.perf_counter() > deadline:
            break
        if problem.cost[v] == 0 or v not in rec:
            continue
        trial = rec - {v}
        if is_valid(problem, trial) and max(memory_profile(problem, trial)) <= budget:
            rec = trial
    return rec


def solve_greedy(problem: MemoryProblem, time_limit_s: float = 10.0) -> Solution:
    started = time.perf_counter()
    deadline = started + time_limit_s
    rec = _descend(problem, eager_decision(problem), problem.budget, deadline, weigh_cost=True)
    feasible = is_valid(problem, rec) and max(memory_profile(problem, rec), default=0) <= problem.budget
    if feasible:
        rec = _prune(problem, rec, problem.budget, deadline)
    cost = recompute_cost(problem, rec)
    status = "infeasible" if not feasible else "optimal" if cost == 0 else "feasible"
    return make_solution(problem, rec, status, 0, started, "greedy")


def greedy_min_peak(problem: MemoryProblem, time_limit_s: float = 10.0) -> frozenset[int]:
    """A decision with a low peak, cost ignored (an upper bound on the least peak)."""
    deadline = time.perf_counter() + time_limit_s
    return _descend(problem, eager_decision(problem), -1, deadline, weigh_cost=False)
