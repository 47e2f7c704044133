"""The least peak (`fxmem.solve.recompute.least`) and its lower bound (`bound`): the bound is never
above the true least peak, the least peak is proven only when it is the least, and a refusal says
which of the two it gives."""
from __future__ import annotations

import dataclasses
import random

import pytest

from fxmem.errors import InfeasibleBudgetError
from fxmem.solve.problem import peak_bytes, violations
from fxmem.solve.recompute.bound import peak_lower_bound
from fxmem.solve.recompute.brute import brute_min_peak
from fxmem.solve.recompute import least
from fxmem.solve.recompute.least import least_peak
from tests.solve.test_solve import NAMED, random_problem


def _problems():
    rng = random.Random(7)
    return list(NAMED.values()) + [random_problem(rng, rng.randint(4, 12)) for _ in range(25)]


def test_bound_never_above_the_least_peak_and_proofs_are_true():
    tight = 0
    for problem in _problems():
        lowest = brute_min_peak(problem)
        if lowest is None:
            continue
        bound = peak_lower_bound(problem)
        assert bound <= lowest[0]
        tight += bound == lowest[0]
        found = least_peak(problem, 5.0)
        assert found.peak == peak_bytes(problem, found.recompute) and not violations(problem, found.recompute)
        assert found.lower_bound <= lowest[0] <= found.peak
        if found.proven:
            assert found.peak == lowest[0] and found.gap == 0.0
    assert tight, "the bound is reached on some instances"


def test_every_limit_returns_a_decision(monkeypatch):
    monkeypatch.setattr(least, "_FOUND", {})  # searched now, not remembered from the test above
    problem = next(p for p in _problems() if brute_min_peak(p) is not None)
    found = least_peak(problem, 1e-3)
    assert not violations(problem, found.recompute)


def test_an_answer_is_given_again_at_any_budget_unless_a_longer_search_may_improve_it(monkeypatch):
    monkeypatch.setattr(least, "_FOUND", {})
    searches, proven, search = [], [False], least._search

    def counted(problem, limit):
        searches.append(limit)
        return dataclasses.replace(search(problem, limit), proven=proven[0])

    monkeypatch.setattr(least, "_search", counted)
    problem = NAMED["diamonds3"]
    first = least_peak(problem, 0.5)
    assert first.peak == peak_bytes(problem, first.recompute) and not violations(problem, first.recompute)
    assert least_peak(dataclasses.replace(problem, budget=problem.budget + 1), 0.5) is first  # budget ignored
    assert least_peak(problem, 0.1) is first and searches == [0.5]
    least_peak(problem, 1.0)  # a longer search may find a lower peak
    proven[0] = True
    least_peak(problem, 2.0)
    assert least_peak(problem, 5.0).proven and searches == [0.5, 1.0, 2.0]  # a proven least stands


def test_refusal_says_minimum_only_when_proven():
    proven = str(InfeasibleBudgetError(2**20, 3 * 2**20))
    assert "below the minimum 3.0 MiB" in proven and "time_limit_s" not in proven
    found = InfeasibleBudgetError(2**20, 3 * 2**20, lower_bound_bytes=2 * 2**20, proven=False)
    text = str(found)
    assert "least budget found, 3.0 MiB (proven >= 2.0 MiB)" in text and "time_limit_s" in text
    assert not found.proven and found.lower_bound_bytes == 2 * 2**20
    met = InfeasibleBudgetError(2**20, 3 * 2**20, lower_bound_bytes=3 * 2**20, proven=False)
    assert met.proven and "below the minimum" in str(met)


@pytest.mark.parametrize("limit", [0.0, -1.0])
def test_time_limit_must_be_positive(limit):
    import torch

    import fxmem
    with pytest.raises(ValueError, match="time_limit_s must be a positive"):
        fxmem.plan(torch.nn.Linear(4, 4), (torch.randn(2, 4),), budget_gb=1.0, time_limit_s=limit)


@pytest.mark.parametrize("first_proves,interleaved", [(True, True), (False, True), (False, False)])
def test_cpsat_tries_an_eighth_of_its_limit_first_and_its_proof_ends_the_search(monkeypatch, first_proves, interleaved):
    """Where its workers interleave, CP-SAT runs first within an eighth of its limit; a proof there is the answer
    (proven, no exact program, no run at the whole limit); otherwise CP-SAT runs again within the whole limit, as it
    did alone. One worker (larger problems) runs once, at the whole limit."""
    monkeypatch.setattr(least, "_FOUND", {})
    if not interleaved:
        monkeypatch.setattr(least, "INTERLEAVED_UP_TO", 0)
    monkeypatch.setattr(least, "peak_lower_bound", lambda problem: 0)  # the bound never proves: CP-SAT runs
    problem = NAMED["diamonds3"]
    limits, exact_runs, cpsat = [], [], least.cpsat_min_peak

    def counted(problem, limit, **kwargs):
        limits.append(limit.seconds)
        peak, rec, _ = cpsat(problem, limit, **kwargs)
        return peak, rec, first_proves or len(limits) > 1

    monkeypatch.setattr(least, "cpsat_min_peak", counted)
    monkeypatch.setattr(least, "exact_min_peak", lambda *args: exact_runs.append(args) or None)
    found = least_peak(problem, 4.0)
    assert found.peak == peak_bytes(problem, found.recompute) and not violations(problem, found.recompute)
    if not interleaved:  # one run, unproven: the exact program runs to prove it
        assert len(limits) == 1 and exact_runs
    elif first_proves:
        assert len(limits) == 1 and found.proven and not exact_runs
    else:  # the first try, then the whole limit, which proves it
        assert len(limits) == 2 and limits[0] == pytest.approx(limits[1] * least.FIRST_TRY)
        assert found.proven and not exact_runs
