"""Solvers on synthetic problems (no torch): greedy and CP-SAT against brute force.

Reads nothing from disk; builds `MemoryProblem`s from small op lists below.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import pytest

from fxmem.solve.problem import (NEVER, MemoryProblem, eager_decision, is_feasible, peak_bytes,
                           recompute_cost, violations)
from fxmem.solve.recompute import SOLVERS, min_peak, solve, solve_brute, solve_cpsat, solve_greedy
from fxmem.solve.recompute.brute import brute_min_peak
from fxmem.solve.recompute.greedy import greedy_min_peak


@dataclass(frozen=True)
class Op:
    name: str
    size: int
    cost: int
    inputs: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()  # values this op's backward reads
    can_save: bool = True
    can_recompute: bool = True
    alias: bool = False  # a view of its inputs


def build(ops: list[Op], params: int = 16) -> MemoryProblem:
    """Op k runs forward at step k and backward at step 2n-1-k; a saved value costs memory from
    step k+1; backward reads come from each op's `reads`. base: params + the op at each step."""
    n, idx = len(ops), {op.name: k for k, op in enumerate(ops)}
    uses: list[list[int]] = [[] for _ in ops]
    for k, op in enumerate(ops):
        for name in op.reads:
            uses[idx[name]].append(2 * n - 1 - k)
    problem = MemoryProblem(
        names=tuple(op.name for op in ops), size=tuple(0 if op.alias else op.size for op in ops),
        cost=tuple(op.cost for op in ops), inputs=tuple(tuple(idx[x] for x in op.inputs) for op in ops),
        aliases=tuple(op.alias for op in ops), needed=tuple(bool(u) for u in uses),
        can_save=tuple(op.can_save for op in ops), can_recompute=tuple(op.can_recompute for op in ops),
        saved_from=tuple(k + 1 for k in range(n)),
        need_first=tuple(min(u) if u else NEVER for u in uses),
        need_last=tuple(max(u) if u else NEVER for u in uses),
        base=tuple(params + ops[min(t, 2 * n - 1 - t)].size for t in range(2 * n)), budget=1)
    return replace(problem, budget=eager_peak(problem))


def chain(k: int) -> MemoryProblem:
    """k layers of matmul (costly) then relu (cheap); backward reads both."""
    ops = []
    for l in range(1, k + 1):
        prev = (f"h{l - 1}",) if l > 1 else ()
        ops.append(Op(f"m{l}", 4 + l % 3, 100 + 7 * l, prev, prev))
        ops.append(Op(f"h{l}", 4, 3, (f"m{l}",), (f"m{l}",) + ((f"h{l}",) if l == k else ())))
    return build(ops)


def diamonds(k: int) -> MemoryProblem:
    """k diamonds: a read by b and c, which d joins."""
    ops = []
    for l in range(k):
        prev = (f"d{l - 1}",) if l else ()
        ops += [Op(f"a{l}", 6, 80, prev, prev), Op(f"b{l}", 6, 2, (f"a{l}",), (f"a{l}",)),
                Op(f"c{l}", 3, 9, (f"a{l}",), (f"a{l}",)),
                Op(f"d{l}", 6, 4, (f"b{l}", f"c{l}"), (f"b{l}", f"c{l}"))]
    return build(ops)


def mixed() -> MemoryProblem:
    """A view (unsaveable, free), a multi-output op (unsaveable) and its parts, a dropout."""
    return build([
        Op("x", 8, 60), Op("v", 2, 0, ("x",), can_save=False, alias=True), Op("y", 8, 3, ("v",), ("v",)),
        Op("t", 8, 5, ("y",), can_save=False), Op("p1", 4, 0, ("t",)), Op("p2", 4, 0, ("t",)),
        Op("z", 4, 4, ("p1", "p2"), ("p1", "p2")), Op("d", 4, 2, ("z",), can_recompute=False),
        Op("o", 6, 40, ("d",), ("d",)), Op("q", 6, 2, ("o",), ("o", "q"))])


def random_problem(rng: random.Random, n: int) -> MemoryProblem:
    ops = []
    for k in range(n):
        ins = tuple(f"v{j}" for j in rng.sample(range(k), min(k, rng.randint(0, 2))))
        reads = tuple(f"v{j}" for j in rng.sample(range(k + 1), rng.randint(0, min(2, k + 1))))
        cost = rng.choice([0, rng.randint(1, 30), rng.randint(1, 30)])
        ops.append(Op(f"v{k}", rng.randint(1, 10), cost, ins, reads,
                      rng.random() > 0.15, rng.random() > 0.1))
    return build(ops, params=rng.randint(0, 8))


