"""A solver's answer to a `MemoryProblem`: the decision, its cost and peak, and how sure the solver is.

Reads a `fxmem.solve.problem.MemoryProblem`; writes nothing. Every solver of the keep / recompute /
offload problem (`fxmem.solve.recompute`) returns a `Solution` made by `make_solution`, whose
objective and peak are always recomputed from the decision with the helpers in `fxmem.solve.problem`,
whatever the solver believed internally.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from fxmem.solve.problem import MemoryProblem, decision_cost, peak_bytes

FITTING = ("optimal", "feasible")
STATUSES = (*FITTING, "infeasible", "unknown")


@dataclass(frozen=True)
class Solution:
    """A decision and what it costs. `status` is "optimal", "feasible" (R fits the budget), "infeasible"
    (proven: no valid R has peak <= budget) or "unknown" (the search found no R that fits within its limit,
    which proves nothing: a longer search may find one); for the last two R is the solver's best try.
    `offloaded`: values copied to host and back instead (empty unless the problem allows offload);
    `objective` is then recompute time plus the time offloading adds."""

    recompute: frozenset[int]
    status: str
    objective: int
    peak: int
    bound: int
    gap: float
    solve_time_s: float
    solver: str
    offloaded: frozenset[int] = frozenset()

    @property
    def fits(self) -> bool:
        """The decision fits the budget ("optimal" or "feasible")."""
        return self.status in FITTING


def make_solution(problem: MemoryProblem, recompute: Iterable[int], status: str, bound: int,
                  started: float, solver: str, offload: Iterable[int] = ()) -> Solution:
    """Package R (and the offloaded set), measuring objective and peak with the problem helpers.
    `started` is a `time.perf_counter()` reading taken when the solver began."""
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}; one of {', '.join(STATUSES)}")
    rec, off = frozenset(recompute), frozenset(offload)
    objective = decision_cost(problem, rec, off)
    if status == "optimal":
        bound = objective
    bound = max(0, min(int(bound), objective)) if status in FITTING else 0
    gap = 0.0 if status == "optimal" else (objective - bound) / max(objective, 1)
    return Solution(recompute=rec, status=status, objective=objective,
                    peak=peak_bytes(problem, rec, off), bound=bound, gap=gap,
                    solve_time_s=time.perf_counter() - started, solver=solver, offloaded=off)
