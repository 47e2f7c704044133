"""Training loops as people write them, without `loss_fn`: `model(ids, labels=ids).loss.backward()` is
planned from the model's own loss (other outputs detached, no zero gradient for the logits), trains
exactly like eager, and its least budget is at most the model's own gradient checkpointing's measured
peak; a model whose loss is outside the plan warns once."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxmem
import fxmem.planner.planner
from fxmem.errors import InfeasibleBudgetError
from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.trace.loss import OUTSIDE, classify
from fxmem.trace.step import find_boundary, planned_step
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB


def _gpt2(n_layer=2, vocab=1024, tokens=(2, 128), **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=vocab, n_positions=tokens[1],
                                     use_cache=False, **kw)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, vocab, tokens)


def _labels_step(model, ids, seed=7):
    """How transformers trains: the output's loss, backward; the output held until backward ends."""
    torch.manual_seed(seed)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out


def _assert_same_training(reference, model, optimized, ids, steps=3):
    """Same loss, logits, gradients (and which are None) and parameters over `steps` AdamW steps."""
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        expected, got = _labels_step(reference, ids, seed=i), _labels_step(optimized, ids, seed=i)
        assert torch.equal(got.loss, expected.loss)
        assert not got.logits.requires_grad and torch.equal(got.logits, expected.logits)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_labels_without_loss_fn_trains_like_eager_from_the_models_own_loss():
    model, ids = _gpt2(resid_pdrop=0.1, attn_pdrop=0.0)
    reference = copy.deepcopy(model)
    eager = measure_peak_bytes(copy.deepcopy(model), (ids,), {"labels": ids})
    optimized = fxmem.optimize(model, budget_gb=0.6 * eager / GIB, time_limit_s=1)
    _assert_same_training(reference, model, optimized, ids)
    assert "the model's `loss` output" in optimized.plan.loss and "loss" in optimized.plan.table()
    assert optimized.plan.recompute  # the budget made it recompute, and the step still equals eager's


def test_model_loss_false_keeps_a_gradient_on_every_output():
    model, ids = _gpt2()
    optimized = fxmem.optimize(model, budget_gb=1.0, model_loss=False)
    out = optimized(ids, labels=ids)
    assert out.logits.requires_grad and "model_loss=False" in optimized.plan.loss


def test_keep_outputs_false_returns_the_loss_alone():
    model, ids = _gpt2()
    optimized = fxmem.optimize(model, budget_gb=1.0, keep_outputs=False)
    out = optimized(ids, labels=ids)
    assert out.logits is None and out.loss.requires_grad


def test_a_refused_budget_names_the_least_without_held_outputs_and_the_next_call_meets_it(monkeypatch):
    """The returned logits hold the floor of a `labels=` step: with `keep_outputs=True` the refusal names
    `keep_outputs=False`; by default it names the least without them, and the next call meets it in either loop,
    the outputs beside the loss not returned (a warning says so)."""
    model, ids = _gpt2(n_layer=1, vocab=4096, tokens=(2, 64))  # one block, 64 tokens: the logits still dwarf the rest
    with pytest.raises(InfeasibleBudgetError, match="keep_outputs=False drops them") as kept:
        fxmem.optimize(copy.deepcopy(model), budget_gb=1e-6, time_limit_s=1, keep_outputs=True)(ids, labels=ids)
    with pytest.raises(InfeasibleBudgetError, match="outputs beside the loss are not returned") as dropped:
        fxmem.optimize(copy.deepcopy(model), budget_gb=1e-6, time_limit_s=1)(ids, labels=ids)
    least = dropped.value.min_budget_bytes
    assert least < kept.value.min_budget_bytes
    assert not getattr(dropped.value, "bound_only", False)  # a least searched for, never a bound
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=least / GIB, time_limit_s=1)
    searched = []  # the held step is refused at its lower bound: only the dropped one is searched
    fit = fxmem.planner.planner.Planner._fit
    monkeypatch.setattr(fxmem.planner.planner.Planner, "_fit",
                        lambda self, *a, **k: searched.append(self.request.refuse_at_bound) or fit(self, *a, **k))
    with pytest.warns(UserWarning, match="what holding them needs"):
        assert measure_peak_bytes(optimized, (ids,), {"labels": ids}, warmup=False) <= least
    assert True not in searched
    logits = []

    def dropping(module, args, kwargs):
        out = module(*args, **kwargs)
        logits.append(out.logits)
        loss = out.loss
        del out
        loss.backward()

    assert measure_peak_bytes(optimized, (ids,), {"labels": ids}, step=dropping, warmup=False) <= least
    assert logits == [None]


