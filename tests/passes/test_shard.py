"""Pipeline stages: the shard pass, stage planning, and 2 processes (gloo, 127.0.0.1) that train like one."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.nn.functional as F

import fxmem
from fxmem import models
from fxmem.dist.pipeline import baseline_cuts, problem_from_plan, stage_modules
from fxmem.solve.stages import evaluate

M = 4  # microbatches per step


def gpt(**overrides):
    torch.manual_seed(0)
    return models.from_name("gpt-tiny", dropout=0.0, **overrides)


def mlp():
    torch.manual_seed(0)
    return models.from_name("mlp-tiny", dropout=0.0)


def test_stage_modules_chain_to_the_model_with_its_own_parameters():
    model = gpt()
    idx, targets = models.example_inputs("gpt-tiny", 2)
    plan = fxmem.plan(model, (idx, targets), num_stages=3, n_microbatches=M)
    plan = fxmem.Plan.from_json(plan.to_json())
    assert len(plan.pipeline.stages) == 3 and plan.pipeline.balance >= 1.0
    stages = stage_modules(model, plan)
    own: dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        own.setdefault(id(p), set()).add(name)
    out = (idx, targets)
    for k, stage in enumerate(stages):
        names = stage.meta["fxmem"]["param_names"]
        for name, p in stage.named_parameters(remove_duplicate=False):
            assert name in own[id(p)] and names[name] == name  # the model's tensors, under their own names
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    torch.testing.assert_close(out, model(idx, targets), rtol=0, atol=0)
    assert "wte.weight" in plan.pipeline.shared_parameters  # tied with lm_head, read by first and last
    assert set(plan.pipeline.stages[0].parameters) & set(plan.pipeline.stages[-1].parameters) == {"wte.weight"}
    table = plan.table()
    assert "stage" in table and "blocks.0" in table
    with pytest.raises(fxmem.PlanMismatchError, match="another graph"):
        stage_modules(gpt(n_layer=3), plan)
    old = json.loads(plan.to_json())  # a plan file written before pipeline stages existed still loads
    old["schema_version"] = 1
    del old["pipeline"]
    assert fxmem.Plan.from_json(json.dumps(old)).pipeline is None


def test_uneven_model_balances_better_than_equal_layers():
    # a large vocabulary makes the head several blocks' worth of work
    model = gpt(vocab_size=4096, n_layer=4)
    batch = models.example_inputs("gpt-tiny", 2, vocab_size=4096)
    for S in (2,):
        plan = fxmem.plan(model, batch, num_stages=S, n_microbatches=M)
        problem = problem_from_plan(plan)
        uniform = evaluate(problem, baseline_cuts(plan, "uniform"))
        assert plan.pipeline.balance == pytest.approx(plan.pipeline.slowest_s / plan.pipeline.lower_bound_s)
        assert plan.pipeline.slowest_s < uniform.slowest_s * 0.95, (S, plan.pipeline.balance, uniform.balance)
        assert plan.pipeline.slowest_s <= evaluate(problem, baseline_cuts(plan, "parameters")).slowest_s


def test_stage_budget_is_respected_and_infeasible_is_clear():
    model = mlp()
    x, _ = models.example_inputs("mlp-tiny", 4)
    free = fxmem.plan(model, (x,), num_stages=2, n_microbatches=M, schedule="gpipe")
    budget = max(s.predicted_peak_bytes for s in free.pipeline.stages)
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (x,), budget_gb=2000 / 2**30, num_stages=2, n_microbatches=M, schedule="gpipe")
    assert "least per-stage budget" in str(info.value) and info.value.min_budget_bytes > 2000
    fits = fxmem.plan(model, (x,), budget_gb=budget / 2**30, num_stages=2, n_microbatches=M, schedule="gpipe")
    assert all(s.predicted_peak_bytes <= budget for s in fits.pipeline.stages)


def test_refusal_names_a_least_that_planning_at_it_meets():
    model = mlp()
    x, _ = models.example_inputs("mlp-tiny", 64)
    free = fxmem.plan(model, (x,), num_stages=2, n_microbatches=M, schedule="gpipe")
    low = int(0.3 * max(s.predicted_peak_bytes for s in free.pipeline.stages))
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (x,), budget_gb=low / 2**30, num_stages=2, n_microbatches=M, schedule="gpipe")
    least = info.value.min_budget_bytes
    assert least > low and "every stage fits" in str(info.value), info.value
    met = fxmem.plan(model, (x,), budget_gb=least / 2**30, num_stages=2, n_microbatches=M, schedule="gpipe")
    assert all(s.predicted_peak_bytes <= least for s in met.pipeline.stages)


def test_refusal_names_no_figure_it_does_not_have():
    from types import SimpleNamespace
    from fxmem.dist.pipeline import _planner_infeasible
    problem = SimpleNamespace(num_stages=2)
    unknown = str(_planner_infeasible(problem, 2**30, []))
    assert "needs more than that" in unknown and "at least" not in unknown
    known = _planner_infeasible(problem, 2**30, [3 * 2**30, 2 * 2**30])
    assert "need at least 2.00 GiB" in str(known) and "at least 2.000" in str(known)
    assert not known.proven  # the least the stages' searches found: no proof that less cannot work


def test_integer_tensors_between_stages_are_refused_where_torch_cannot_receive_them(monkeypatch):
    model = gpt()
    idx, targets = models.example_inputs("gpt-tiny", 2)
    plan = fxmem.plan(model, (idx, targets), num_stages=2, n_microbatches=1)
    monkeypatch.setattr(fxmem.dist.pipeline, "_receives_only_gradients", lambda: True)  # as torch 2.11's PipelineStage
    with pytest.raises(fxmem.FxmemError, match=r"stage 1 receives integer tensors \(.*\).*torch 2.13 or later"):
        fxmem.pipeline_stage(model, plan, 1, "cpu")


# ---- two processes -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_case(rank, model, batch, loss_fn, target, schedule_cls, plan):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    if schedule_cls is ScheduleInterleaved1F1B:  # stages k and k+2 on rank k
        stage = [fxmem.pipeline_stage(model, plan, k, torch.device("cpu")) for k in (rank, rank + 2)]
    else:
        stage = fxmem.pipeline_stage(model, plan, rank, torch.device("cpu"))
    for p in model.parameters():
        p.grad = None
    schedule = schedule_cls(stage, n_microbatches=M, loss_fn=loss_fn)
    losses: list = []
    if rank == 0:
        schedule.step(*batch)
    else:
        schedule.step(target=target, losses=losses, return_outputs=False)
    fxmem.dist.pipeline.sync_shared_grads(stage)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": [float(x.detach()) for x in losses], "grads": grads}


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        results = {}
        model = gpt()
        idx, targets = models.example_inputs("gpt-tiny", 8)
        plan = fxmem.plan(model, (idx[:2], targets[:2]), num_stages=2, n_microbatches=M)
        plans = [None, None]
        # every rank solves for itself: the split (and everything it was solved from) must be identical
        dist.all_gather_object(plans, json.dumps(dataclasses.asdict(plan.pipeline), sort_keys=True))
        results["same_plan"] = plans[0] == plans[1]
        results["gpt-gpipe"] = _run_case(rank, model, (idx, targets), fxmem.dist.pipeline.output_is_loss, targets,
                                         ScheduleGPipe, plan)
        # a budget only recompute inside a stage meets: planned once on rank 0 and broadcast (CP-SAT
        # under a time limit need not find the same recompute set in every process)
        tight = [None]
        if rank == 0:
            peak = max(s.predicted_peak_bytes for s in plan.pipeline.stages)
            tight = [fxmem.plan(model, (idx[:2], targets[:2]), budget_gb=0.9 * peak / 2**30, num_stages=2,
                                n_microbatches=M, solver="greedy").to_json()]
        dist.broadcast_object_list(tight, src=0)
        tight = fxmem.Plan.from_json(tight[0])
        results["recompute"] = [bool(s.plan and s.plan["recompute"]) for s in tight.pipeline.stages]
        results["gpt-1f1b"] = _run_case(rank, model, (idx, targets), fxmem.dist.pipeline.output_is_loss, targets,
                                        Schedule1F1B, tight)
        four = fxmem.plan(model, (idx[:2], targets[:2]), num_stages=4, n_microbatches=M)
        results["gpt-interleaved"] = _run_case(rank, model, (idx, targets), fxmem.dist.pipeline.output_is_loss, targets,
                                               ScheduleInterleaved1F1B, four)
        model = mlp()
        x, y = models.example_inputs("mlp-tiny", 8)
        plan = fxmem.plan(model, (x[:2],), num_stages=2, n_microbatches=M, schedule="gpipe")
        results["mlp-gpipe"] = _run_case(rank, model, (x,), F.cross_entropy, y, ScheduleGPipe, plan)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference(model, inputs, loss_fn=None, target=None):
    model = copy.deepcopy(model)
    out = model(*inputs)
    loss = out if loss_fn is None else loss_fn(out, target)
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    out_dir = str(tmp_path_factory.mktemp("pipeline"))
    try:
        mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=2, join=True)
    except (OSError, RuntimeError) as exc:
        if "Address" in str(exc) or "spawn" in str(exc).lower() and "process" not in str(exc).lower():
            pytest.skip(f"cannot start 2 local processes on 127.0.0.1: {exc}")
        raise
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def _check(results, case, ref_loss, ref_grads):
    first, last = results[0][case], results[1][case]
    assert len(last["losses"]) == M
    assert sum(last["losses"]) / M == pytest.approx(ref_loss, rel=1e-5)
    grads = {**first["grads"], **last["grads"]}
    assert set(grads) == set(ref_grads), set(ref_grads) ^ set(grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    for name in set(first["grads"]) & set(last["grads"]):  # tied parameters: both ranks hold the sum
        torch.testing.assert_close(first["grads"][name], last["grads"][name], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["gpt-gpipe", "gpt-1f1b", "gpt-interleaved"])
def test_two_processes_train_like_one(two_process_results, case):
    assert two_process_results[0]["same_plan"] and two_process_results[1]["same_plan"]
    if case == "gpt-1f1b":  # this run recomputes inside a stage (fxmem.optimize under PipelineStage)
        assert any(two_process_results[0]["recompute"])
    idx, targets = models.example_inputs("gpt-tiny", 8)
    loss, grads = _reference(gpt(), (idx, targets))
    _check(two_process_results, case, loss, grads)


def test_two_processes_loss_in_the_schedule(two_process_results):
    x, y = models.example_inputs("mlp-tiny", 8)
    loss, grads = _reference(mlp(), (x,), F.cross_entropy, y)
    _check(two_process_results, "mlp-gpipe", loss, grads)
