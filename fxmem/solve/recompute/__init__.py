"""Solvers for the keep-or-recompute problem: pick the recompute set R for a `MemoryProblem`
(and, when the problem allows offload, the set O of values copied to host and back).

Reads a `fxmem.problem.MemoryProblem` and nothing else (no torch, no fx, no files);
returns a `Solution` whose objective and peak are always recomputed from R with the
helpers in `fxmem.problem`, whatever the solver believed internally.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from fxmem.problem import MemoryProblem, is_valid, peak_bytes, recompute_cost
from fxmem.solve.recompute.brute import solve_brute
from fxmem.solve.recompute.cpsat import cpsat_min_peak, solve_cpsat
from fxmem.solve.recompute.exact import exact_min_peak, solve_exact
from fxmem.solve.recompute.layered import solve_layered
from fxmem.solve.recompute.auto import solve_auto
from fxmem.solve.recompute.greedy import greedy_min_peak, solve_greedy
from fxmem.solve.solution import Solution, make_solution


def solve(problem: MemoryProblem, solver: str = "cpsat", time_limit_s: float = 10.0) -> Solution:
    """Run the named solver (see `SOLVERS`, or "auto": `fxmem.solve.recompute.auto`, which names the solver
    it picked in the Solution) on `problem` within about `time_limit_s` seconds."""
    if solver != "auto" and solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of: auto, {', '.join(sorted(SOLVERS))}")
    if problem.budget <= 0:
        raise ValueError(f"memory budget must be positive, got {problem.budget}")
    return solve_auto(problem, time_limit_s) if solver == "auto" else SOLVERS[solver](problem, time_limit_s)


def min_peak(problem: MemoryProblem, time_limit_s: float = 10.0) -> tuple[int, frozenset[int]]:
    """Smallest peak over valid decisions (budget and cost ignored) and a decision reaching it.

    Minimises the peak with CP-SAT, seeded with the greedy descent; falls back to the greedy
    decision when CP-SAT finds nothing in time (the peak is then only an upper bound).
    Raises ValueError when no decision is valid at all (a value neither saveable nor recomputable).
    """
    started = time.perf_counter()
    greedy = greedy_min_peak(problem, time_limit_s / 4)
    options = [greedy] if is_valid(problem, greedy) else []
    found = cpsat_min_peak(problem, time_limit_s - (time.perf_counter() - started), hint=greedy)
    if found is not None:
        options.append(found[1])
    if not options:
        raise ValueError("no valid decision: some value can be neither saved nor recomputed")
    best = min(options, key=lambda rec: (peak_bytes(problem, rec), recompute_cost(problem, rec)))
    return peak_bytes(problem, best), best


def _greedy(problem: MemoryProblem, time_limit_s: float) -> Solution:
    return solve_greedy(problem, time_limit_s)


def _cpsat(problem: MemoryProblem, time_limit_s: float) -> Solution:
    return solve_cpsat(problem, time_limit_s)


def _brute(problem: MemoryProblem, time_limit_s: float) -> Solution:
    return solve_brute(problem, time_limit_s)


def _exact(problem: MemoryProblem, time_limit_s: float) -> Solution:
    return solve_exact(problem, time_limit_s)


def _layered(problem: MemoryProblem, time_limit_s: float) -> Solution:
    """One layer solved and spread over repeated layers; CP-SAT on problems without them."""
    found = solve_layered(problem, time_limit_s)
    return found if found is not None else replace(solve_cpsat(problem, time_limit_s), solver="layered")


SOLVERS: dict[str, Callable[[MemoryProblem, float], Solution]] = {
    "greedy": _greedy,
    "cpsat": _cpsat,
    "brute": _brute,
    "exact": _exact,
    "layered": _layered,
}

__all__ = ["Solution", "SOLVERS", "solve", "min_peak", "make_solution", "solve_greedy",
           "solve_cpsat", "solve_brute", "greedy_min_peak", "cpsat_min_peak", "solve_exact", "exact_min_peak",
           "solve_layered", "solve_auto"]
