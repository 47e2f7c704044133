"""Optimizer state on the host as the planner's decision (fxmem.planner.host_state), on a small GPT-2.

The plan's device/host accounting is checked against MemTracker (torch.distributed._tools.mem_tracker)
on a fake device: the model's parameters on the meta device stand for the GPU, the host part's copies
are real host (CPU) fake tensors, so MemTracker's per-device view tells the two apart.
"""
import copy
import os

import pytest
import torch

import fxmem
from fxmem.planner.plan import Plan

transformers = pytest.importorskip("transformers")
os.environ.setdefault("FXMEM_HOST_UPDATE_GBPS", "0.25")  # the same host rate in every run: the same choices


def config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config())


# what the tests check holds of any plan the solver finds, not of the best: a short search each
LIMIT_S = 1
X = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
KW = dict(input_ids=X, labels=X)


def least(**options) -> int:
    state = fxmem.plan(model(), (), None, example_kwargs=KW, optimizer="adamw").optimizer_state_bytes
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:  # above the state alone, below any step
        fxmem.plan(model(), (), (state + 2**10) / 2**30, example_kwargs=KW, time_limit_s=LIMIT_S, **options)
    return refused.value.min_budget_bytes


@pytest.fixture(scope="module")
def leasts():
    """(least with the state on the device, least with it and the gradients on the host, least of the graphs
    alone)."""
    return least(optimizer="adamw"), least(optimizer="adamw", offload=True), least(offload=True)


@pytest.fixture(scope="module")
def between(leasts):
    """A budget the step fits only with (some of) its state on the host, and the plan for it."""
    on_device, on_host, _ = leasts
    budget = (on_device + on_host) / 2 / 2**30
    return budget, fxmem.plan(model(), (), budget, example_kwargs=KW, optimizer="adamw", offload=True,
                              time_limit_s=LIMIT_S)


def test_refusal_names_the_least_with_the_state_and_gradients_on_the_host(leasts):
    on_device, on_host, graphs_alone = leasts
    assert on_host < graphs_alone < on_device  # the graphs alone hold their gradients on the device


def test_a_budget_only_host_state_meets(between, leasts):
    budget, plan = between
    state = fxmem.plan(model(), (), None, example_kwargs=KW, optimizer="adamw").optimizer_state_bytes
    assert plan.predicted_peak_bytes <= budget * 2**30
    assert plan.host_parameters and plan.host_state_bytes > 0
    assert plan.optimizer_state_bytes + plan.host_state_bytes == state
    assert plan.breakdown.get("optimizer state", 0) == plan.optimizer_state_bytes
    assert plan.host_update_s > 0 and plan.predicted_step_s >= plan.host_update_s
    refused = [row for row in plan.host_options if row["step_s"] is None]
    assert refused and refused[0]["least_bytes"] == leasts[0]  # all on the device: refused, its least named
    assert sum(row["chosen"] for row in plan.host_options) == 1
    fitting = [row for row in plan.host_options if row["step_s"] is not None]
    chosen = next(row for row in fitting if row["chosen"])  # the fastest mix that fits, as the plan states it
    assert chosen["step_s"] == min(row["step_s"] for row in fitting) == pytest.approx(plan.predicted_step_s)
    assert chosen["device_state_bytes"] == plan.optimizer_state_bytes
    assert all(row["peak_bytes"] <= budget * 2**30 for row in fitting)
    assert "on the host" in plan.table()
    assert Plan.from_json(plan.to_json()) == plan


def test_state_stays_on_the_device_where_it_fits_at_no_cost(leasts):
    on_device = leasts[0]
    plan = fxmem.plan(model(), (), on_device * 4 / 2**30, example_kwargs=KW, optimizer="adamw", offload=True,
                      time_limit_s=LIMIT_S)
    assert not plan.host_parameters and plan.host_state_bytes == 0


