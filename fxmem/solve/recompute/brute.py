"""Exhaustive reference solver for tiny problems (tests and sanity checks only).

Reads a `MemoryProblem`; writes nothing. Tries every subset of the recomputable candidates
(at most 20 of them) and judges each with the helpers in `fxmem.solve.problem`. Its limit is counted
(`fxmem.solve.effort`, `CHECK_US` per value and step of each subset judged), never read off a clock.
"""
from __future__ import annotations

import time
from itertools import combinations
from typing import Iterator

from fxmem.solve.effort import Effort
from fxmem.solve.problem import (
    MemoryProblem,
    eager_decision,
    is_valid,
    peak_bytes,
    recompute_cost,
)
from fxmem.solve.solution import Solution, make_solution

MAX_CANDIDATES = 20
CHECK_US = 0.5  # effort units per value and step of a subset judged (validity, then peak)


def _subsets(problem: MemoryProblem) -> list[tuple[int, ...]]:
    """Every subset of the recomputable candidates as a sorted tuple."""
    pool = [i for i in range(problem.num_values) if problem.can_recompute[i]]
    if len(pool) > MAX_CANDIDATES:
        raise ValueError(f"brute force refuses {len(pool)} recomputable candidates "
                         f"(at most {MAX_CANDIDATES})")
    return [c for k in range(len(pool) + 1) for c in combinations(pool, k)]


def _valid(problem: MemoryProblem, subsets: list[tuple[int, ...]],
           effort: Effort) -> Iterator[tuple[int, ...]]:
    sweep = CHECK_US * (problem.num_values + problem.num_steps)
    for rec in subsets:
        if effort.done():
            raise TimeoutError("brute force ran out of its limit")
        effort.spend(sweep)
        if is_valid(problem, rec):
            yield rec


def brute_min_peak(problem: MemoryProblem,
                   time_limit_s: float | Effort = 60.0) -> tuple[int, frozenset[int]] | None:
    """Smallest peak over valid decisions and the decision reaching it (ties: cheapest, then
    lexicographically smallest); None when no decision is valid."""
    best = min(((peak_bytes(problem, rec), recompute_cost(problem, rec), rec)
                for rec in _valid(problem, _subsets(problem), Effort.of(time_limit_s))), default=None)
    return None if best is None else (best[0], frozenset(best[2]))


def solve_brute(problem: MemoryProblem, time_limit_s: float = 60.0) -> Solution:
    """Cheapest decision with peak <= budget (ties: lowest peak, then lexicographically
    smallest sorted tuple). When none exists: status "infeasible" and the lowest-peak valid
    decision (eager's when none is valid). Raises TimeoutError past its limit (about `time_limit_s` s)."""
    started, effort = time.perf_counter(), Effort.of(time_limit_s)
    subsets = sorted(_subsets(problem), key=lambda rec: (recompute_cost(problem, rec), rec))
    best = None  # (cost, peak, rec)
    for rec in _valid(problem, subsets, effort):
        cost = recompute_cost(problem, rec)
        if best is not None and cost > best[0]:
            break  # subsets come cheapest first: nothing later can win
        peak = peak_bytes(problem, rec)
        if peak <= problem.budget and (best is None or peak < best[1]):
            best = (cost, peak, rec)
    if best is not None:
        return make_solution(problem, best[2], "optimal", best[0], started, "brute")
    lowest = brute_min_peak(problem, effort)
    rec = lowest[1] if lowest is not None else eager_decision(problem)
    return make_solution(problem, rec, "infeasible", 0, started, "brute")
