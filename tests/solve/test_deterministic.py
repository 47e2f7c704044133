"""Limits are counted, not timed (`fxmem.solve.effort`): the same problem and limit give the same answer
whether the machine is idle or busy, and a search cut short by its limit never calls a budget infeasible.

Each search below is given a limit that cuts it short (a longer one finds another answer), so a wall-clock
limit would stop it at another point when a busy thread takes the CPU from it."""
from __future__ import annotations

import random
import threading
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest

from fxmem.solve.effort import Effort
from fxmem.solve.packing import pack_buffers
from fxmem.solve.problem import is_feasible, peak_bytes
from fxmem.solve.recompute import least, solve, solve_cpsat, solve_exact
from fxmem.solve.recompute.bound import peak_lower_bound
from fxmem.solve.recompute.least import least_peak
from fxmem.solve.recompute.relax import lower_peak, relax
from tests.solve.test_layers import stack
from tests.solve.test_solve import chain, diamonds, eager_peak


@contextmanager
def busy():
    """A thread spinning beside the search: it takes the interpreter and a core from it."""
    stop = threading.Event()

    def spin():
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _twice(search):
    """The search's answer alone, then beside a busy thread."""
    first = search()
    with busy():
        second = search()
    return first, second


def _decided(solution):
    return (solution.recompute, solution.offloaded, solution.status, solution.objective, solution.peak, solution.bound)


def _tight(problem, fraction=0.6):
    return replace(problem, budget=int(eager_peak(problem) * fraction))


@pytest.mark.parametrize("solver,limit,problem,fraction", [
    ("cpsat", 0.3, stack(6), 0.7), ("greedy", 0.002, chain(150), 0.6), ("auto", 0.03, diamonds(10), 0.6),
    ("layered", 0.02, stack(10), 0.3)])
def test_a_solver_cut_short_decides_the_same_beside_a_busy_thread(solver, limit, problem, fraction):
    problem = _tight(problem, fraction)
    first, second = _twice(lambda: solve(problem, solver, limit))
    assert _decided(first) == _decided(second)
    assert _decided(first) != _decided(solve(problem, solver, 5 * limit)), "the limit cut the search short"


def test_the_exact_program_cut_short_decides_the_same_beside_a_busy_thread():
    problem = _tight(diamonds(12), 0.5)
    first, second = _twice(lambda: solve_exact(problem, 0.1))
    assert _decided(first) == _decided(second)
    assert _decided(first) != _decided(solve_exact(problem, 0.5)), "the limit cut the search short"


def test_the_least_peak_is_the_same_beside_a_busy_thread(monkeypatch):
    problem = diamonds(10)
    monkeypatch.setattr(least, "GREEDY_MIN_S", 0.0)  # the whole search within the short limit

    def search(limit=0.2):
        least._FOUND.clear()  # searched again, not remembered
        return least_peak(problem, limit)

    first, second = _twice(search)
    assert first == second
    assert first != search(0.6), "the limit cut the search short"


def test_the_in_order_searches_stop_at_the_same_move_beside_a_busy_thread():
    problem = chain(150)
    start = solve(_tight(problem, 0.5), "greedy").recompute
    first, second = _twice(lambda: (lower_peak(problem, start, 0.003),
                                    relax(problem, start, eager_peak(problem), 0.003)))
    assert first == second
    assert first[0] != lower_peak(problem, start, 1.0), "the limit cut the descent short"


def test_packing_cut_short_gives_the_same_offsets_beside_a_busy_thread():
    rng = random.Random(2)  # random lifetimes: merging does not rebuild them, as it does the cut rectangles
    buffers = [(s, s + rng.randint(1, 100), 64 * rng.randint(1, 64)) for s in (rng.randrange(800) for _ in range(400))]
    first, second = _twice(lambda: pack_buffers(buffers, time_limit_s=0.3))
    assert first.offsets == second.offsets and first.arena_bytes == second.arena_bytes
    assert first.offsets != pack_buffers(buffers, time_limit_s=0.9).offsets, "the limit cut the search short"


def test_cut_short_a_search_says_unknown_or_feasible_never_infeasible():
    """One byte below the least peak nothing fits: given its limit, CP-SAT proves it (and so does the exact
    program); cut short, they prove nothing and say so ("unknown", with their best try). Above it, cut short,
    they keep what fits."""
    problem = chain(12)
    lowest = least_peak(problem, 5.0)
    below = replace(problem, budget=lowest.peak - 1)
    assert lowest.proven and peak_lower_bound(problem) < below.budget  # no proof from the problem alone
    assert solve_cpsat(below, 5.0).status == solve_exact(below, 5.0).status == "infeasible"
    for cut in (0.0, 0.01):
        for short in (solve_cpsat(below, cut), solve_exact(below, cut / 100)):
            assert short.status == "unknown" and not short.fits and short.bound == 0
            assert short.peak == peak_bytes(below, short.recompute) > below.budget
    above = _tight(problem, 0.8)
    short = solve_cpsat(above, 0.01)
    assert short.fits and is_feasible(above, short.recompute)
    larger = _tight(diamonds(12), 0.5)  # where the exact program finds nothing of its own so soon
    fitting = solve(larger, "cpsat", 2.0)
    assert solve_exact(larger, 0.0001).status == "unknown"
    hinted = solve_exact(larger, 0.0001, hint=fitting.recompute)
    assert fitting.fits and hinted.status == "feasible" and hinted.recompute == fitting.recompute


def test_an_effort_counts_what_its_parts_spend():
    effort = Effort.of(2.0)
    part = effort.part(0.5)
    part.spend(1.0e6)
    assert effort.left_s == pytest.approx(1.0) and part.done() and not effort.done()
    assert effort.until(0.5).limit == 0 and effort.until(1.0).left_s == pytest.approx(1.0)
    assert effort.part(least_s=3.0).seconds == 3.0 and effort.part(most_s=0.25).seconds == 0.25
    assert Effort.of(effort) is effort and np.isclose(Effort.of(0.5).limit, 5e5)
