"""solve/recompute/relax.py: keep what a decision recomputes while the in-order peak fits, and
recompute more where that lowers the in-order peak."""
from __future__ import annotations

import random

import pytest

from fxmem.solve.problem import (
    eager_decision,
    is_valid,
    lifetimes,
    peak_bytes,
    recompute_cost,
    repair,
)
from fxmem.solve.recompute import relax as relax_module
from fxmem.solve.recompute.bound import peak_lower_bound
from fxmem.solve.recompute.checkpoint import checkpoint_layers
from fxmem.solve.recompute.layers import find_layers
from fxmem.solve.recompute.least import least_peak
from fxmem.solve.recompute.phases import phase_peak
from fxmem.solve.recompute.relax import drop_unmade, lower_peak, relax
from tests.solve.test_layers import stack
from tests.solve.test_phases import four_link_chain
from tests.solve.test_solve import random_problem


def test_spends_the_slack_of_checkpointing_every_layer():
    problem = stack(6)
    layers = find_layers(problem)
    checkpointed = checkpoint_layers(problem, layers)
    low = phase_peak(problem, checkpointed)
    costs = []
    for slack in (0, 8, 40, 200):
        kept = relax(problem, checkpointed, low + slack, 5.0, layers)
        assert is_valid(problem, kept) and kept <= checkpointed
        assert phase_peak(problem, kept) <= low + slack
        costs.append(recompute_cost(problem, kept))
    assert costs == sorted(costs, reverse=True) and costs[-1] < costs[0] <= recompute_cost(problem, checkpointed)


def test_keeps_the_costliest_link_that_fits():
    """Backward reads d only; with room for one more link beside d, the costliest (c) is kept."""
    problem = four_link_chain()
    everything = frozenset(range(4))
    budget = phase_peak(problem, everything) + 30  # room for c (30 bytes) at d's backward step
    kept = relax(problem, everything, budget, 5.0)
    assert 2 not in kept and phase_peak(problem, kept) <= budget


def test_a_decision_over_budget_comes_back_unchanged():
    problem = stack(3)
    checkpointed = checkpoint_layers(problem, find_layers(problem))
    assert relax(problem, checkpointed, phase_peak(problem, checkpointed) - 1, 5.0) == checkpointed


@pytest.mark.parametrize("seed", range(30))
def test_random_problems_stay_valid_within_budget_and_no_dearer(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(4, 14))
    while not is_valid(problem, eager_decision(problem)):  # a value that can be neither saved nor recomputed
        problem = random_problem(rng, rng.randint(4, 14))
    decision = repair(problem, {i for i in range(problem.num_values) if problem.can_recompute[i] and rng.random() < 0.6})
    if not is_valid(problem, decision):
        decision = eager_decision(problem)
    budget = phase_peak(problem, decision) + rng.randint(0, 20)
    kept = relax(problem, decision, budget, 5.0)
    assert is_valid(problem, kept) and phase_peak(problem, kept) <= budget
    assert recompute_cost(problem, kept) <= recompute_cost(problem, decision)
    assert drop_unmade(problem, kept) == kept  # every value left is made by some backward step
    assert kept <= lifetimes(problem, kept).keys()


def test_lower_peak_descends_from_checkpointing_in_order():
    problem = stack(12)
    checkpointed = checkpoint_layers(problem, find_layers(problem))
    lowered = lower_peak(problem, checkpointed, 5.0)
    assert is_valid(problem, lowered)
    assert peak_lower_bound(problem) <= phase_peak(problem, lowered) < phase_peak(problem, checkpointed)


def test_lower_peak_recomputes_a_value_with_its_inputs(monkeypatch):
    """Recomputing a layer's output alone keeps its inputs instead, alive at the same steps; with its
    inputs back to the values kept already, the peak falls further (12 layers: 232 against 244)."""
    problem = stack(12)
    checkpointed = checkpoint_layers(problem, find_layers(problem))
    with_inputs = lower_peak(problem, checkpointed, 5.0)
    monkeypatch.setattr(relax_module, "_cone", lambda problem, rec, v: rec | {v})
    alone = lower_peak(problem, checkpointed, 5.0)
    assert is_valid(problem, with_inputs) and is_valid(problem, alone)
    assert phase_peak(problem, with_inputs) < phase_peak(problem, alone)


def test_least_peak_is_never_above_checkpointing_whatever_the_size():
    """Small stacks (the exact program's size) get the checkpoint offers too."""
    for count in (3, 6, 12):
        problem = stack(count)
        least = least_peak(problem, 3.0)
        assert least.peak <= peak_bytes(problem, checkpoint_layers(problem, find_layers(problem)))


def test_decisions_are_frozensets():
    problem = stack(3)
    checkpointed = checkpoint_layers(problem, find_layers(problem))
    for decision in (drop_unmade(problem, checkpointed), relax(problem, checkpointed, 10**9, 1.0),
                     lower_peak(problem, checkpointed, 1.0)):
        assert isinstance(decision, frozenset)
