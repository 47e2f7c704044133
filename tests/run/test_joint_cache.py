"""fxmem.run.joint_cache: a step planned again reuses its joint graph, and only where tracing would give the same
graph; the plan from a reused joint is the plan from tracing again, and the joint kept is never rewritten."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.run import joint_cache
from fxmem.run.engine import model_state, planned_graph
from fxmem.planner.planner import PlanRequest


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Dropout(0.1), torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 8)

    def features(self, x):
        return self.fc3(torch.tanh(self.fc2(self.drop(torch.tanh(self.fc1(x))))))

    def forward(self, x):
        return self.features(x).square().mean()


def _counts(plan_it):
    """(traced, reused) by `plan_it()`."""
    before = dict(joint_cache.stats)
    plan_it()
    return tuple(joint_cache.stats[k] - before.get(k, 0) for k in ("traced", "reused"))


def _same(a, b) -> bool:
    """Equal plans, but for the time the solvers took."""
    a, b = ({k: v for k, v in plan.to_dict().items() if k != "solve_time_s"} for plan in (a, b))
    assert a == b, [(k, a[k], b[k]) for k in a if a[k] != b[k]]
    return True


@pytest.fixture
def net():
    joint_cache.clear()
    torch.manual_seed(0)
    return Net(), (torch.randn(512, 64),)


def test_replanning_reuses_the_joint_and_plans_as_a_fresh_trace(net):
    model, x = net
    eager = fxmem.plan(model, x)
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, x, 1e-6, time_limit_s=1)
    budget = (refused.value.min_budget_bytes + eager.baseline_peak_bytes) / 2 / 2**30
    assert _counts(lambda: fxmem.plan(model, x, budget)) == (0, 1)
    assert _counts(lambda: fxmem.plan(model, x)) == (0, 1)
    again = fxmem.plan(model, x, budget)
    assert _counts(lambda: fxmem.plan(copy.deepcopy(model), x, budget)) == (0, 1)  # a copy traces as the model does
    assert _same(fxmem.plan(model, x), eager)  # the passes of the budgeted plans rewrote copies only
    joint_cache.clear()
    fresh = fxmem.plan(model, x, budget)
    assert again.recompute and _same(again, fresh)


def test_a_step_planned_on_a_kept_joint_trains_as_eager(net):
    """The step compiled while tracing (its planner inside AOTAutograd's partition) and the one planned on
    the joint kept (compiled at its first call, applying that plan) plan and train alike."""
    model, x = net
    eager = fxmem.plan(model, x)
    joint_cache.clear()
    request = PlanRequest(budget_bytes=int(0.9 * eager.baseline_peak_bytes), model=eager.model,
                          signature=eager.signature, loss=eager.loss)
    made = []
    assert _counts(lambda: made.append(planned_graph(model, x, {}, request))) == (1, 0)  # traced, compiled, kept
    assert _counts(lambda: made.append(planned_graph(model, x, {}, request))) == (0, 1)  # planned on the joint kept
    (plan, traced), (again, kept) = made
    assert plan.recompute and _same(again, plan)
    state, grads = dict(model_state(model)), []
    for step in (traced, kept, None):  # None: eager
        torch.manual_seed(1)
        loss = model(*x) if step is None else step(state, x, {})
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    assert all(torch.equal(a, c) and torch.equal(b, c) for a, b, c in zip(*grads))
    assert kept.plans == [again] and traced.plans == [plan]


class Features(Net):
    def forward(self, x):
        return self.features(x)


@pytest.mark.parametrize("change", ["shape", "dtype", "requires_grad", "eval", "dropout_p", "loss_fn", "autocast"])
def test_what_changes_the_trace_traces_again(net, change):
    model, (x,) = net
    args, kwargs = (x,), {}
    if change == "loss_fn":
        model = Features()
        kwargs = {"loss_fn": lambda out, y: (out - y).abs().mean(), "example_target": torch.zeros(512, 8)}
    fxmem.plan(model, args, **kwargs)
    assert _counts(lambda: fxmem.plan(model, args, **kwargs)) == (0, 1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=change == "autocast")
    if change == "shape":
        args = (x[:256],)
    elif change == "dtype":
        model.double()
        args = (x.double(),)
    elif change == "requires_grad":
        model.fc1.weight.requires_grad_(False)
    elif change == "eval":
        model.eval()
    elif change == "dropout_p":  # a leaf module's setting: not in the captured code
        model.drop.p = 0.0
    elif change == "loss_fn":
        kwargs = {**kwargs, "loss_fn": lambda out, y: (out - y).square().mean()}

    def plan_it():
        with autocast:
            fxmem.plan(model, args, **kwargs)

    assert _counts(plan_it) == (1, 0), change


def test_joints_are_bounded(net, monkeypatch):
    monkeypatch.setattr(joint_cache, "MAX_JOINTS", 2)
    model, (x,) = net
    for batch in (128, 256, 384):
        fxmem.plan(model, (x[:batch],))
    assert len(joint_cache._JOINTS) == 2
    assert _counts(lambda: fxmem.plan(model, (x[:384],))) == (0, 1)
    assert _counts(lambda: fxmem.plan(model, (x[:128],))) == (1, 0)  # the least recently used went
