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
