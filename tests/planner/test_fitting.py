"""fxmem/planner/fitting.py and the planner's two routes: the least budget one call names is never refused
by the next, and offering the relaxed least decision beside the solver's never costs more."""
from __future__ import annotations

import pytest
import torch

import fxmem
import fxmem.planner.attention_chunks
import fxmem.planner.loss_chunks
import fxmem.planner.fitting
import fxmem.planner.planner
from fxmem import models
from fxmem.planner.fitting import spend_slack
from fxmem.measure import measure_peak_bytes
from fxmem.solve.problem import recompute_cost
from fxmem.solve.recompute.least import LeastPeak
from fxmem.solve.solution import Solution
from tests.conftest import GIB, assert_trains_like


def _gpt():
    torch.manual_seed(0)
    return models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")


@pytest.fixture(scope="module", autouse=True)
def loss_as_traced():
    """These tests follow the solvers' routes on one graph: the loss and attention are planned as traced, not
    in chunks (which plans a graph per chunk count; tests/passes/test_chunked_loss.py and test_chunked_attention.py
    cover that)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fxmem.planner.attention_chunks, "loss_sites", lambda gm: [])
        patch.setattr(fxmem.planner.attention_chunks, "attention_sites", lambda gm: [])
        patch.setattr(fxmem.planner.loss_chunks, "loss_sites", lambda gm: [])
        yield


@pytest.fixture(scope="module")
def bounds():
    """gpt-tiny's least budget and eager peak, planned once for the tests below (before they patch the planner)."""
    model, inputs = _gpt()
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, time_limit_s=2)
    return info.value.min_budget_bytes, fxmem.plan(model, inputs).baseline_peak_bytes


def test_a_named_least_budget_is_met_when_the_next_search_finds_worse(monkeypatch, bounds):
    model, inputs = _gpt()
    least, _ = bounds
    # a busier machine: the next searches find only "recompute nothing", far above the least
    monkeypatch.setattr(fxmem.planner.planner, "least_peak", lambda problem, *_: LeastPeak(
        peak=1 << 62, recompute=frozenset(), lower_bound=0, proven=False, method="slow machine"))
    monkeypatch.setattr(fxmem.planner.planner, "solve", _nothing_fits)
    plan = fxmem.plan(model, inputs, budget_gb=least / GIB, time_limit_s=2)
    optimized = fxmem.optimize(model, plan=plan)
    assert measure_peak_bytes(optimized, inputs) <= least
    assert_trains_like(_gpt()[0], optimized, inputs)  # measuring left the weights as they were


def _nothing_fits(problem, solver, time_limit_s):
    return Solution(recompute=frozenset(), status="infeasible", objective=0, peak=0, bound=0, gap=0.0,
                    solve_time_s=0.0, solver=solver)


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_the_cheaper_of_the_solvers_and_the_least_route_is_kept(monkeypatch, bounds, fraction):
    model, inputs = _gpt()
    least, eager_peak = bounds
    budget = least + fraction * (eager_peak - least)
    routes = []  # (candidate, solution) of the solver's route, then of the least route, slack spent

    def recorded(problem, *args):
        found = spend_slack(problem, *args)
        routes.append((found, recompute_cost(problem, found[0].recompute)))
        return found

    monkeypatch.setattr(fxmem.planner.planner, "LARGE_CANDIDATES", 0)  # both routes, as on graphs of > 200 values
    monkeypatch.setattr(fxmem.planner.planner, "spend_slack", recorded)
    plan = fxmem.plan(model, inputs, budget_gb=budget / GIB, time_limit_s=4)
    assert plan.min_budget_bytes is not None and len(routes) == 2  # both routes ran
    (_, cheaper), _ = min(routes, key=lambda route: route[1])  # the solver's on a tie
    assert plan.solver == cheaper.solver
    optimized = fxmem.optimize(model, plan=plan)
    assert measure_peak_bytes(optimized, inputs) <= budget
    assert_trains_like(_gpt()[0], optimized, inputs)


def test_a_solve_asked_again_is_answered_from_memory():
    """`solved`: the same problem, budget, solver and time limit solved once per process; any other asks again."""
    from dataclasses import replace

    from fxmem.solve.recompute import solve
    from tests.solve.test_solve import NAMED

    fxmem.planner.fitting.solved.cache_clear()
    asked = []

    def counted(problem, solver, limit):
        asked.append((problem.budget, limit))
        return solve(problem, solver, limit)

    problem = NAMED["chain6"]
    first = fxmem.planner.fitting.solved(counted, problem, "greedy", 0.5)
    assert fxmem.planner.fitting.solved(counted, problem, "greedy", 0.5) is first and len(asked) == 1
    fxmem.planner.fitting.solved(counted, replace(problem, budget=problem.budget + 1), "greedy", 0.5)
    fxmem.planner.fitting.solved(counted, problem, "greedy", 1.0)
    fxmem.planner.fitting.solved(solve, problem, "greedy", 0.5)  # another solve function (a test's patch) is its own
    assert asked == [(problem.budget, 0.5), (problem.budget + 1, 0.5), (problem.budget, 1.0)]


def _forget_searches():
    """Clear what this process remembers of earlier searches, so the next plan searches again."""
    from fxmem.solve.recompute import least

    fxmem.planner.fitting.solved.cache_clear()
    fxmem.planner.fitting._LOWEST_FOUND.clear()
    least._FOUND.clear()