def test_least_budget_is_at_most_the_models_own_checkpointing_peak():
    """Both measured the way transformers' examples train (the output held until backward ends)."""
    model, ids = _gpt2(n_layer=2, vocab=2048, tokens=(4, 128))
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    own_checkpointing = measure_peak_bytes(checkpointed, (ids,), {"labels": ids})
    with pytest.raises(InfeasibleBudgetError) as refused:
        fxmem.plan(model, (ids,), example_kwargs={"labels": ids}, budget_gb=0.01, time_limit_s=2)
    least = refused.value.min_budget_bytes
    assert least <= own_checkpointing
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=least / GIB, time_limit_s=2)
    assert measure_peak_bytes(optimized, (ids,), {"labels": ids}) <= least


def test_a_loss_outside_the_plan_warns_once_naming_loss_fn():
    from fxmem import models

    model = models.from_name("gpt-tiny")
    x, _ = models.example_inputs("gpt-tiny")
    optimized = fxmem.optimize(model, budget_gb=1.0)
    with pytest.warns(UserWarning, match=r"loss_fn=.* MiB|loss_fn=.*KiB|KiB .*loss_fn=|MiB .*loss_fn="):
        optimized(x).sum().backward()
    assert optimized.plan.loss.startswith(OUTSIDE) and "loss" in optimized.plan.table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxmem.plan(model, (x[:1],), budget_gb=1.0)  # the same model: warned once already


def test_a_model_that_returns_its_loss_does_not_warn():
    from fxmem import models

    model = models.from_name("gpt-tiny")
    x, y = models.example_inputs("gpt-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = fxmem.plan(model, (x, y), budget_gb=1.0)
    assert plan.loss == "the model's output (in the plan)"


def test_classify_reads_dicts_dataclasses_and_tuples():
    loss = torch.ones((), requires_grad=True) * 2
    logits = torch.ones(4, 8, requires_grad=True) * 2
    assert classify({"loss": loss, "logits": logits}).kind == "field"
    assert classify({"loss": loss, "logits": logits}).other_bytes == logits.untyped_storage().nbytes()
    assert classify(loss).kind == "returned"
    assert classify((logits, loss)).kind == "outside"
    assert classify((logits, loss)).outside_bytes == 4 + 4 * 8 * 4
    assert classify({"loss": loss.detach(), "logits": logits}).kind == "outside"


def test_find_boundary_runs_nothing_real():
    model, ids = _gpt2()
    before = [p.clone() for p in model.parameters()]
    assert find_boundary(model, (ids,), {"labels": ids}).kind == "field"
    assert find_boundary(model, (ids,), {}).kind == "outside"
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(model.parameters(), before))


class _DictLoss(torch.nn.Module):
    """A loss beside large logits, in a dict; counts its forward calls."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.calls = torch.nn.Linear(32, 64), torch.nn.Linear(64, 512), 0

    def forward(self, x, y):
        self.calls += 1
        logits = self.head(torch.relu(self.body(x)))
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


@pytest.mark.parametrize("keep_outputs", [True, False])
def test_the_loss_and_eagers_peak_come_from_one_fake_step(keep_outputs):
    torch.manual_seed(0)
    model, x, y = _DictLoss(), torch.randn(64, 32), torch.randint(0, 512, (64,))
    step = planned_step(model, (x,), {"y": y}, keep_outputs=keep_outputs)
    assert step.eager_peak() is not None and model.calls == 1, "one forward on fakes gives both"
    assert "detached" in step.loss if keep_outputs else "not returned" in step.loss
    peak = step.eager_peak()
    assert model.calls == 1 and all(p.grad is None for p in model.parameters())
    assert peak == eager_peak_bytes(step.module, (x,), {"y": y}), "the peak of the step as planned"
    real = measure_peak_bytes(copy.deepcopy(step.module), (x,), {"y": y}, warmup=False)
    assert abs(peak - real) <= 0.01 * real, (peak, real)
