"""The exact solver on synthetic problems (no torch): equal to brute force, never worse than the
heuristics, and its proofs hold. Reads nothing from disk; problems come from tests.solve.test_solve."""
from __future__ import annotations

import random
from dataclasses import replace

from fxmem.solve.problem import is_feasible, peak_bytes, recompute_cost, violations
from fxmem.solve.recompute import SOLVERS, solve, solve_brute, solve_cpsat, solve_greedy
from fxmem.solve.recompute.brute import brute_min_peak
from fxmem.solve.recompute.exact import exact_min_peak, solve_exact
from tests.solve.test_solve import NAMED, Op, build, chain, diamonds, eager_peak, random_problem


def _budgets(problem, low):
    high = eager_peak(problem)
    return sorted({low - 1, low, low + (high - low) // 3, (low + high) // 2, high, high + 3} - {0})


def test_registered():
    p = replace(chain(4), budget=eager_peak(chain(4)) * 3 // 4)
    sol = solve(p, "exact", 5.0)
    assert "exact" in SOLVERS and sol.solver == "exact" and sol.status == "optimal"


def test_matches_brute_on_named_and_random_problems():
    rng = random.Random(7)
    problems = list(NAMED.values()) + [random_problem(rng, rng.randint(4, 12)) for _ in range(25)]
    statuses = set()
    for problem in problems:
        lowest = brute_min_peak(problem)
        found = exact_min_peak(problem, 10.0)
        if lowest is None:
            assert found is None
            continue
        peak, rec, proven = found
        assert proven and peak == lowest[0] == peak_bytes(problem, rec) and not violations(problem, rec)
        for budget in _budgets(problem, peak):
            p = replace(problem, budget=budget)
            brute, exact = solve_brute(p), solve_exact(p, 10.0)
            statuses.add(exact.status)
            assert exact.status == brute.status, (budget, brute, exact)
            if brute.status == "optimal":
                assert exact.objective == brute.objective and is_feasible(p, exact.recompute)
                assert exact.bound == exact.objective and exact.gap == 0.0
            else:
                assert not violations(p, exact.recompute)
    assert statuses == {"optimal", "infeasible"}


def test_never_worse_than_greedy_or_cpsat():
    for problem in (chain(14), diamonds(7)):
        low = exact_min_peak(problem, 10.0)[0]
        for budget in _budgets(problem, low)[1:-1]:
            p = replace(problem, budget=budget)
            exact = solve_exact(p, 20.0)
            assert exact.status == "optimal" and is_feasible(p, exact.recompute)
            assert exact.objective == recompute_cost(p, exact.recompute) and exact.peak <= budget
            for other in (solve_greedy(p, 2.0), solve_cpsat(p, 2.0)):
                if other.fits:
                    assert exact.objective <= other.objective


def test_hint_does_not_change_the_optimum():
    problem = diamonds(5)
    p = replace(problem, budget=(exact_min_peak(problem, 10.0)[0] + eager_peak(problem)) // 2)
    plain = solve_exact(p, 10.0)
    hinted = solve_exact(p, 10.0, hint=solve_greedy(p).recompute)
    assert plain.status == hinted.status == "optimal" and plain.objective == hinted.objective


def test_fixed_bytes_over_budget_and_no_valid_decision():
    problem = chain(3)
    assert solve_exact(replace(problem, budget=max(problem.base) - 1)).status == "infeasible"
    stuck = build([Op("r", 4, 1, can_save=False, can_recompute=False), Op("y", 4, 1, ("r",), ("r",))])
    assert solve_exact(replace(stuck, budget=10**6)).status == "infeasible"
    assert exact_min_peak(stuck) is None