def test_the_same_step_is_planned_the_same_beside_a_busy_thread(bounds):
    """Limits are counted work, not seconds: a plan made again, with a thread spinning beside it, is the same."""
    from tests.solve.test_deterministic import busy

    model, inputs = _gpt()
    least, eager_peak = bounds
    budget = (least + 0.3 * (eager_peak - least)) / GIB
    _forget_searches()
    first = fxmem.plan(model, inputs, budget_gb=budget, time_limit_s=1)
    _forget_searches()
    with busy():
        second = fxmem.plan(model, inputs, budget_gb=budget, time_limit_s=1)
    assert first.recompute and first.recompute == second.recompute and first.saved == second.saved
    assert first.predicted_peak_bytes == second.predicted_peak_bytes and first.solver == second.solver


def test_a_solver_out_of_its_limit_is_not_asked_again(monkeypatch, bounds):
    """A solve that found nothing within its limit ("unknown") proves nothing and offers no decision to
    tighten: the planner asks it once, then searches the least budget, and names the least it found as found."""
    model, inputs = _gpt()
    least, _ = bounds
    asked = []

    def out_of_its_limit(problem, solver, time_limit_s):
        asked.append(problem.budget)
        return Solution(recompute=frozenset(), status="unknown", objective=0, peak=1 << 40, bound=0, gap=1.0,
                        solve_time_s=0.0, solver=solver)

    monkeypatch.setattr(fxmem.planner.planner, "solve", out_of_its_limit)
    monkeypatch.setattr(fxmem.planner.planner, "least_peak", lambda problem, *_: LeastPeak(
        peak=1 << 62, recompute=frozenset(), lower_bound=0, proven=False, method="out of its limit"))
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, inputs, budget_gb=0.5 * least / GIB, time_limit_s=1)
    assert len(asked) == 1
    assert not refused.value.proven and "least budget found" in str(refused.value)


def test_a_budget_under_the_peaks_lower_bound_is_refused_naming_it_and_one_over_it_is_not_decided():
    """`refused_at_bound` proves a refusal from the problem alone (no search): under the bound (with the margin)
    it names the bound and says it is one; at the bound it decides nothing; with offload allowed it never refuses."""
    from dataclasses import replace

    from fxmem.planner.fitting import refused_at_bound
    from fxmem.solve.recompute.bound import peak_lower_bound
    from fxmem.solve.recompute.least import least_peak
    from tests.solve.test_solve import chain

    problem = chain(6)
    bound = peak_lower_bound(problem)
    assert bound <= least_peak(problem, 1.0).peak  # a bound, not more than the least found
    plus_ten = lambda peak: peak + 10  # noqa: E731 (a margin of 10 bytes)
    refusal = refused_at_bound(problem, bound + 9, plus_ten, {"parameters": 1})
    assert refusal.bound_only and refusal.min_budget_bytes == bound + 10 and refusal.budget_bytes == bound + 9
    assert refusal.breakdown == {"parameters": 1} and refusal.proven
    assert refused_at_bound(problem, bound + 10, plus_ten, {}) is None
    n = problem.num_values
    offloadable = replace(problem, can_offload=(True,) * n, transfer_ns=(1,) * n, offload_ready=problem.need_first,
                          offload_blockers=((),) * n, step_ns=(1,) * len(problem.base))
    assert refused_at_bound(offloadable, 1, plus_ten, {}) is None


def test_more_room_sheds_recompute_as_relaxing_with_that_room_does():
    """`recompute_saved_s`: no room sheds nothing; room for every recomputed value sheds all of their cost."""
    from tests.solve.test_solve import chain
    from fxmem.planner.fitting import recompute_saved_s
    from fxmem.solve.recompute.phases import phase_peak

    from fxmem.solve.problem import is_valid

    problem = chain(6)
    everything = frozenset(range(0, problem.num_values, 2))  # every matmul recomputed
    assert is_valid(problem, everything)
    assert recompute_saved_s(problem, everything, 0, 1.0) * 1e9 < recompute_cost(problem, everything)
    all_s = recompute_cost(problem, everything) / 1e9
    assert recompute_saved_s(problem, everything, 10**9, 1.0) == pytest.approx(all_s)
    assert recompute_saved_s(problem, frozenset(), 10**9, 1.0) == 0.0
    assert phase_peak(problem, everything) > 0


def test_on_a_large_problem_the_solvers_are_not_run_below_the_least_of_their_model(monkeypatch, bounds):
    """At the least budget the least route alone fits: the solvers' model (every value recomputed for a step
    alive at once) has a higher least, so on a large problem (`LARGE_CANDIDATES`) the least is searched first and
    the solvers, which would fit nothing, are not run; the plan still meets the budget measured."""
    model, inputs = _gpt()
    least, _ = bounds
    asked, solved = [], fxmem.planner.planner.solved
    monkeypatch.setattr(fxmem.planner.planner, "LARGE_CANDIDATES", 0)
    monkeypatch.setattr(fxmem.planner.planner, "solved", lambda *args: asked.append(args[2]) or solved(*args))
    plan = fxmem.plan(model, inputs, budget_gb=least / GIB, time_limit_s=2)
    assert asked == [] and plan.solver.startswith("min-peak")
    optimized = fxmem.optimize(model, plan=plan)
    assert measure_peak_bytes(optimized, inputs) <= least
