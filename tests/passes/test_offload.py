"""Offload: the copy model (torch-free), the three-way solvers against brute force, the pass, and
plans that train exactly like eager on CPU (copies become host copies)."""
from __future__ import annotations

import copy
from dataclasses import replace
from itertools import product

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.price.memory import simulate_step
from fxmem.passes.offload import copy_in, copy_out, wait_in
from fxmem.solve.problem import (copies_in, copies_out, decision_cost, eager_decision, enable_offload, is_feasible,
                           is_valid, memory_profile, peak_bytes, recompute_cost, transfer_schedule)
from fxmem.solve.recompute import min_peak, solve
from fxmem.passes.recompute import partition
from fxmem.planner.planner import Planner, PlanRequest
from tests.conftest import GIB, assert_trains_like, joint_of
from tests.solve.test_solve import chain, diamonds, mixed


def offloadable(problem, step=50, per_byte=10, latency=60, min_bytes=4):
    return enable_offload(problem, [step] * problem.num_steps, [latency + per_byte * s for s in problem.size],
                          min_bytes=min_bytes, overhead_ns=5)


def test_host_link_presets():
    h100 = fxmem.DeviceSpec.from_name("h100")
    assert h100.host_link.name == "pcie5" and h100.host_link.bytes_per_s > 0
    c2c = h100.with_link("nvlink-c2c")
    assert c2c.host_link.seconds(2**30) < h100.host_link.seconds(2**30) and c2c.flops_per_s == h100.flops_per_s
    with pytest.raises(KeyError, match="pcie4"):
        h100.with_link("usb2")


def test_copies_queue_on_one_stream():
    assert copies_out([0, 0, 10], [5, 5, 1]) == [5, 10, 11]  # the second waits for the first
    assert copies_out([0, 20], [5, 5]) == [5, 25]
    assert copies_in([10, 10], [4, 4]) == [2, 6]  # the later one ends first, the other before it starts
    assert copies_in([10, 30], [4, 4]) == [6, 26]


def test_transfer_schedule_shares_the_link():
    p = offloadable(chain(4))
    both = [i for i in range(p.num_values) if p.can_offload[i]][:2]
    assert len(both) == 2
    alone = {v: transfer_schedule(p, [v]) for v in both}
    together = transfer_schedule(p, both)
    later = max(both, key=lambda v: p.saved_from[v])
    # Queued behind the other copy, the later value leaves the device no earlier than alone.
    assert together.out_last[later] >= alone[later].out_last[later]
    assert all(together.in_first[v] > together.out_last[v] for v in both)


def test_offload_candidates_exclude_views_unsaveable_and_tiny():
    p = offloadable(mixed())
    for i in range(p.num_values):
        if p.aliases[i] or not p.can_save[i] or p.size[i] < 4:
            assert not p.can_offload[i], p.names[i]
    # Random ops cannot be recomputed but may be offloaded.
    d = p.names.index("d")
    assert not p.can_recompute[d]
    big = offloadable(mixed(), min_bytes=10**9)
    assert not any(big.can_offload)


def test_offload_lowers_the_profile_only_between_its_copies():
    p = offloadable(chain(3))
    rec = eager_decision(p)
    v = next(i for i in range(p.num_values) if p.can_offload[i])
    base, off = memory_profile(p, rec), memory_profile(p, rec, [v])
    moves = transfer_schedule(p, [v])
    changed = [t for t, (a, b) in enumerate(zip(base, off)) if a != b]
    assert changed and all(moves.out_last[v] < t < moves.in_first[v] for t in changed)
    assert all(base[t] - off[t] == p.size[v] for t in changed)
    assert memory_profile(p, rec, ()) == base


def _brute(problem):
    """Least decision_cost over all (R, O), or None."""
    n = problem.num_values
    offs = [i for i in range(n) if problem.offloadable(i)]
    best = None
    for rmask in range(1 << n):
        rec = frozenset(i for i in range(n) if rmask >> i & 1)
        if not is_valid(problem, rec):
            continue
        for picks in product((False, True), repeat=len(offs)):
            off = frozenset(v for v, on in zip(offs, picks) if on)
            if is_feasible(problem, rec, off):
                cost = decision_cost(problem, rec, off)
                best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("make", [lambda: chain(3), lambda: diamonds(2), mixed], ids=["chain", "diamonds", "mixed"])
