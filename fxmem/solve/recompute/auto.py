"""The default solver: the exact one on small problems, one layer spread over repeated layers,
CP-SAT on the rest.

Reads a `MemoryProblem`; writes nothing. Small problems (up to `EXACT_MAX_CANDIDATES` candidates)
usually get a proof of optimality within seconds and stop there (otherwise the best of the
exact solver's, the greedy descent's and, with repeated layers, the layered solver's); problems with repeated
identical layers are solved through one layer (`fxmem.solve.recompute.layered`) in a few seconds at any
depth; other problems, and every problem that may offload, get CP-SAT seeded by the greedy
descent, for the whole time limit. The limit is converted once into counted effort (`fxmem.solve.effort`)
that the routes share, so the route taken and its answer are the same on every run.
"""
from __future__ import annotations

from fxmem.solve.effort import Effort
from fxmem.solve.problem import MemoryProblem
from fxmem.solve.recompute.cpsat import solve_cpsat
from fxmem.solve.recompute.exact import solve_exact
from fxmem.solve.recompute.greedy import solve_greedy
from fxmem.solve.recompute.layered import solve_layered
from fxmem.solve.recompute.layers import find_layers
from fxmem.solve.solution import Solution

EXACT_MAX_CANDIDATES = 200
EXACT_SHARE = 0.7  # of the time limit, when the layered solver can take the rest


def solve_auto(problem: MemoryProblem, time_limit_s: float | Effort = 10.0) -> Solution:
    """The best of the routes that fit the problem's size and shape (see the module doc), within about
    `time_limit_s` seconds; "infeasible" only when a route proves it."""
    effort = Effort.of(time_limit_s)
    if any(problem.can_offload):  # only CP-SAT (and its greedy seed) model offloading
        return solve_cpsat(problem, effort)
    layers = find_layers(problem)
    if problem.num_values <= EXACT_MAX_CANDIDATES:
        seed = solve_greedy(problem, effort.part(0.1, most_s=1.0))
        found = solve_exact(problem, effort.until(EXACT_SHARE if layers else 1.0),
                            hint=seed.recompute if seed.fits else None)
        if found.status in ("optimal", "infeasible"):
            return found
        tries = [found, seed]
        if layers is not None:
            tries.append(solve_layered(problem, effort.part(least_s=1.0), layers))
        fitting = [s for s in tries if s is not None and s.fits]
        return min(fitting, key=lambda s: (s.objective, s.peak)) if fitting else found
    layered = solve_layered(problem, effort, layers) if layers is not None else None
    return layered if layered is not None else solve_cpsat(problem, effort)
