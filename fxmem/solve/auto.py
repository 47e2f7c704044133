"""The default solver: the exact one on small problems, one layer spread over repeated layers,
CP-SAT on the rest.

Reads a `MemoryProblem`; writes nothing. Small problems (up to `EXACT_MAX_CANDIDATES` candidates)
usually get a proof of optimality within seconds and stop there; problems with repeated
identical layers are solved through one layer (`fxmem.solve.layered`) in a few seconds at any
depth; other problems get CP-SAT seeded by the greedy descent, for the whole time limit.
"""
from __future__ import annotations

from fxmem.problem import MemoryProblem
from fxmem.solve import Solution
from fxmem.solve.cpsat import solve_cpsat
from fxmem.solve.exact import solve_exact
from fxmem.solve.greedy import solve_greedy
from fxmem.solve.layered import solve_layered

EXACT_MAX_CANDIDATES = 200


def solve_auto(problem: MemoryProblem, time_limit_s: float = 10.0) -> Solution:
    """The best of the three routes that fits the problem's size and shape (see module doc)."""
    if problem.num_values <= EXACT_MAX_CANDIDATES:
        seed = solve_greedy(problem, min(1.0, time_limit_s / 10))
        found = solve_exact(problem, time_limit_s, hint=seed.recompute if seed.status != "infeasible" else None)
        if found.status != "infeasible" or seed.status == "infeasible":
            return found
        return seed  # the exact model found nothing in time; the greedy decision fits
    layered = solve_layered(problem, time_limit_s)
    return layered if layered is not None else solve_cpsat(problem, time_limit_s)
