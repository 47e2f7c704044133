"""Gradient accumulation is planned: micro-batches that start with every gradient resident (accumulating,
or zeros from `zero_grad(set_to_none=False)`) are planned with them counted, measured (MemTracker) within
the budget on every micro-batch, and train as eager does (accumulated gradients, parameters after AdamW)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.price.accumulation import ACCUMULATING, ZEROS, accumulated_gradient_bytes, gradient_state
from fxmem.measure import measure_peak_bytes
from fxmem.trace.step_module import LossStep

MICRO_BATCHES = 4


def cross_entropy(out, labels):
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def tiny_gpt2():
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    batches = [(torch.randint(0, 256, (4, 32)),) for _ in range(MICRO_BATCHES)]
    return model, [((ids,), {"target": ids}) for (ids,) in batches]


def zoo_gpt():
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny", dropout=0.0, n_layer=1)
    return model, [(models.example_inputs("gpt-tiny", 4, seed=s), {}) for s in range(MICRO_BATCHES)]


def scalar(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def micro_step(module, inputs, kwargs):
    scalar(module(*inputs, **kwargs)).div(MICRO_BATCHES).backward()


def eager_peaks(model, batches, loss_fn):
    """Eager's peak on a micro-batch with every .grad None, and on an accumulating one."""
    eager = copy.deepcopy(model) if loss_fn is None else LossStep(copy.deepcopy(model), loss_fn)
    inputs, kwargs = batches[0]
    fresh = measure_peak_bytes(eager, inputs, kwargs, step=micro_step)
    return fresh, measure_peak_bytes(eager, inputs, kwargs, step=micro_step, warmup=False, keep_grads=True)


def train(module, batches, optimizer, measure=False, set_to_none=True):
    """Accumulate over `batches`, then one optimizer step; the peak of each micro-batch when `measure`."""
    peaks = []
    for inputs, kwargs in batches:
        if measure:
            peaks.append(measure_peak_bytes(module, inputs, kwargs, step=micro_step, warmup=False, keep_grads=True))
        else:
            micro_step(module, inputs, kwargs)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return peaks, grads


@functools.cache
def case(name):
    model, batches = tiny_gpt2() if name == "transformers-gpt2" else zoo_gpt()
    loss_fn = cross_entropy if name == "transformers-gpt2" else None
    fresh, accumulating = eager_peaks(model, batches, loss_fn)
    return name, model, batches, loss_fn, fresh, accumulating


# zero_grad(set_to_none=False) on the transformers model only: each case plans for seconds
@pytest.mark.parametrize("name, set_to_none", [("transformers-gpt2", True), ("transformers-gpt2", False),
                                               ("zoo-gpt-tiny", True)])
