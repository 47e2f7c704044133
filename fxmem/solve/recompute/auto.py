"""The default solver: the exact one on small problems, one layer spread over repeated layers,
CP-SAT on the rest.

Reads a `MemoryProblem`; writes nothing. Small problems (up to `EXACT_MAX_CANDIDATES` candidates)
usually get a proof of optimality within seconds and stop there (otherwise the best of the
exact solver's, the greedy descent's and, with repeated layers, the layered solver's); problems with repeated
identical layers are solved through one layer (`fxmem.solve.recompute.layered`) in a few seconds at any
depth; other problems, and every problem that may offload, get CP-SAT seeded by the greedy
descent, for the whole time limit.
"""
from __future__ import annotations

import time

from fxmem.solve.problem import MemoryProblem
from fxmem.solve.recompute.cpsat import solve_cpsat
from fxmem.solve.recompute.exact import solve_exact
from fxmem.solve.recompute.greedy import solve_greedy
from fxmem.solve.recompute.layered import solve_layered
from fxmem.solve.recompute.layers import find_layers
from fxmem.solve.solution import Solution

EXACT_MAX_CANDIDATES = 200
EXACT_SHARE = 0.7  # of the time limit, when the layered solver can take the rest


def solve_auto(problem: MemoryProblem, time_limit_s: float = 10.0) -> Solution:
    """The best of the routes that fit the problem's size and shape (see the module doc)."""
    if any(problem.can_offload):  # only CP-SAT (and its greedy seed) model offloading
        return solve_cpsat(problem, time_limit_s)
    started = time.perf_counter()
    layers = find_layers(problem)
    if problem.num_values <= EXACT_MAX_CANDIDATES:
        seed = solve_greedy(problem, min(1.0, time_limit_s / 10))
        share = time_limit_s * (EXACT_SHARE if layers else 1.0) - (time.perf_counter() - started)
        found = solve_exact(problem, share, hint=seed.recompute if seed.status != "infeasible" else None)
        if found.status == "optimal" or (found.status == "infeasible" and seed.status == "infeasible"):
            return found
        tries = [found, seed]
        if layers is not None:
            tries.append(solve_layered(problem, max(1.0, time_limit_s - (time.perf_counter() - started)), layers))
        fitting = [s for s in tries if s is not None and s.status != "infeasible"]
        return min(fitting, key=lambda s: (s.objective, s.peak)) if fitting else found
    layered = solve_layered(problem, time_limit_s, layers) if layers is not None else None
    return layered if layered is not None else solve_cpsat(problem, time_limit_s)
