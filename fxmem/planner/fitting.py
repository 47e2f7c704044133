"""The in-order searches around the solvers, checked on the simulated graphs.

Reads a `MemoryProblem`, decisions (sets of recomputed candidates) and a `simulate` callable that
turns a decision into a candidate with `.recompute`, `.offloaded` and `.timeline.peak` (the planner
extracts and simulates the forward and backward graphs); returns candidates. Writes nothing but
per-process memos: the lowest decision found per problem, and the solvers' answers (`solved`).

The solvers count every value recomputed for one backward step as alive at once; the rewritten
graphs make them one after another (`fxmem.solve.recompute.phases`). So a solver's decision leaves
budget unused (`spend_slack` keeps what fits it), and its least peak is not the graphs' least
(`lowest` descends below it). At the size people train, the budget-constrained solvers fail where
plans exist (a GPT-2 of 124M shape at 8 x 1024 tokens: nothing found below 7.4 GiB in 10 s, least
5.2 GiB simulated), and relaxing from the least decision is 2-3x cheaper than relaxing from theirs: the
planner offers both and keeps the cheaper (`fxmem.planner.planner`).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Iterable

from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.solve.problem import MemoryProblem, recompute_cost
from fxmem.solve.recompute.bound import peak_lower_bound
from fxmem.solve.recompute.checkpoint import checkpoint_layers
from fxmem.solve.recompute.layers import find_layers
from fxmem.solve.recompute.phases import phase_peak
from fxmem.solve.recompute.relax import lower_peak, relax
from fxmem.solve.solution import Solution, make_solution

log = logging.getLogger("fxmem")
Simulate = Callable[[frozenset], Any]  # decision -> candidate (.recompute, .offloaded, .timeline.peak)
RELAX_TRIES = 3  # simulations while spending slack
RELAX_SHARE, RELAX_MIN_S = 0.1, 1.0  # slack spending, per try: share of the time limit, and at least this
MEMO_SIZE = 64
# The lowest decision found per problem (and allocator) in this process: the searches' limits are
# counted, not timed (`fxmem.solve.effort`), so the same call finds the same decision on any machine load,
# but a call with a shorter limit finds less: a budget named as the least by one call must not be refused
# by the next.
_LOWEST_FOUND: dict[tuple, frozenset[int]] = {}


def lowest(problem: MemoryProblem, least: frozenset[int], simulate: Simulate, time_limit_s: float,
           allocator: Any = None, also: Iterable[frozenset[int]] = ()):
    """The candidate of lowest simulated peak among the search's `least`, the lowest found before
    for this problem, every layer checkpointed, and the in-order descent from the lowest of them
    (`relax.lower_peak`, for `time_limit_s`); and the decisions in `also`, each simulated.

    Simulating is the slow part (a forward/backward extraction each), so options are simulated in
    order of their in-order peak, which tracks the simulation, skipping those whose in-order peak is
    not below the lowest simulated so far (never the remembered one)."""
    key = (replace(problem, budget=0), allocator)
    remembered = _LOWEST_FOUND.get(key)
    options = [least, *([remembered] if remembered is not None else [])]
    layers = find_layers(problem)
    if layers is not None:
        options.append(checkpoint_layers(problem, layers))
    peaks = {rec: phase_peak(problem, rec) for rec in options}
    lowered = lower_peak(problem, min(peaks, key=peaks.get), time_limit_s)
    peaks.setdefault(lowered, phase_peak(problem, lowered))
    best = None
    also = set(also)  # more decisions, simulated whatever (every block checkpointed, as module paths show blocks)
    for rec in also:
        peaks.setdefault(rec, phase_peak(problem, rec))
    for rec in sorted(peaks, key=peaks.get):
        if best is not None and peaks[rec] >= best.timeline.peak and rec != remembered and rec not in also:
            continue  # the remembered decision is simulated whatever: a least budget named before stands
        candidate = simulate(rec)
        if best is None or candidate.timeline.peak < best.timeline.peak:
            best = candidate
    if len(_LOWEST_FOUND) >= MEMO_SIZE:
        _LOWEST_FOUND.pop(next(iter(_LOWEST_FOUND)))
    _LOWEST_FOUND[key] = best.recompute
    return best


@functools.lru_cache(maxsize=MEMO_SIZE)
def solved(solve: Callable[[MemoryProblem, str, float], Solution], problem: MemoryProblem, solver: str,
           time_limit_s: float) -> Solution:
    """`solve(problem, solver, time_limit_s)`, or its answer to the same question (the same problem and
    budget) asked before in this process: a step planned again at the same budget (`fxmem.plan`, then
    `fxmem.optimize`) gets the decision it got, instead of one more solve to its time limit."""
    return solve(problem, solver, time_limit_s)


def relax_seconds(time_limit_s: float) -> float:
    """The limit of one try at spending slack, for a plan searched within `time_limit_s`."""
    return max(RELAX_MIN_S, time_limit_s * RELAX_SHARE)


def spend_slack(problem: MemoryProblem, candidate, solution: Solution, budget: int, simulate: Simulate,
                time_limit_s: float) -> tuple[Any, Solution]:
    """Keep what `candidate` recomputes while the simulated graphs stay within `budget`
    (`relax.relax`, `time_limit_s` per try); `candidate` itself when nothing cheaper fits.
    Recompute-only decisions: an offloading candidate is returned as it is."""
    if candidate.offloaded:
        return candidate, solution
    started, layers = time.perf_counter(), find_layers(problem)
    target, cost = budget, recompute_cost(problem, candidate.recompute)
    for _ in range(RELAX_TRIES):
        kept = relax(problem, candidate.recompute, target, time_limit_s, layers)
        if recompute_cost(problem, kept) >= cost:
            break
        relaxed = simulate(kept)
        if relaxed.timeline.peak <= budget:
            log.info("kept what fits the slack: recompute %.1f -> %.1f ms, simulated peak %s",
                     cost / 1e6, recompute_cost(problem, kept) / 1e6, fmt_bytes(relaxed.timeline.peak))
            return relaxed, make_solution(problem, kept, "feasible", 0, started, f"{solution.solver}+relax")
        target = min(target, phase_peak(problem, kept)) - (relaxed.timeline.peak - budget)
    return candidate, solution


def refused_at_bound(problem: MemoryProblem, budget: int, least_budget: Callable[[int], int],
                     parts: dict[str, int]) -> InfeasibleBudgetError | None:
    """The refusal of `budget` where no decision can meet it, proven from the problem alone (`peak_lower_bound`
    with the planning margin, `least_budget`), without searching for the least; None where that proves nothing
    (or offload may move values off the device, which the bound does not cover). The refusal names the bound,
    not a least found, and says so (`bound_only`): a caller that only asks whether a budget can be met (the
    engine's attempt with the outputs held) is answered in a fraction of a second; anything it passes on to
    a user is searched in full first."""
    if any(problem.can_offload):
        return None
    bound = least_budget(peak_lower_bound(problem))
    if bound <= budget:
        return None
    refusal = InfeasibleBudgetError(budget, bound, parts, lower_bound_bytes=bound)
    refusal.bound_only = True
    return refusal


def recompute_saved_s(problem: MemoryProblem, recompute: frozenset[int], room: int, time_limit_s: float) -> float:
    """Seconds of recompute `recompute` would shed with `room` more bytes at every step: `relax` on the in-order
    peak raised by `room`, as spending a plan's slack does. An estimate from above of what freeing `room` in part
    of the step (the loss in more chunks) can save, without tracing or simulating that step."""
    if not recompute:
        return 0.0
    kept = relax(problem, recompute, phase_peak(problem, recompute) + room, time_limit_s, find_layers(problem))
    return (recompute_cost(problem, recompute) - recompute_cost(problem, kept)) / 1e9