def test_accumulating_micro_batches_stay_within_the_budget_and_train_as_eager(name, set_to_none):
    name, model, batches, loss_fn, fresh, accumulating = case(name)
    assert accumulating > fresh  # the gradients eager holds from the second micro-batch on
    budget = (fresh + accumulating) // 2  # eager fits its first micro-batch, not the accumulating ones
    eager = copy.deepcopy(model)
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / 2**30, loss_fn=loss_fn, time_limit_s=0.5)
    reference = eager if loss_fn is None else LossStep(eager, loss_fn)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(optimized.parameters(), lr=1e-2)
    for _ in range(2):  # the first iteration plans each signature; the second is measured
        train(reference, batches, opt_ref, set_to_none=set_to_none)
        train(optimized, batches, opt, set_to_none=set_to_none)
    _, want = train(reference, batches, opt_ref, set_to_none=set_to_none)
    peaks, got = train(optimized, batches, opt, measure=True, set_to_none=set_to_none)
    assert max(peaks) <= budget, f"{name}: micro-batch peaks {peaks} over the budget {budget}"
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for (key, p), q in zip(reference.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
    described = {plan.resident_gradients for plan in optimized.plans}
    assert "" in described and ACCUMULATING in described  # the very first micro-batch: every .grad None
    assert (ZEROS in described) == (not set_to_none)
    resident = [p for p in optimized.plans if p.resident_gradients]
    assert all(p.resident_gradient_bytes == accumulated_gradient_bytes(model) for p in resident)
    assert all(p.predicted_peak_bytes <= budget for p in optimized.plans)
    assert "resident (accumulating)" in next(p for p in resident if p.resident_gradients == ACCUMULATING).table()


def test_the_refusal_names_the_accumulating_step_least_budget():
    """A budget the first micro-batch fits and an accumulating one does not: the refusal comes for the
    accumulating micro-batch (planned offline with accumulating=True), naming the gradients and its least budget."""
    name, model, batches, loss_fn, fresh, _ = case("zoo-gpt-tiny")
    (inputs, kwargs), opt_args = batches[0], {"loss_fn": loss_fn, "time_limit_s": 1.0}
    args = (*inputs,) if loss_fn is None else inputs
    extra = {} if loss_fn is None else {"example_target": kwargs["target"]}
    with pytest.raises(fxmem.InfeasibleBudgetError) as too_low:
        fxmem.plan(model, args, budget_gb=1e-6, **opt_args, **extra)
    budget = too_low.value.min_budget_bytes + accumulated_gradient_bytes(model) // 2
    assert fxmem.plan(model, args, budget_gb=budget / 2**30, **opt_args, **extra).predicted_peak_bytes <= budget
    with pytest.raises(fxmem.InfeasibleBudgetError, match=r"gradients resident \(accumulating\)") as refused:
        fxmem.plan(model, args, budget_gb=budget / 2**30, accumulating=True, **opt_args, **extra)
    assert refused.value.min_budget_bytes > budget


def test_gradient_state_reads_which_gradients_exist_and_whether_they_are_zeros():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert gradient_state(model).key == () and not gradient_state(model).resident
    model(torch.randn(3, 4)).sum().backward()
    state = gradient_state(model)
    assert state.description == ACCUMULATING and state.bytes == accumulated_gradient_bytes(model) == 4 * (16 + 4 + 8 + 2)
    model.zero_grad(set_to_none=False)
    assert gradient_state(model).description == ZEROS and gradient_state(model).key != state.key
    model[1].weight.grad = None
    assert gradient_state(model).present == (True, True, False, True)


def test_optimizer_step_and_zero_grad_stay_within_the_budget_on_llama():
    """With optimizer=, forward + backward + AdamW's step (its temporaries included) + zero_grad, measured
    by MemTracker with the optimizer tracked, stays within the budget."""
    import transformers

    from fxmem.measure import _StepTracker

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=256, use_cache=False)
    torch.manual_seed(0)
    model, ids = transformers.LlamaForCausalLM(config), torch.randint(0, 256, (4, 32))
    keep_all = fxmem.plan(model, (ids,), example_kwargs={"labels": ids}, optimizer="adamw")
    budget = int(0.9 * keep_all.predicted_peak_bytes)
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, optimizer="adamw", time_limit_s=0.5)
    opt = torch.optim.AdamW(optimized.parameters())

    def iteration():
        optimized(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    iteration()  # plans, and makes AdamW's state
    tracker = _StepTracker()
    tracker.track_external(optimized, opt, ids)
    with tracker:
        iteration()
    measured = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert optimized.plan.recompute and optimized.plan.optimizer_state_bytes and measured <= budget, (measured, budget)


def test_a_model_planned_through_dynamo_counts_the_accumulated_gradients():
    """A model torch.export refuses (a data-dependent label check): its Dynamo graphs share the budget less
    the resident gradients on accumulating micro-batches, measured within it, gradients as eager's."""
    from tests.run.dynamo.test_step import _LabelCheck

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x, y = _LabelCheck(d=128), torch.randn(1024, 128), torch.randint(0, 16, (1024,))
    eager = copy.deepcopy(model)
    fresh = measure_peak_bytes(eager, (x, y))
    budget = (fresh + measure_peak_bytes(eager, (x, y), warmup=False, keep_grads=True)) // 2
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / 2**30, time_limit_s=1)
    reference = copy.deepcopy(model)
    half = lambda m, i, k: m(*i).div(2).backward()  # noqa: E731
    for module in (optimized, reference):  # one global batch of two micro-batches: plans both signatures
        half(module, (x, y), {}), half(module, (x, y), {})
        module.zero_grad()
    peaks = []
    for _ in range(2):
        peaks.append(measure_peak_bytes(optimized, (x, y), warmup=False, keep_grads=True, step=half))
        half(reference, (x, y), {})
    assert max(peaks) <= budget, (peaks, budget)
    for (name, p), q in zip(reference.named_parameters(), optimized.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")
    plans = optimized.plans
    assert {p.resident_gradients for p in plans} == {"", ACCUMULATING}
    assert all(p.capture.startswith("Dynamo graph") and p.predicted_peak_bytes <= budget for p in plans)
    torch._dynamo.reset()


def test_a_given_plan_made_without_gradients_warns_when_accumulating_takes_it_over_its_budget():
    torch.manual_seed(0)
    model, (x, y) = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    plan = fxmem.plan(model, (x, y))  # no budget: the keep-all step's peak is the plan's budget
    optimized = fxmem.optimize(model, plan=plan)
    optimized(x, y).backward()
    with pytest.warns(UserWarning, match="plan= was made for a step with no gradients resident"):
        optimized(x, y).backward()
