"""Repeated layers: detection, windows, and the layered solver against the exact one.

Synthetic transformer-like stacks need no torch; one test plans a small zoo GPT on fake tensors
to check that detection finds its blocks."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fxmem.solve.problem import eager_decision, is_feasible, is_valid, memory_profile, recompute_cost, repair
from fxmem.solve.recompute import SOLVERS, solve, solve_cpsat
from fxmem.solve.recompute.exact import exact_min_peak, solve_exact
from fxmem.solve.recompute.layered import layer_options, solve_layered
from fxmem.solve.recompute.layers import find_layers, window
from tests.solve.test_solve import Op, build, eager_peak, random_problem


def stack(layers: int, width: int = 4) -> "MemoryProblem":  # noqa: F821
    """An embedding, `layers` transformer-like blocks (norm, qkv, scores, softmax, a random mask,
    attention out, residual, norm, up, gelu, down, residual) and a head with its loss."""
    w = width
    ops = [Op("emb", w, 30)]
    x = "emb"
    for k in range(layers):
        n = lambda s: f"{s}{k}"  # noqa: E731
        ops += [Op(n("ln"), w, 6, (x,), (x,)), Op(n("qkv"), 3 * w, 90, (n("ln"),), (n("ln"),)),
                Op(n("q"), 0, 0, (n("qkv"),), can_save=False, alias=True),
                Op(n("s"), 2 * w, 40, (n("q"),), (n("q"),)),
                Op(n("p"), 2 * w, 8, (n("s"),), (n("s"),)),
                Op(n("drop"), 2 * w, 5, (n("p"),), can_recompute=False),
                Op(n("att"), w, 40, (n("drop"), n("q")), (n("drop"), n("q"))),
                Op(n("o"), w, 60, (n("att"),), (n("att"),)), Op(n("r"), w, 2, (x, n("o"))),
                Op(n("ln2"), w, 6, (n("r"),), (n("r"),)), Op(n("up"), 4 * w, 120, (n("ln2"),), (n("ln2"),)),
                Op(n("g"), 4 * w, 10, (n("up"),), (n("up"),)), Op(n("dn"), w, 120, (n("g"),), (n("g"),)),
                Op(n("x"), w, 2, (n("r"), n("dn")))]
        x = n("x")
    ops += [Op("lnf", w, 6, (x,), (x,)), Op("head", 8 * w, 100, ("lnf",), ("lnf",)),
            Op("loss", 1, 20, ("head",), ("head",))]
    return build(ops, params=10 * w)


def _budgets(problem, fractions=(0.9, 0.7, 0.5, 0.3)):
    low, high = exact_min_peak(problem, 20.0)[0], eager_peak(problem)
    return [int(low + (high - low) * f) for f in fractions]


def test_finds_the_blocks_of_a_stack():
    for count in (2, 3, 6):
        p = stack(count)
        layers = find_layers(p)
        assert layers is not None and (layers.count, layers.length) == (count, 14)
        assert p.names[layers.layer(0).start] == "ln0"
        assert [p.names[v] for v in layers.layer(count - 1)][-1] == f"x{count - 1}"


def test_no_layers_in_random_problems():
    rng = random.Random(3)
    assert all(find_layers(random_problem(rng, 14)) is None for _ in range(10))


def test_window_peak_is_the_whole_problem_peak():
    """Any decision inside a window, with the rest fixed (values the window reads from outside
    kept, not recomputed), has the same memory profile in the window as in the whole problem."""
    p, rng = stack(4), random.Random(5)
    layers = find_layers(p)
    checked = 0
    for _ in range(60):
        context = repair(p, {v for v in range(p.num_values) if p.can_recompute[v] and rng.random() < 0.3})
        k = rng.randrange(layers.count)
        own = set(layers.layer(k))
        win = window(p, layers.layer(k), context)
        if any(v in context for v in win.members if v not in own):
            continue
        inside = repair(win.problem, {i for i, v in enumerate(win.members)
                                      if v in own and win.problem.can_recompute[i] and rng.random() < 0.5})
        whole = (context - own) | {win.members[i] for i in inside}
        if not is_valid(p, whole) or inside != repair(win.problem, inside):
            continue
        assert memory_profile(win.problem, inside) == memory_profile(p, whole)
        checked += 1
    assert checked >= 10


def test_layer_options_are_a_pareto_front():
    p = stack(3)
    layers = find_layers(p)
    last = layers.layer(2)
    options = layer_options(window(p, last, eager_decision(p)), last.start, float("inf"))
    assert len(options) >= 3 and options[0].cost == 0
    for a, b in zip(options, options[1:]):
        assert b.kept < a.kept and b.cost > a.cost


@pytest.mark.parametrize("count", [3, 4])
def test_layered_is_feasible_and_close_to_exact(count):
    p = stack(count)
    total_exact = total_layered = 0
    for budget in _budgets(p):
        q = replace(p, budget=budget)
        exact, layered = solve_exact(q, 30.0), solve_layered(q, 10.0)
        assert exact.status == "optimal" and layered is not None
        assert is_feasible(q, layered.recompute) and layered.peak <= budget
        assert layered.objective == recompute_cost(q, layered.recompute) >= exact.objective
        total_exact += exact.objective
        total_layered += layered.objective
    assert total_layered <= 1.10 * total_exact


def test_layered_is_registered_and_falls_back_without_layers():
    rng = random.Random(11)
    p = random_problem(rng, 12)
    p = replace(p, budget=eager_peak(p))
    assert "layered" in SOLVERS and solve_layered(p) is None
    sol = solve(p, "layered", 5.0)
    assert sol.solver == "layered" and sol.status == solve_cpsat(p, 5.0).status
    tight = replace(stack(3), budget=1)
    assert solve_layered(tight) is None and solve(tight, "layered", 2.0).status == "infeasible"
    eager_fits = replace(stack(3), budget=eager_peak(stack(3)))
    assert solve(eager_fits, "layered").objective == 0


def test_detects_the_blocks_of_a_zoo_gpt():
    torch = pytest.importorskip("torch")
    import fxmem.planner.planner as planner
    from fxmem import models
    from fxmem.api import plan

    seen = {}
    original = planner.build_problem

    def spy(joint, split, costs, budget, *rest, **kw):
        lowered = original(joint, split, costs, budget, *rest, **kw)
        seen["problem"], seen["costs"], seen["nodes"] = lowered.problem, costs, lowered.nodes
        return lowered

    planner.build_problem = spy
    try:
        torch.manual_seed(0)
        plan(models.from_name("gpt-tiny", n_layer=3), models.example_inputs("gpt-tiny", 2, n_layer=3))
    finally:
        planner.build_problem = original
    p, costs = seen["problem"], seen["costs"]
    layers = find_layers(p)
    assert layers is not None and layers.count == 3
    for k in range(3):
        paths = {costs[p.names[v]].module for v in layers.layer(k)} - {""}
        assert paths and all(path.startswith(f"blocks.{k}") for path in paths), paths
    rest = [v for v in range(p.num_values) if not layers.start <= v < layers.start + 3 * layers.length]
    assert not any(costs[p.names[v]].module.startswith("blocks.") for v in rest)


def test_auto_picks_a_route_and_refuses_bad_input():
    small = replace(stack(3), budget=(eager_peak(stack(3)) * 3) // 4)
    sol = solve(small, "auto", 10.0)
    assert sol.solver in ("exact", "greedy", "layered") and is_feasible(small, sol.recompute)
    assert sol.objective == solve_exact(small, 10.0).objective  # small and proven within the limit
    with pytest.raises(ValueError, match="positive"):
        solve(replace(small, budget=0), "auto")
    with pytest.raises(ValueError, match="auto"):
        solve(small, "magic")
