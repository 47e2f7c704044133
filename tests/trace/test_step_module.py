"""The user's loss in the plan (`loss_fn`): `opt(x, target=y)` trains exactly like
`loss_fn(model(x), y).backward()` in eager, the loss region is planned (measured peak within budget),
and outputs the loss does not read get no gradient."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxmem
import fxmem.planner.attention_chunks
from fxmem import models
from fxmem.measure import measure_peak_bytes
from fxmem.trace.step_module import LossStep
from tests.conftest import GIB


def _ce(out, target):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _eager_step(model, x, y, seed=1234):
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    loss = _ce(model(x), y)
    loss.backward()
    return loss


def _assert_same_step(reference, optimized, model, x, y):
    expected = _eager_step(reference, x, y)
    torch.manual_seed(1234)
    for p in model.parameters():
        p.grad = None
    loss = optimized(x, target=y)
    loss.backward()
    # bit-exact, unless the plan computes the loss or attention in chunks: then equal to float reassociation
    # (docs/floor.md)
    chunked = any(p.loss_chunks > 1 or p.attention_chunks > 1 for p in getattr(optimized, "plans", ()))
    tol = dict(atol=1e-6, rtol=1e-5) if chunked else dict(atol=0, rtol=0)
    torch.testing.assert_close(loss, expected, **tol)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, **tol, msg=lambda m: f"{name}: {m}")


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))


def _zoo_gpt():
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny")
    x, y = models.example_inputs("gpt-tiny")
    return model, x, y


# one budget per model, a loose one and a tight one, where each model ran both before: the same
# assertions, and between them the solver's budgets and those near the least
@pytest.mark.parametrize("build, fraction", [(_zoo_gpt, 0.6), (_hf_gpt2, 0.2)], ids=["gpt-tiny", "hf-gpt2"])
def test_loss_outside_trains_like_eager_within_budget(build, fraction):
    model, x, y = build()
    eager = fxmem.plan(model, (x,), loss_fn=_ce, example_target=y)
    assert "+ loss" in eager.model and "target=" in eager.signature
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (x,), budget_gb=1e-6, loss_fn=_ce, example_target=y, time_limit_s=1)
    lowest = info.value.min_budget_bytes
    budget = int(lowest + fraction * (eager.baseline_peak_bytes - lowest))
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=budget / GIB, loss_fn=_ce, time_limit_s=1)
    _assert_same_step(reference, optimized, model, x, y)
    measured = measure_peak_bytes(optimized, (x,), {"target": y})
    assert measured <= budget, f"measured {measured} > budget {budget}"
    (plan,) = optimized.plans
    assert plan.recompute, "a budget below the eager peak must recompute something"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured


def test_the_loss_region_is_in_the_budget_and_eager_budget_is_never_worse():
    """The loss's memory is part of the planned step; a budget at PyTorch eager's measured peak for the
    step (loss outside the model, as users write it) measures no more than eager."""
    model, x, y = _hf_gpt2()
    alone = fxmem.plan(model, (x,))
    with_loss = fxmem.plan(model, (x,), loss_fn=_ce, example_target=y)
    assert with_loss.baseline_peak_bytes > alone.baseline_peak_bytes
    eager = measure_peak_bytes(LossStep(copy.deepcopy(model), _ce), (x,), {"target": y})
    optimized = fxmem.optimize(model, budget_gb=eager / GIB, loss_fn=_ce)
    assert measure_peak_bytes(optimized, (x,), {"target": y}) <= eager


def test_unread_outputs_get_no_gradient():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertModel(config)
    ids = torch.randint(0, 128, (2, 16))
    target = torch.randn(2, 16, 32)

    def on_hidden(out, t):
        return F.mse_loss(out.last_hidden_state, t)

    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    on_hidden(reference(ids), target).backward()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=on_hidden)
    torch.manual_seed(1)
    optimized(ids, target=target).backward()
    ref = dict(reference.named_parameters())
    assert ref["pooler.dense.weight"].grad is None
    for name, p in model.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, msg=lambda m: f"{name}: {m}")


def test_keep_outputs_returns_them_and_bad_loss_is_clear():
    model, x, y = _zoo_gpt()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=_ce, keep_outputs=True)
    loss, logits = optimized(x, target=y)
    torch.testing.assert_close(loss, _ce(logits, y))
    assert loss.requires_grad and not logits.requires_grad  # kept to read, so backward gets no tangent for them
    with pytest.raises(ValueError, match="one element"):
        fxmem.optimize(copy.deepcopy(model), budget_gb=1.0, loss_fn=lambda out, t: out)(x, target=y)
    with pytest.raises(ValueError, match="goes with loss_fn"):
        fxmem.plan(model, (x,), example_target=y)


def test_loss_fn_over_two_devices_trains_like_eager():
    """With devices=[...] the loss runs (and is counted) on the device of the model's last unit."""
    model, x, y = _zoo_gpt()
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=1.0, devices=["cpu", "cpu"], loss_fn=_ce)
    _assert_same_step(reference, optimized, model, x, y)
    (plan,) = optimized.plans
    assert plan.model.endswith("+ loss")
    assert "lm_head" in plan.devices[-1].modules and len(plan.devices) == 2


