"""Stage-boundary solver (torch-free): exact against brute force, memory respected, clear infeasibility."""
from __future__ import annotations

import itertools
import random

import pytest

from fxmem.errors import InfeasibleBudgetError
from fxmem.solve.stages import StageProblem, lower_bound_s, min_stage_memory, solve_stages


def random_problem(rng: random.Random, n: int, S: int, **kw) -> StageProblem:
    shared = ()
    if n >= 3 and rng.random() < 0.5:  # a tied parameter read by the first and the last unit
        shared = ((rng.randint(1, 50) * 1000, (0, n - 1)),)
    return StageProblem(
        names=tuple(f"u{i}" for i in range(n)),
        time_s=tuple(rng.uniform(0.1, 5.0) for _ in range(n)),
        param_bytes=tuple(rng.randint(0, 100) * 1000 for _ in range(n)),
        act_bytes=tuple(rng.randint(1, 60) * 1000 for _ in range(n)),
        cut_bytes=tuple(rng.randint(1, 40) * 1000 for _ in range(n - 1)),
        recompute_s=tuple(rng.uniform(0.05, 1.5) for _ in range(n)),
        ckpt_bytes=tuple(rng.randint(1, 10) * 1000 for _ in range(n)),
        shared=shared, num_stages=S, link_bytes_per_s=1e5, n_microbatches=rng.randint(1, 6),
        **kw)


def brute(p: StageProblem, key: str = "time"):
    """Every way to cut, every stage eager or checkpointed: least slowest stage under the budget
    (key="time") or least largest stage memory (key="memory")."""
    from fxmem.solve.stages import _Prefix

    pre, n, S = _Prefix(p), p.num_units, p.num_stages
    best = None
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = list(zip((0,) + cuts, tuple(c - 1 for c in cuts) + (n - 1,)))
        for mode in itertools.product((False, True), repeat=S):
            stages = [pre.stage(i, j, s, m) for s, ((i, j), m) in enumerate(zip(bounds, mode))]
            if key == "time":
                if p.budget_bytes is not None and any(st.memory_bytes > p.budget_bytes for st in stages):
                    continue
                value = max(st.time_s for st in stages)
            else:
                value = max(st.memory_bytes for st in stages)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_optimal_against_brute_force(schedule):
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        n, S = rng.randint(2, 7), rng.randint(1, 4)
        if S > n:
            continue
        p = random_problem(rng, n, S, schedule=schedule)
        least = brute(p, "memory")
        budget = int(least * rng.uniform(1.0, 1.6))
        p = StageProblem(**{**p.__dict__, "budget_bytes": budget})
        plan = solve_stages(p)
        assert plan.slowest_s == pytest.approx(brute(p, "time"), rel=1e-12)
        assert [st.first for st in plan.stages] == [0, *plan.cuts]
        assert plan.stages[-1].last == n - 1
        assert all(st.memory_bytes <= budget for st in plan.stages)
        assert plan.balance >= 1.0 - 1e-12
        checked += 1
    assert checked > 30


def test_unconstrained_balances_compute():
    p = StageProblem(names=tuple("abcdef"), time_s=(1, 1, 1, 1, 1, 5), param_bytes=(0,) * 6,
                     act_bytes=(1,) * 6, cut_bytes=(0,) * 5, num_stages=2)
    plan = solve_stages(p)
    assert plan.cuts == (5,)  # the heavy last unit alone
    assert plan.slowest_s == 5 and lower_bound_s(p) == 5 and plan.balance == 1.0


def test_in_flight_by_schedule():
    kw = dict(names=tuple("abcd"), time_s=(1.0,) * 4, param_bytes=(0,) * 4, act_bytes=(10,) * 4,
              cut_bytes=(0,) * 3, num_stages=4, n_microbatches=8)
    one_f_one_b = solve_stages(StageProblem(**kw, schedule="1f1b"))
    gpipe = solve_stages(StageProblem(**kw, schedule="gpipe"))
    assert [st.in_flight for st in one_f_one_b.stages] == [4, 3, 2, 1]
    assert [st.in_flight for st in gpipe.stages] == [8, 8, 8, 8]
    assert [st.memory_bytes for st in one_f_one_b.stages] == [40, 30, 20, 10]


def test_budget_moves_the_cut_and_checkpointing_rescues_a_stage():
    kw = dict(names=tuple("abcd"), time_s=(1.0, 1.0, 1.0, 1.0), param_bytes=(100, 0, 0, 0),
              act_bytes=(50, 50, 50, 50), cut_bytes=(0, 0, 0), num_stages=2, n_microbatches=2)
    free = solve_stages(StageProblem(**kw))
    assert free.cuts == (2,)
    # stage 0 holds 2 microbatches: units a,b cost 100*2 + 2*100 = 400 > 350; a alone 300 fits
    tight = solve_stages(StageProblem(**kw, budget_bytes=350))
    assert tight.cuts == (1,) and all(st.memory_bytes <= 350 for st in tight.stages)
    ckpt = solve_stages(StageProblem(**kw, budget_bytes=350, recompute_s=(0.25,) * 4, ckpt_bytes=(5,) * 4))
    assert ckpt.cuts == (2,) and ckpt.stages[0].checkpoint and ckpt.slowest_s == 2.5


def test_infeasible_names_the_least_per_stage_budget():
    rng = random.Random(3)
    p = random_problem(rng, 5, 2)
    least = brute(p, "memory")
    assert max(st.memory_bytes for st in min_stage_memory(p).stages) == least
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_stages(StageProblem(**{**p.__dict__, "budget_bytes": least - 1}))
    assert info.value.min_budget_bytes == least
    assert "least per-stage budget" in str(info.value) and "raise budget_gb" in str(info.value)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="at most 2 stages"):
        StageProblem(names=("a", "b"), time_s=(1, 1), param_bytes=(0, 0), act_bytes=(0, 0),
                     cut_bytes=(0,), num_stages=3)
    with pytest.raises(ValueError, match="schedule"):
        StageProblem(names=("a",), time_s=(1,), param_bytes=(0,), act_bytes=(0,), cut_bytes=(),
                     num_stages=1, schedule="zb")


def test_solver_imports_no_torch():
    import ast
    import fxmem.solve.stages as module

    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names and not any(n.split(".")[0] in ("torch", "ortools") for n in names)
