"""Solvers for the keep-or-recompute problem: pick the recompute set R for a `MemoryProblem`
(and, when the problem allows offload, the set O of values copied to host and back).

Reads a `fxmem.solve.problem.MemoryProblem` and nothing else (no torch, no fx, no files);
returns a `Solution` whose objective and peak are always recomputed from R with the
helpers in `fxmem.solve.problem`, whatever the solver believed internally.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from fxmem.solve.problem import MemoryProblem
from fxmem.solve.recompute.auto import solve_auto
from fxmem.solve.recompute.brute import solve_brute
from fxmem.solve.recompute.cpsat import cpsat_min_peak, solve_cpsat
from fxmem.solve.recompute.exact import exact_min_peak, solve_exact
from fxmem.solve.recompute.greedy import greedy_min_peak, solve_greedy
from fxmem.solve.recompute.layered import solve_layered
from fxmem.solve.recompute.least import LeastPeak, least_peak
from fxmem.solve.solution import Solution, make_solution


def solve(problem: MemoryProblem, solver: str = "cpsat", time_limit_s: float = 10.0) -> Solution:
    """Run the named solver (see `SOLVERS`, or "auto": `fxmem.solve.recompute.auto`, which names the solver
    it picked in the Solution) on `problem` within about `time_limit_s` seconds, counted as work
    (`fxmem.solve.effort`): the same problem and limit get the same Solution on every run."""
    if solver != "auto" and solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of: auto, {', '.join(sorted(SOLVERS))}")
    if problem.budget <= 0:
        raise ValueError(f"memory budget must be positive, got {problem.budget}")
    return solve_auto(problem, time_limit_s) if solver == "auto" else SOLVERS[solver](problem, time_limit_s)


def min_peak(problem: MemoryProblem, time_limit_s: float = 10.0) -> tuple[int, frozenset[int]]:
    """Smallest peak found over valid decisions (budget and cost ignored) and a decision reaching it
    (`fxmem.solve.recompute.least.least_peak`, which also says whether it is proven).
    Raises ValueError when no decision is valid at all."""
    found = least_peak(problem, time_limit_s)
    return found.peak, found.recompute


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

__all__ = ["Solution", "SOLVERS", "solve", "min_peak", "least_peak", "LeastPeak", "make_solution", "solve_greedy",
           "solve_cpsat", "solve_brute", "greedy_min_peak", "cpsat_min_peak", "solve_exact", "exact_min_peak",
           "solve_layered", "solve_auto"]