def test_meter_sees_the_plans_device_and_host_state(between):
    """MemTracker's per-device view of a step with HostOptimizer placed as the plan says (fake tensors: the
    meta device as the GPU): the state on the device is the plan's, the rest is on the host."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from fxmem.run.host_optimizer import HostOptimizer

    _, plan = between
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("meta"):
            fake = transformers.GPT2LMHeadModel(config())
        params = dict(fake.named_parameters())
        opt = HostOptimizer(torch.optim.AdamW(fake.parameters(), lr=1e-3))
        opt.place([params[name] for name in plan.host_parameters])
        tracker = MemTracker()
        tracker.track_external(fake, opt)
        with tracker:
            x = torch.randint(0, 512, (2, 64), device="meta")
            fake(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        seen = tracker.get_tracker_snapshot("current")
    device, host = seen[torch.device("meta")], seen[torch.device("cpu")]
    hosted = [params[name] for name in plan.host_parameters]
    copies = sum(p.numel() * p.element_size() for p in hosted)  # the host's copies of their values
    counters = 4 * len(params)  # AdamW's step counters, on the host for every parameter
    assert device[_MemRefType.OPT] == plan.optimizer_state_bytes
    assert host[_MemRefType.OPT] - copies - counters == plan.host_state_bytes
    assert host[_MemRefType.PARAM] == 0 and device[_MemRefType.PARAM] == sum(
        p.numel() * p.element_size() for p in params.values())


def test_optimize_trains_as_eager_adamw(between):
    """fxmem.optimize with offload: the optimizer to step is the module's `fxmem_optimizer`; 3 steps give
    eager AdamW's parameters. `keep_outputs=True`: the step `between` planned (the outputs held), planned once; a
    loop seen dropping them would have the step without them planned again at the second call."""
    budget, plan = between
    reference = model()
    trained = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimized = fxmem.optimize(trained, budget_gb=budget, optimizer=torch.optim.AdamW(trained.parameters(), lr=1e-2),
                               offload=True, time_limit_s=LIMIT_S, keep_outputs=True)
    opt = optimized.fxmem_optimizer
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    for step in range(3):
        x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(step))
        for module, optimizer, scheduler in ((reference, ref_opt, ref_sched), (optimized, opt, sched)):
            module(input_ids=x, labels=x).loss.backward()
            if optimizer is opt:  # backward's hooks copied every host parameter's gradient out
                assert set(opt._copied) == set(opt.host_parameters)
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    assert optimized.plan.host_parameters and opt.host_parameters
    assert len(opt.host_parameters) == len(optimized.plan.host_parameters)
    for (name, a), b in zip(reference.named_parameters(), trained.parameters()):
        assert torch.equal(a, b), name


def test_a_saved_plan_places_the_state_where_it_was_planned(between, tmp_path):
    _, plan = between
    path = tmp_path / "plan.json"
    plan.save(path)
    trained = model()
    with pytest.raises(ValueError, match="pass optimizer="):
        fxmem.optimize(trained, plan=fxmem.Plan.load(path))
    optimized = fxmem.optimize(trained, plan=fxmem.Plan.load(path),
                               optimizer=torch.optim.AdamW(trained.parameters(), lr=1e-2))
    optimized(input_ids=X, labels=X).loss.backward()
    opt = optimized.fxmem_optimizer
    named = dict(trained.named_parameters())
    assert set(opt.host_parameters) == {named[name] for name in plan.host_parameters}
    opt.step()


def test_another_optimizer_is_planned_on_the_device_with_one_line(caplog):
    from fxmem import models

    net, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 16)
    with caplog.at_level("WARNING", logger="fxmem"):
        plan = fxmem.plan(net, inputs, 1.0, optimizer="sgd-momentum", offload=True)
    said = [r.getMessage() for r in caplog.records if "stays on the device" in r.getMessage()]
    assert len(said) == 1 and "sgd-momentum" in said[0] and "adamw" in said[0]
    parameters = sum(p.numel() * p.element_size() for p in net.parameters())
    assert plan.optimizer_state_bytes == parameters and plan.host_state_bytes == 0 and not plan.host_options