def eager_peak(problem: MemoryProblem) -> int:
    return peak_bytes(problem, eager_decision(problem))


def budgets(problem: MemoryProblem, count: int = 5) -> list[int]:
    """Budgets from the least achievable peak up to eager's peak."""
    low, high = min_peak(problem, 5.0)[0], eager_peak(problem)
    return sorted({low + (high - low) * k // (count - 1) for k in range(count)})


NAMED = {"chain6": chain(6), "diamonds3": diamonds(3), "mixed": mixed()}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_greedy_and_cpsat_feasible_between_min_peak_and_eager(name):
    problem = NAMED[name]
    for budget in budgets(problem):
        p = replace(problem, budget=budget)
        greedy, exact = solve_greedy(p), solve_cpsat(p, 5.0)
        assert exact.status == "optimal" and is_feasible(p, exact.recompute)
        if budget >= peak_bytes(p, greedy_min_peak(p)):  # greedy reaches what its descent reaches
            assert greedy.fits and is_feasible(p, greedy.recompute)
            assert exact.objective <= greedy.objective


@pytest.mark.parametrize("name", sorted(NAMED))
def test_cpsat_matches_brute_on_named_problems(name):
    problem = NAMED[name]
    for budget in budgets(problem, 4):
        p = replace(problem, budget=budget)
        brute, exact = solve_brute(p), solve_cpsat(p, 5.0)
        assert (exact.status, exact.objective) == (brute.status, brute.objective)


def test_cpsat_matches_brute_on_random_problems():
    rng = random.Random(1234)
    statuses = set()
    for _ in range(20):
        problem = random_problem(rng, rng.randint(4, 12))
        lowest = brute_min_peak(problem)
        low = lowest[0] if lowest else eager_peak(problem)
        p = replace(problem, budget=max(1, rng.randint(low - 2, eager_peak(problem) + 2)))
        brute, exact, greedy = solve_brute(p), solve_cpsat(p, 5.0), solve_greedy(p)
        statuses.add(brute.status)
        assert exact.status == brute.status
        assert lowest is None or not violations(p, greedy.recompute)
        if brute.status == "optimal":
            assert exact.objective == brute.objective and is_feasible(p, exact.recompute)
            assert exact.bound == exact.objective and exact.gap == 0.0
            assert not greedy.fits or greedy.objective >= brute.objective
    assert statuses == {"optimal", "infeasible"}  # the instances exercise both outcomes


def test_min_peak_matches_brute_and_is_reachable():
    rng = random.Random(99)
    problems = list(NAMED.values()) + [random_problem(rng, rng.randint(4, 12)) for _ in range(10)]
    for problem in problems:
        lowest = brute_min_peak(problem)
        if lowest is None:
            with pytest.raises(ValueError):
                min_peak(problem)
            continue
        peak, rec = min_peak(problem)
        assert peak == lowest[0] == peak_bytes(problem, rec) and not violations(problem, rec)
        at_min = solve_cpsat(replace(problem, budget=peak))
        assert at_min.status == "optimal" and at_min.peak <= peak
        below = replace(problem, budget=peak - 1)
        if below.budget > 0:
            for solver in SOLVERS:  # the greedy descent proves nothing: it may only say it found nothing
                status = solve(below, solver).status
                assert status in (("infeasible", "unknown") if solver == "greedy" else ("infeasible",)), solver


def test_generous_budget_recomputes_nothing_costly():
    for problem in NAMED.values():
        p = replace(problem, budget=eager_peak(problem) + 10)
        for solver in SOLVERS:
            sol = solve(p, solver)
            assert sol.objective == 0 and sol.status == "optimal" and is_feasible(p, sol.recompute)


def test_rules_never_violated():
    problem = mixed()
    random_op, unsaveable = problem.names.index("d"), {problem.names.index(x) for x in ("v", "t")}
    for budget in budgets(problem):
        p = replace(problem, budget=budget)
        for solver in SOLVERS:
            sol = solve(p, solver)
            assert not violations(p, sol.recompute)
            assert random_op not in sol.recompute
    rec = solve(replace(problem, budget=budgets(problem)[0]), "cpsat").recompute
    assert unsaveable & rec  # a tight budget does recompute through the unsaveable values


def test_cpsat_monotone_in_budget():
    problem = chain(6)
    high, low = eager_peak(problem), min_peak(problem)[0]
    results = [solve_cpsat(replace(problem, budget=b)) for b in range(high, low - 1, -3)]
    assert all(r.status == "optimal" for r in results)
    for looser, tighter in zip(results, results[1:]):
        assert tighter.peak <= looser.peak and tighter.objective >= looser.objective
    assert results[-1].objective > results[0].objective == 0


def test_cpsat_deterministic():
    p = replace(chain(12), budget=(eager_peak(chain(12)) * 2) // 3)
    runs = {solve_cpsat(p, 5.0).recompute for _ in range(3)}
    assert len(runs) == 1


def test_solution_fields_consistent():
    p = replace(diamonds(3), budget=budgets(diamonds(3))[1])
    for solver in SOLVERS:
        sol = solve(p, solver, 5.0)
        assert sol.solver == solver
        assert sol.objective == recompute_cost(p, sol.recompute)
        assert sol.peak == peak_bytes(p, sol.recompute) <= p.budget
        assert 0 <= sol.bound <= sol.objective and 0.0 <= sol.gap <= 1.0 and sol.solve_time_s >= 0


def test_errors():
    p = chain(3)
    with pytest.raises(ValueError, match="greedy"):
        solve(p, "magic")
    with pytest.raises(ValueError):
        solve(replace(p, budget=0))
    with pytest.raises(ValueError):
        solve_brute(chain(11))  # 22 recomputable candidates


def test_no_valid_decision_is_infeasible():
    problem = build([Op("r", 4, 1, can_save=False, can_recompute=False),
                     Op("y", 4, 1, ("r",), ("r",))])
    for solver in SOLVERS:
        assert solve(replace(problem, budget=10**6), solver).status == "infeasible"
    with pytest.raises(ValueError):
        min_peak(problem)


def test_cpsat_falls_back_to_greedy_when_out_of_time(monkeypatch):
    """CP-SAT out of time with no decision: the greedy decision, with the greedy's status."""
    import fxmem.solve.recompute.cpsat as cpsat

    problem = chain(60)
    p = replace(problem, budget=eager_peak(problem) // 2)
    greedy = solve_greedy(p)
    assert greedy.status == "feasible"
    monkeypatch.setattr(cpsat._Model, "run", lambda self, *args: (cpsat.cp_model.UNKNOWN, None))
    sol = solve_cpsat(p, time_limit_s=5.0)
    assert sol.solver == "cpsat" and sol.status == "feasible" and sol.recompute == greedy.recompute
    assert is_feasible(p, sol.recompute) and not violations(p, sol.recompute)


def test_cpsat_out_of_time_never_calls_an_unchecked_decision_feasible():
    """With too little time for either solver to fit the budget, whatever comes back is called feasible
    exactly when it is, and never infeasible: running out of time proves nothing."""
    problem = chain(1000)
    p = replace(problem, budget=eager_peak(problem) // 2)
    sol = solve_cpsat(p, time_limit_s=0.05)
    assert sol.solver == "cpsat" and not violations(p, sol.recompute)
    assert sol.status in ("unknown", "feasible") and sol.fits == is_feasible(p, sol.recompute)


def test_speed_2000_candidates():
    problem = chain(1000)
    budget = (peak_bytes(problem, greedy_min_peak(problem)) + eager_peak(problem)) // 2
    p = replace(problem, budget=budget)
    start = time.process_time()  # CPU seconds: limits are counted work, which a loaded machine only stretches
    greedy = solve_greedy(p)
    assert time.process_time() - start < 5.0 and greedy.status == "feasible"
    start = time.process_time()
    exact = solve_cpsat(p, 5.0)
    assert time.process_time() - start < 8.0
    assert exact.status in ("optimal", "feasible") and is_feasible(p, exact.recompute)
    assert exact.objective <= greedy.objective


@pytest.mark.parametrize("solver", ["greedy", "cpsat"])
def test_recompute_only_problems_never_offload(solver):
    """Without `enable_offload` the problem has no offload fields and solutions offload nothing."""
    p = chain(4)
    assert p.can_offload == () and not any(p.offloadable(i) for i in range(p.num_values))
    for budget in (p.budget, p.budget - 6):
        got = solve(replace(p, budget=budget), solver, 2.0)
        assert got.offloaded == frozenset()
        assert got.objective == recompute_cost(p, got.recompute)