def test_cpsat_matches_brute_force_with_offload(make):
    p = offloadable(make())
    eager = peak_bytes(p, eager_decision(p))
    for budget in range(eager, eager // 2, -4):
        q = replace(p, budget=budget)
        expected = _brute(q)
        got = solve(q, "cpsat", 2.0)
        if expected is None:
            assert got.status == "infeasible"
            continue
        assert got.status == "optimal" and got.objective == expected, budget
        assert is_feasible(q, got.recompute, got.offloaded)
        assert got.peak == peak_bytes(q, got.recompute, got.offloaded) <= budget
        plain = solve(replace(q, can_offload=()), "cpsat", 2.0)
        if plain.fits:
            assert got.objective <= plain.objective  # offload never makes a plan slower
        greedy = solve(q, "greedy", 1.0)
        assert greedy.fits == is_feasible(q, greedy.recompute, greedy.offloaded)


def test_offload_fits_budgets_recompute_cannot():
    p = offloadable(mixed())
    no_offload = replace(p, can_offload=())
    lowest_plain, _ = min_peak(no_offload, 2.0)
    assert _brute(replace(no_offload, budget=lowest_plain - 1)) is None
    got = solve(replace(p, budget=lowest_plain - 1), "cpsat", 2.0)
    assert got.fits and got.offloaded
    assert recompute_cost(p, got.recompute) <= got.objective


# ---- planning and running on CPU ------------------------------------------------------------------

CFG = dict(in_features=256, hidden=(512, 512, 512), dropout=0.1)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = models.from_name("mlp-small", **CFG)
    inputs = models.example_inputs("mlp-small", 1024, **CFG)
    eager = fxmem.plan(model, inputs)
    return model, inputs, eager


def test_offload_plan_trains_like_eager_on_cpu(mlp):
    model, inputs, eager = mlp
    budget = eager.baseline_peak_bytes * 0.7
    with pytest.raises(fxmem.InfeasibleBudgetError):
        fxmem.plan(model, inputs, budget_gb=budget / GIB, time_limit_s=2)
    plan = fxmem.plan(model, inputs, budget_gb=budget / GIB, offload=True, target="cpu", time_limit_s=2)
    assert plan.offload and plan.predicted_peak_bytes <= budget
    rows = {r.name: r for r in plan.nodes}
    assert all(rows[n].decision == "offload" and rows[n].bytes >= 2**20 for n in plan.offload)
    assert plan.offloaded_bytes >= 2**20 * len(plan.offload)
    assert plan.predicted_step_s >= plan.baseline_step_s + plan.exposed_transfer_s - 1e-12
    assert "offloaded to host" in plan.table()
    again = fxmem.Plan.from_json(plan.to_json())
    assert again.offload == plan.offload
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, plan=again)
    for _ in range(2):  # twice: the second step reuses the compiled graphs
        assert_trains_like(reference, optimized, inputs)


def test_offload_never_predicted_slower_than_recompute_only(mlp):
    model, inputs, eager = mlp
    budget = eager.baseline_peak_bytes * 0.85 / GIB
    with_offload = fxmem.plan(model, inputs, budget_gb=budget, offload=True, target="cpu", time_limit_s=2)
    plain = fxmem.plan(model, inputs, budget_gb=budget, device="cpu", time_limit_s=2)
    assert with_offload.predicted_step_s <= plain.predicted_step_s
    # Planning for a device this machine lacks: the h100 preset and its PCIe Gen5 link (its eager
    # peak and least hold the cuBLAS workspaces too: a budget half way between them).
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, inputs, budget_gb=1e-6, target="h100", time_limit_s=2)
    h100_eager = fxmem.plan(model, inputs, target="h100").baseline_peak_bytes
    budget = (refused.value.min_budget_bytes + h100_eager) / 2 / GIB
    h100 = fxmem.plan(model, inputs, budget_gb=budget, offload=True, target=fxmem.DeviceSpec.from_name("h100"),
                      time_limit_s=2)
    h100_plain = fxmem.plan(model, inputs, budget_gb=budget, target="h100", time_limit_s=2)
    assert h100.device == "h100" and h100.predicted_step_s <= h100_plain.predicted_step_s


