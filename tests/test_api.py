"""fxmem.plan / fxmem.optimize (fxmem/api.py) on the zoo: budgets met as measured by MemTracker, training exact."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB, assert_trains_like, step

TINY = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "unet-tiny"]
# Batch sizes that put activations well above the planner's safety margin (64 KiB).
BATCH = {"mlp-tiny": 1024}


def _setup(name):
    torch.manual_seed(0)
    return models.from_name(name), models.example_inputs(name, BATCH.get(name))


def _min_budget(model, inputs) -> int:
    """The least budget found, a reference point for the budgets below (the least search runs the
    solver to its time limit; the plans at those budgets get their own)."""
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, time_limit_s=1)
    return info.value.min_budget_bytes


@pytest.fixture(scope="module", params=TINY)
def zoo(request):
    model, inputs = _setup(request.param)
    eager = fxmem.plan(model, inputs)
    lowest = _min_budget(model, inputs)
    assert lowest < eager.baseline_peak_bytes, "recompute must be able to lower the peak"
    return request.param, model, inputs, eager, lowest, {}


def _at(zoo, fraction):
    """(budget, plan, measured peak) at `fraction` of the way from the least budget to the eager peak;
    made once per model and fraction, so the tests below share plans that assert different things."""
    name, model, inputs, eager, lowest, made = zoo
    if fraction not in made:
        budget = int(lowest + fraction * (eager.baseline_peak_bytes - lowest))
        plan = fxmem.plan(model, inputs, budget_gb=budget / GIB, time_limit_s=1)
        made[fraction] = budget, plan, measure_peak_bytes(fxmem.optimize(model, plan=plan), inputs)
    return made[fraction]


def test_eager_plan_predicts_measured_peak(zoo):
    name, model, inputs, eager, _, _ = zoo
    measured = measure_peak_bytes(fxmem.optimize(model, plan=eager), inputs)
    assert abs(eager.predicted_peak_bytes - measured) <= 0.05 * measured
    assert eager.recompute == () and eager.extra_flops == 0


@pytest.mark.parametrize("fraction", [0.7, 0.3])
def test_budget_met_and_training_exact(zoo, fraction):
    name, model, inputs = zoo[:3]
    budget, plan, measured = _at(zoo, fraction)
    assert plan.predicted_peak_bytes <= budget
    assert plan.recompute, "a budget below the eager peak must recompute something"
    reference = copy.deepcopy(model)
    assert_trains_like(reference, fxmem.optimize(model, plan=plan), inputs, ordered=True)
    assert measured <= budget, f"{name}: measured {measured} > budget {budget}"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured


def test_lower_budget_never_raises_measured_peak(zoo):
    peaks = [_at(zoo, fraction)[2] for fraction in (1.0, 0.7, 0.3, 0.0)]
    assert peaks == sorted(peaks, reverse=True), peaks


def test_optimize_plans_lazily_and_per_signature():
    model, inputs = _setup("gpt-tiny")
    eager = fxmem.plan(model, inputs)
    budget = 0.8 * eager.baseline_peak_bytes / GIB
    optimized = fxmem.optimize(model, budget_gb=budget, time_limit_s=1)
    assert optimized.plans == []
    step(optimized, inputs)
    step(optimized, inputs)
    assert len(optimized.plans) == 1 and optimized.plans[0].predicted_peak_bytes <= budget * GIB
    smaller = models.example_inputs("gpt-tiny", batch_size=4)
    step(optimized, smaller)
    assert len(optimized.plans) == 2


def test_optimized_module_shares_the_models_state():
    model, inputs = _setup("resnet-tiny")
    optimized = fxmem.optimize(model, budget_gb=1.0)
    assert list(optimized.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(optimized.parameters(), model.parameters()))
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(2):
        for module, optimizer in ((optimized, opt), (reference, ref_opt)):
            step(module, inputs)
            optimizer.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    optimized.eval()
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(optimized(inputs[0]), reference.eval()(inputs[0]))


def test_library_model_from_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (4, 32))
    kwargs = {"labels": ids, "use_cache": False}
    eager = fxmem.plan(model, (ids,), example_kwargs=kwargs)
    lowest = _min_budget_kwargs(model, ids, kwargs)
    # one budget: the zoo's tests above cover two fractions; this one is about a library model's kwargs
    budget = int(lowest + 0.3 * (eager.baseline_peak_bytes - lowest))
    plan = fxmem.plan(model, (ids,), budget_gb=budget / GIB, example_kwargs=kwargs, time_limit_s=1)
    assert plan.recompute, "a budget below the eager peak must recompute something"
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, plan=plan)
    assert_trains_like(reference, optimized, (ids,), kwargs)
    measured = measure_peak_bytes(optimized, (ids,), kwargs)
    assert measured <= budget
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured


def _min_budget_kwargs(model, ids, kwargs) -> int:
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (ids,), budget_gb=1e-6, example_kwargs=kwargs, time_limit_s=1)
    return info.value.min_budget_bytes


class InPlace(torch.nn.Module):
    """In-place activations, an in-place add into a view, and a buffer updated in forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)
        self.act = torch.nn.ReLU(inplace=True)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, targets):
        h = self.act(self.a(x)).clone()
        h[:, :8].mul_(2.0)
        h = torch.nn.functional.gelu(h)
        h.add_(1.0)
        self.steps.add_(1)
        return torch.nn.functional.mse_loss(self.b(h), targets)


