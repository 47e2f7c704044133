"""Gradients in host memory, chosen by the planner (passes/host_gradients.py, fxmem.planner.host_state): a small
transformers GPT-2 whose step fits its budget only with its optimizer state and its gradients on the host.

The backward graph hands each host gradient to HostOptimizer and frees it; on the CPU the host buffers are
written outside the dispatch stack, so MemTracker (fxmem.measure) counts what a GPU's allocator would: the
device's memory, not the pinned host buffers. Dropout is off so that eager and fxmem see the same numbers.
"""
import dataclasses
import os

import pytest
import torch

import fxmem
from fxmem.measure import measure_peak_bytes
from fxmem.planner.host_state import ALL_HOST, ALL_HOST_GRADS, MOST_DEVICE_GRADS
from fxmem.planner.plan import Plan

transformers = pytest.importorskip("transformers")
os.environ.setdefault("FXMEM_HOST_UPDATE_GBPS", "0.25")  # the same host rate in every run: the same choices

LIMIT_S = 1  # what the tests check holds of any plan the solver finds


def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def tokens(seed: int) -> dict:
    x = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(seed))  # few tokens: weights dominate
    return dict(input_ids=x, labels=x)


def plan_at(budget_bytes: int) -> Plan:
    return fxmem.plan(model(), (), budget_bytes / 2**30, example_kwargs=tokens(0), optimizer="adamw", offload=True,
                      time_limit_s=LIMIT_S)


@pytest.fixture(scope="module")
def only_host_gradients():
    """A budget between the least with the state and gradients on the host and the least with the state alone
    there (gradients on the device), and its plan."""
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        plan_at(2**16)
    least = refused.value.min_budget_bytes  # the least with everything on the host
    at_least = plan_at(least)
    device_gradients = next(row for row in at_least.host_options if row["mix"] == ALL_HOST)
    assert device_gradients["step_s"] is None  # refused there, naming its least
    budget = (least + device_gradients["least_bytes"]) // 2
    return budget, plan_at(budget)


def test_a_budget_only_host_gradients_meet_is_planned_with_them(only_host_gradients):
    budget, plan = only_host_gradients
    params = dict(model().named_parameters())
    grads = sum(p.numel() * p.element_size() for p in params.values())
    moved = sum(params[name].numel() * params[name].element_size() for name in plan.host_gradients)
    assert plan.predicted_peak_bytes <= budget
    assert plan.host_gradients and set(plan.host_gradients) == set(plan.host_parameters)
    assert plan.host_gradient_bytes == moved and plan.breakdown["gradients"] == grads - moved
    chosen = next(row for row in plan.host_options if row["chosen"])
    assert chosen["mix"] in (ALL_HOST_GRADS, MOST_DEVICE_GRADS) and chosen["host_gradient_bytes"] == moved
    fitting = [row for row in plan.host_options if row["step_s"] is not None]
    assert chosen["step_s"] == min(row["step_s"] for row in fitting)  # the fastest mix that fits
    refused = next(row for row in plan.host_options if row["mix"] == ALL_HOST)
    assert refused["step_s"] is None and refused["least_bytes"] > budget
    assert "gradients on the host" in plan.table() and "moved to the host inside backward" in plan.table()
    assert "to_host" not in plan.fallback_ops  # the copies are priced as copies, not as an op of the graph
    assert Plan.from_json(plan.to_json()) == plan


def optimized(budget: int, plan: Plan | None = None, lr: float = 1e-2):
    trained = model()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=lr)
    if plan is not None:
        return trained, fxmem.optimize(trained, plan=plan, optimizer=optimizer)
    return trained, fxmem.optimize(trained, budget_gb=budget / 2**30, optimizer=optimizer, offload=True,
                                   time_limit_s=LIMIT_S)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_trains_as_eager_adamw(only_host_gradients, micro_batches, caplog):
    """3 steps (of 2 accumulated micro-batches: added into the host buffers), clipped by norm, a scheduler:
    bit for bit torch.optim.AdamW's parameters; backward leaves no device gradient for the host part."""
    budget, _ = only_host_gradients
    reference = model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    trained, step = optimized(budget)
    opt = step.fxmem_optimizer
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (ref_opt, opt)]
    for i in range(3):
        for j in range(micro_batches):
            reference(**tokens(10 * i + j)).loss.backward()
            step(**tokens(10 * i + j)).loss.backward()
            named = dict(trained.named_parameters())
            host = {named[name] for name in step.plan.host_gradients}
            assert host and all(p.grad is None for p in host) and opt._sunk == host  # the host holds them
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.clip_grad_norm_(0.5)  # sees the host copies (torch's function sees only .grad, None for these)
        for o, scheduler in zip((ref_opt, opt), schedulers):
            o.step()
            o.zero_grad()
            scheduler.step()
    assert step.plan.host_gradients
    said = [r.getMessage() for r in caplog.records if "live on the host" in r.getMessage()]
    assert len(said) == 1 and "clip_grad_norm_" in said[0]  # once, naming the clipping that sees them
    for (name, a), b in zip(reference.named_parameters(), trained.parameters()):
        assert torch.equal(a, b), name
    state = opt.state_dict()  # torch's format: a torch AdamW loads it, and it loads theirs
    ref_opt.load_state_dict(state)
    opt.load_state_dict(ref_opt.state_dict())
    hosted, by_reference = opt.host_parameters[0], dict(zip(trained.parameters(), reference.parameters()))
    assert opt.state[hosted]["exp_avg"].device.type == "cpu"  # read straight into host memory
    assert torch.equal(opt.state[hosted]["exp_avg"], ref_opt.state[by_reference[hosted]]["exp_avg"])


def test_measured_peak_within_budget_and_below_device_gradients(only_host_gradients):
    """MemTracker's peak of the planned step, its first call (which plans) included, is within the budget, and
    below the same plan's with every gradient returned by backward on the device."""
    budget, plan = only_host_gradients
    _, step = optimized(budget)
    first = measure_peak_bytes(step, (), tokens(1), warmup=False)
    later = measure_peak_bytes(step, (), tokens(2))
    assert first <= budget and later <= budget
    on_device = dataclasses.replace(plan, host_gradients=(), host_gradient_bytes=0)
    _, device_step = optimized(budget, on_device)
    assert measure_peak_bytes(device_step, (), tokens(2)) > later


def test_a_saved_plan_moves_the_gradients_it_names(only_host_gradients, tmp_path):
    _, plan = only_host_gradients
    plan.save(tmp_path / "plan.json")
    reference = model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    trained, step = optimized(0, Plan.load(tmp_path / "plan.json"))
    step(**tokens(3)).loss.backward()
    reference(**tokens(3)).loss.backward()
    opt = step.fxmem_optimizer
    named = dict(trained.named_parameters())
    assert opt._sunk == {named[name] for name in plan.host_gradients}
    opt.step()
    ref_opt.step()
    for (name, a), b in zip(reference.named_parameters(), trained.parameters()):
        assert torch.equal(a, b), name