def test_pass_moves_saved_values_to_host_and_back(mlp):
    model, inputs, eager = mlp
    joint, num_fwd_outputs = joint_of(model, inputs[0])
    request = PlanRequest(budget_bytes=int(eager.baseline_peak_bytes * 0.7), offload=True)
    planner = Planner(request)
    fw, bw = planner(joint, None, num_fwd_outputs=num_fwd_outputs)
    plan = planner.plan
    assert plan.offload
    outs = list(fw.graph.output_node().args[0])
    copies = {n.args[0].name: n for n in fw.graph.nodes if n.target is copy_out}
    assert set(copies) == set(plan.offload)
    for name, host in copies.items():
        assert host in outs and not any(getattr(o, "name", None) == name for o in outs)
        assert host.meta["fxmem"]["host"]
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for p in bw.graph.find_nodes(op="placeholder"):
        if p.name in plan.offload:
            (fetch,) = p.users
            assert fetch.target is copy_in
            (ready,) = fetch.users
            assert ready.target is wait_in and order[fetch] <= order[ready] < min(order[u] for u in ready.users)
    # The simulator sees the offloaded values leave the device: without the copies the peak is higher.
    assert simulate_step(fw, bw, num_fwd_outputs).peak == plan.predicted_peak_bytes
    kept_fw, kept_bw = partition(joint, plan.saved, num_fwd_outputs=num_fwd_outputs)
    assert simulate_step(kept_fw, kept_bw, num_fwd_outputs).peak > plan.predicted_peak_bytes


def test_copy_functions_are_host_copies_on_cpu():
    t = torch.randn(4, 3)
    host = copy_out(t)
    assert host.device.type == "cpu" and host.data_ptr() != t.data_ptr() and torch.equal(host, t)
    back = wait_in(copy_in(host, "cpu"))
    assert back.data_ptr() != host.data_ptr() and torch.equal(back, t)


def test_offload_without_host_link_is_refused(mlp):
    model, inputs, eager = mlp
    bare = replace(fxmem.DeviceSpec.from_name("h100"), host_link=None)
    with pytest.raises(ValueError, match="host link"):
        fxmem.plan(model, inputs, budget_gb=1.0, offload=True, target=bare)


WIDE = dict(in_features=2048, hidden=(2048, 2048, 2048), dropout=0.1)


def _offload_plan_for_h100():
    """A plan that offloads on the h100 preset (with an NVLink-C2C host link), at a budget taken from fxmem's
    own figures for that device: a quarter of the way from the least it names (recompute alone, the cuBLAS
    workspaces included) to the eager peak. The layers are wide, so a copy to the host hides behind their
    matmuls and costs less than recomputing one."""
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-small", **WIDE), models.example_inputs("mlp-small", 1024, **WIDE)
    target = fxmem.DeviceSpec.from_name("h100").with_link("nvlink-c2c")
    eager = fxmem.plan(model, inputs, target=target).baseline_peak_bytes
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, inputs, budget_gb=1e-6, target=target, time_limit_s=2)
    least = refused.value.min_budget_bytes
    assert least < eager, (least, eager)
    budget = least + (eager - least) // 4
    plan = fxmem.plan(model, inputs, budget_gb=budget / GIB, offload=True, target=target, time_limit_s=2)
    assert plan.offload and plan.predicted_peak_bytes <= budget
    return model, inputs, plan


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: side streams and pinned host memory")
def test_offload_on_cuda_trains_like_eager_and_lowers_the_peak():
    model, inputs, plan = _offload_plan_for_h100()
    cuda_model, cuda_inputs = copy.deepcopy(model).cuda(), [x.cuda() for x in inputs]
    reference = copy.deepcopy(cuda_model)
    optimized = fxmem.optimize(cuda_model, plan=plan)
    assert_trains_like(reference, optimized, cuda_inputs, atol=1e-5, rtol=1e-5)
    from fxmem.measure import measure_peak_bytes

    assert measure_peak_bytes(optimized, cuda_inputs) < measure_peak_bytes(reference, cuda_inputs)