def test_inplace_ops_and_views_train_exactly():
    torch.manual_seed(0)
    model, inputs = InPlace(), (torch.randn(256, 32), torch.randn(256, 32))
    eager = fxmem.plan(model, inputs)
    lowest = _min_budget(model, inputs)
    plan = fxmem.plan(model, inputs, budget_gb=(lowest + eager.baseline_peak_bytes) / 2 / GIB, time_limit_s=1)
    reference = copy.deepcopy(model)
    assert_trains_like(reference, fxmem.optimize(model, plan=plan), inputs)
    assert model.steps.item() == reference.steps.item() == 1


def test_budget_at_the_eager_peak_is_met_by_the_eager_step():
    """A budget equal to the step's eager peak is never refused for the planner's safety margin: the
    step as PyTorch runs it fits (a single Linear has nothing to recompute)."""
    from fxmem.trace.step_module import LossStep

    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(256, 256), torch.randn(64, 256), torch.randn(64, 256)
    mse = torch.nn.functional.mse_loss
    eager = measure_peak_bytes(LossStep(copy.deepcopy(model), mse), (x,), {"target": y})
    plan = fxmem.plan(model, (x,), budget_gb=eager / GIB, loss_fn=mse, example_target=y)
    assert plan.predicted_peak_bytes <= eager and not plan.recompute
    optimized = fxmem.optimize(model, plan=plan, loss_fn=mse)
    assert measure_peak_bytes(optimized, (x,), {"target": y}) <= eager


def _mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _decided(plan) -> dict:
    """A plan's JSON less the seconds its solver took."""
    import json

    data = json.loads(plan.to_json())
    data.pop("solve_time_s", None)
    return data


def _regression():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model, (torch.randn(256, 32),), torch.randn(256, 8)


def test_grouped_options_plan_what_their_keywords_plan():
    """`loss=fxmem.Loss(...)`, `pipeline=fxmem.Pipeline(...)` and `solver=fxmem.Solver(...)` stand for the
    keywords users already write: the same plan either way."""
    model, inputs, target = _regression()
    spelled = fxmem.plan(model, inputs, 1.0, loss_fn=_mse, example_target=target, time_limit_s=2, solver="greedy")
    grouped = fxmem.plan(model, inputs, 1.0, loss=fxmem.Loss(_mse, target=target),
                         solver=fxmem.Solver("greedy", time_limit_s=2))
    assert _decided(grouped) == _decided(spelled)
    gpt, ids = _setup("gpt-tiny")
    staged = fxmem.plan(gpt, ids, num_stages=2, n_microbatches=2, time_limit_s=2)
    grouped = fxmem.plan(gpt, ids, pipeline=fxmem.Pipeline(2, n_microbatches=2), solver=fxmem.Solver(time_limit_s=2))
    assert grouped.pipeline.stages == staged.pipeline.stages and grouped.pipeline.num_stages == 2


def test_grouped_options_train_as_their_keywords_do():
    model, inputs, target = _regression()
    ref = copy.deepcopy(model)
    opt = fxmem.optimize(model, budget_gb=1.0, loss=fxmem.Loss(_mse), solver=fxmem.Solver(time_limit_s=2))
    opt(*inputs, target=target).backward()
    _mse(ref(*inputs), target).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("call, error, text", [
    (lambda m, x: fxmem.plan(m, x, 1.0, loss=fxmem.Loss(_mse), loss_fn=_mse), ValueError,
     "pass loss=fxmem.Loss(...) or loss_fn=, not both"),
    (lambda m, x: fxmem.plan(m, x, 1.0, solver=fxmem.Solver(time_limit_s=1), time_limit_s=2), ValueError,
     "pass solver=fxmem.Solver(...) or time_limit_s=, not both"),
    (lambda m, x: fxmem.plan(m, x, pipeline=fxmem.Pipeline(2), num_stages=3), ValueError,
     "pass pipeline=fxmem.Pipeline(...) or num_stages=, not both"),
    (lambda m, x: fxmem.plan(m, x, 1.0, loss=_mse), TypeError, "loss= takes an fxmem.Loss(...), got function"),
    (lambda m, x: fxmem.plan(m, x, 1.0, budget=1.0), TypeError, "plan() got an unexpected keyword argument 'budget'"),
    (lambda m, x: fxmem.optimize(m, budget_gb=1.0, loss=fxmem.Loss(_mse, target=1)), ValueError,
     "fxmem.optimize takes the loss's target at each call"),
    (lambda m, x: fxmem.optimize(m, budget_gb=1.0, num_stages=2), TypeError,
     "optimize() got an unexpected keyword argument 'num_stages'"),
])
def test_a_group_and_its_own_keyword_are_refused_together(call, error, text):
    model, inputs, _ = _regression()
    with pytest.raises(error) as info:
        call(model, inputs)
    assert text in str(info.value)