class _TrainStep(torch.nn.Module):
    """The loss inside the compiled module, as a torch.compile user writes a training step."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, target):
        return _ce(self.model(x), target)


def test_compiled_training_step_plans_its_loss_within_budget():
    """torch.compile(backend="fxmem") of a step that computes the loss plans the loss region with the model."""
    model, x, y = _zoo_gpt()
    eager = measure_peak_bytes(_TrainStep(copy.deepcopy(model)), (x, y))
    budget = int(0.8 * eager)
    options = {"budget_gb": budget / GIB, "inner": "aot_eager", "time_limit_s": 1}
    compiled = torch.compile(_TrainStep(model), backend="fxmem", options=options)
    reference = copy.deepcopy(model)
    _assert_same_step(reference, lambda x, target: compiled(x, target), model, x, y)
    measured = measure_peak_bytes(compiled, (x, y))
    assert measured <= budget, f"measured {measured} > budget {budget}"
    (plan,) = fxmem.backend.plans_for(options)
    assert any("nll_loss" in row.name or "log_softmax" in row.name for row in plan.nodes)


def _hf_gpt2_labels():
    """The loss inside the model (`labels=`), as transformers trains: logits are a second output."""
    model, x, y = _hf_gpt2()
    return model, (x,), {"labels": y}, None


def _mistral_eager_attention():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                        attn_implementation="eager")
    model = transformers.MistralForCausalLM(config)
    return model, (torch.randint(0, 256, (4, 32)),), {}, torch.randint(0, 256, (4, 32))


# one budget per model (a loose one and a tight one), where each model ran both before
@pytest.mark.parametrize("build, fraction", [(_hf_gpt2_labels, 0.7), (_mistral_eager_attention, 0.3)],
                         ids=["gpt2-labels", "mistral-eager"])
def test_three_adamw_steps_bit_identical_within_budget(build, fraction, monkeypatch):
    """Loss inside the model or given as loss_fn: at a budget below eager, three AdamW steps give
    the same losses and parameters as eager bit for bit, and the measured peak stays within budget.
    Attention is planned as traced (chunked attention reassociates sums: tests/passes/test_chunked_attention.py)."""
    monkeypatch.setattr(fxmem.planner.attention_chunks, "attention_sites", lambda gm: [])
    model, args, kwargs, target = build()
    model.train()
    loss_fn = None if target is None else _ce
    extra = {} if target is None else {"target": target}
    plan_kwargs = {} if target is None else {"loss_fn": _ce, "example_target": target}
    eager = fxmem.plan(model, args, example_kwargs=kwargs, **plan_kwargs).baseline_peak_bytes
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, args, budget_gb=1e-6, example_kwargs=kwargs, time_limit_s=1, **plan_kwargs)
    lowest = info.value.min_budget_bytes
    budget = int(lowest + fraction * (eager - lowest))
    reference, trained = copy.deepcopy(model), copy.deepcopy(model)
    optimized = fxmem.optimize(trained, budget_gb=budget / GIB, time_limit_s=1,
                               **({} if loss_fn is None else {"loss_fn": loss_fn}))
    ref_opt, opt = torch.optim.AdamW(reference.parameters()), torch.optim.AdamW(trained.parameters())
    for k in range(3):
        torch.manual_seed(k)
        expected = reference(*args, **kwargs).loss if target is None else _ce(reference(*args), target)
        expected.backward()
        torch.manual_seed(k)
        out = optimized(*args, **kwargs, **extra)
        loss = out.loss if target is None else out
        loss.backward()
        torch.testing.assert_close(loss, expected, atol=0, rtol=0)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for (name, p), q in zip(trained.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    measured = measure_peak_bytes(optimized, args, {**kwargs, **extra})
    assert measured <= budget, f"{fraction}: measured {measured} > budget {budget}"


def test_loss_inside_the_model_as_loss_fn_has_no_zero_tangent_for_the_logits():
    """`labels=` inside a transformers model: given as loss_fn=lambda out, _: out.loss, the logits are no
    longer an output, so backward gets no logits-sized zero tangent; training still equals eager's."""
    model, x, y = _hf_gpt2()
    inside = fxmem.plan(model, (x,), example_kwargs={"labels": y})
    as_loss_fn = fxmem.plan(model, (x,), example_kwargs={"labels": y}, loss_fn=lambda out, _: out.loss)
    logits = x.numel() * model.config.vocab_size * 4
    assert inside.baseline_peak_bytes - as_loss_fn.baseline_peak_bytes >= logits
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=lambda out, _: out.loss)
    torch.manual_seed(1)
    expected = reference(x, labels=y).loss
    expected.backward()
    torch.manual_seed(1)
    loss = optimized(x, labels=y)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=0, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
