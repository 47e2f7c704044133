"""solve/recompute/phases.py: each backward step's recomputation played in order."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fxmem.solve.problem import eager_decision, is_valid, memory_profile, repair
from fxmem.solve.recompute.phases import phase_peak, phase_profile
from tests.solve.test_solve import Op, build, random_problem

PARAMS = 16


def four_link_chain():
    """a -> b -> c -> d in forward; backward reads only d; everything else is free to drop."""
    return build([Op("a", 10, 5), Op("b", 20, 5, ("a",)), Op("c", 30, 5, ("b",)), Op("d", 40, 5, ("c",), ("d",))],
                 params=PARAMS)


def test_a_recomputed_chain_holds_two_links_at_a_time():
    problem = four_link_chain()
    everything = frozenset(range(4))
    step = problem.need_first[3]  # d is made just before the backward step that reads it
    stepwise = memory_profile(problem, everything)
    assert stepwise[step] == problem.base[step] + 10 + 20 + 30 + 40  # all links at once
    inherited = min(problem.base[step - 1], problem.base[step])
    in_order = phase_profile(problem, everything)
    # links made one after another: (a, b), (b, c), (c, d); at the step itself only d is left
    assert in_order[step] == max(inherited + 30 + 40, problem.base[step] + 40)
    assert phase_peak(problem, everything) < max(stepwise)


def test_a_recomputed_tuple_counts_its_items_once():
    """t is a tuple whose bytes are its items p1 and p2; z's backward (step 5) reads p2, p1's
    (step 7) reads p1. Recomputing t, p1 and p2 makes t and its items at step 5."""
    problem = build([Op("x", 8, 50), Op("t", 12, 5, ("x",), can_save=False), Op("p1", 4, 0, ("t",), ("p1",)),
                     Op("p2", 8, 0, ("t",)), Op("z", 4, 4, ("p2",), ("p2",))], params=PARAMS)
    problem = replace(problem, multi_output=(False, True, False, False, False))
    decision = frozenset({1, 2, 3})
    assert is_valid(problem, decision) and problem.need_first[3] == 5 and problem.need_first[2] == 7
    stepwise, in_order = memory_profile(problem, decision), phase_profile(problem, decision)
    base = problem.base
    assert stepwise[5] == base[5] + 8 + 12 + 8  # x, the tuple, p2
    assert stepwise[7] == base[7] + 12 + 4  # the tuple again, until p1 is taken at step 7
    assert in_order[5] == base[5] + 8 + 4 + 8  # x and the tuple's two items, once
    # the tuple holds p2 until p1 is taken from it at step 7 (the rewritten graph takes each item
    # just before its first reader), so both items live to step 7, once each
    assert in_order[6] == base[6] + 4 + 8 and in_order[7] == base[7] + 4 + 8


@pytest.mark.parametrize("seed", range(40))
def test_never_above_the_step_model_and_equal_without_recompute(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(3, 12))
    eager = eager_decision(problem)
    assert phase_profile(problem, frozenset()) == memory_profile(problem, frozenset())
    assert all(a <= b for a, b in zip(phase_profile(problem, eager), memory_profile(problem, eager)))
    for _ in range(5):
        decision = repair(problem, {i for i in range(problem.num_values)
                                    if problem.can_recompute[i] and rng.random() < 0.5})
        if not is_valid(problem, decision):
            continue
        stepwise, in_order = memory_profile(problem, decision), phase_profile(problem, decision)
        assert all(a <= b for a, b in zip(in_order, stepwise))
        backward_reads = [sum(problem.size[v] for v in range(problem.num_values)
                              if problem.needed[v] and problem.need_first[v] <= t <= problem.need_last[v])
                          for t in range(problem.num_steps)]
        assert all(b + r <= x for b, r, x in zip(problem.base, backward_reads, in_order))
