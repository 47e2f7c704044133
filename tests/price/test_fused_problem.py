"""Problems whose recomputed pointwise values Inductor fuses into their readers (`MemoryProblem.fused`):
such a value holds no bytes while recomputed and keeps its inputs alive as long as it lives. The solvers
agree with brute force on them, and the joint graph marks the values its readers fuse.
Reads nothing from disk; problems come from tests.solve.test_solve."""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from fxmem.solve.problem import NEVER, MemoryProblem, is_feasible, lifetimes, memory_profile, peak_bytes, violations
from fxmem.solve.recompute import solve_brute, solve_cpsat, solve_greedy
from fxmem.solve.recompute.brute import brute_min_peak
from fxmem.solve.recompute.exact import solve_exact
from fxmem.solve.recompute.layers import window
from fxmem.solve.recompute.phases import phase_peak
from tests.solve.test_solve import eager_peak, random_problem


def _matmul_then_gelu(fused: bool) -> MemoryProblem:
    """m (a matmul, 8 bytes, costly) then g = gelu(m) (8 bytes, free to recompute); backward reads g at
    step 4 and m at step 5 (steps 0-1 forward)."""
    return MemoryProblem(names=("m", "g"), size=(8, 8), cost=(100, 0), inputs=((), (0,)), aliases=(False, False),
                         needed=(True, True), can_save=(True, True), can_recompute=(True, True),
                         saved_from=(1, 2), need_first=(5, 4), need_last=(5, 4), base=(1,) * 6, budget=100,
                         fused=(False, fused))


def test_a_fused_recomputed_value_holds_no_bytes_and_keeps_its_input():
    unfused, fused = _matmul_then_gelu(False), _matmul_then_gelu(True)
    # saved: both held from forward to their reads, whether or not Inductor would fuse g
    assert memory_profile(fused, ()) == memory_profile(unfused, ()) == [1, 9, 17, 17, 17, 9]
    # recomputed unfused: g made at step 4 beside m; fused: g is computed inside its reader, m alone
    assert memory_profile(unfused, {1}) == [1, 9, 9, 9, 17, 9]
    assert memory_profile(fused, {1}) == [1, 9, 9, 9, 9, 9]
    assert peak_bytes(fused, {1}) < peak_bytes(unfused, {1})


def test_inputs_of_a_fused_value_live_until_its_last_read():
    """m read by g only (not by backward itself): recomputing g keeps m until g's read, as for a view."""
    base = _matmul_then_gelu(True)
    p = replace(base, needed=(False, True), need_first=(NEVER, 4), need_last=(NEVER, 4))
    assert lifetimes(p, {1})[0] == (1, 4)
    g_later = replace(p, need_last=(NEVER, 5))
    assert lifetimes(g_later, {1})[0] == (1, 5)  # fused: m stays while g is read
    assert lifetimes(replace(g_later, fused=(False, False)), {1})[0] == (1, 4)  # made at 4: m may go


def _with_fused(problem: MemoryProblem, rng: random.Random) -> MemoryProblem:
    return replace(problem, fused=tuple(rng.random() < 0.5 for _ in problem.names))


def test_solvers_match_brute_force_on_fused_problems():
    rng = random.Random(2026)
    statuses = set()
    for _ in range(20):
        problem = _with_fused(random_problem(rng, rng.randint(4, 11)), rng)
        lowest = brute_min_peak(problem)
        low = lowest[0] if lowest else eager_peak(problem)
        p = replace(problem, budget=max(1, rng.randint(low - 2, eager_peak(problem) + 2)))
        brute, cpsat, exact, greedy = solve_brute(p), solve_cpsat(p, 5.0), solve_exact(p, 10.0), solve_greedy(p)
        statuses.add(brute.status)
        assert cpsat.status == exact.status == brute.status, (brute, cpsat, exact)
        assert lowest is None or not violations(p, greedy.recompute)
        if greedy.fits:
            assert is_feasible(p, greedy.recompute) and greedy.objective >= brute.objective
        if brute.status == "optimal":
            assert cpsat.objective == exact.objective == brute.objective
            assert is_feasible(p, cpsat.recompute) and is_feasible(p, exact.recompute)
            assert phase_peak(p, brute.recompute) <= peak_bytes(p, brute.recompute)
    assert statuses == {"optimal", "infeasible"}


def test_a_window_keeps_the_whole_problems_profile_on_fused_problems():
    """As `tests.solve.test_layers` checks unfused: values the window reads from outside kept, not recomputed."""
    rng, checked = random.Random(5), 0
    for _ in range(200):
        problem = _with_fused(random_problem(rng, 10), rng)
        rec = frozenset(v for v in range(10) if problem.can_recompute[v] and rng.random() < 0.4)
        win = window(problem, range(3, 7), rec)
        if violations(problem, rec) or any(v in rec for v in win.members if v not in win.own):
            continue
        inside = frozenset(k for k, v in enumerate(win.members) if v in rec)
        assert memory_profile(win.problem, inside) == memory_profile(problem, rec)
        checked += any(win.problem.inlined(k) for k in inside)
    assert checked >= 5  # windows that recompute a fused value


def test_the_joint_graph_marks_what_its_readers_fuse():
    """sigmoid, read by a mul (pointwise), fuses when recomputed; gelu, read by a matmul, needs a buffer."""
    from fxmem.price.cost import estimate
    from fxmem.price.joint_problem import build_problem, split_joint
    from tests.conftest import joint_of

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.a(x))
            return (self.b(h) * torch.sigmoid(h)).sum()

    joint, num_fwd = joint_of(Net(), torch.randn(4, 16))
    split = split_joint(joint, num_fwd)
    costs = estimate(joint, backward=set(split.backward), fused=True)
    fused = build_problem(joint, split, costs, 1, fused=True).problem
    plain = build_problem(joint, split, costs, 1).problem
    marked = {name for name, f in zip(fused.names, fused.fused) if f}
    assert not any(plain.fused)
    assert "sigmoid" in marked  # read by mul and its backward's pointwise ops
    assert "gelu" not in marked  # read by the second linear's matmul (its weight's gradient)
