"""fxmem/trace/autocast.py: under bf16 autocast the step's gradients are eager's wherever backward
runs. CPU attention with dropout runs the math kernel (fp32 matmuls outside autocast), whose eager
backward is bf16 under autocast and fp32 outside it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxmem
from fxmem.trace import autocast as bwa
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB

transformers = pytest.importorskip("transformers")
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}
OUTSIDE = "backward ran outside autocast"


def _gpt2(attention: str = "sdpa"):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1,
                                     attn_implementation=attention)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(128, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _step(module, kwargs, backward_inside: bool):
    """One step with the forward under bf16 autocast and backward inside or after it; returns (loss, grads)."""
    torch.manual_seed(1234)
    for p in module.parameters():
        p.grad = None
    with torch.autocast(**BF16):
        loss = module(**kwargs).loss
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return loss, {name: p.grad for name, p in module.named_parameters()}


def _assert_like_eager(step, eager):
    (loss, grads), (eager_loss, eager_grads) = step, eager
    assert torch.equal(loss, eager_loss), (loss, eager_loss)
    assert [n for n, g in grads.items() if g is None] == [n for n, g in eager_grads.items() if g is None]
    for name, grad in grads.items():
        if grad is not None:
            assert torch.equal(grad, eager_grads[name]), f"{name}: max |diff| {(grad - eager_grads[name]).abs().max()}"


def _one_plan_per_loop(optimized):
    """`_step` drops the output before backward: the first call's plan holds it, the next ones are for that loop
    (`fxmem.trace.loop`, where backward was seen to run); each planned once. Returns the loop's plan."""
    held, dropped = optimized.plans
    assert "holds them" in held.loss and "drops them before backward" in dropped.loss
    return dropped


def _like_eager_after_one_warning(model, kwargs, budget: int, eager, backward_inside: bool):
    """fxmem.optimize at `budget`: where backward runs elsewhere than planned, the first step warns (at the
    caller's `backward()` line) and plans again; the next steps are eager's bit for bit. Returns that plan."""
    optimized = fxmem.optimize(model, budget_gb=budget / GIB, time_limit_s=2)
    ran = "under autocast" if backward_inside else OUTSIDE
    with pytest.warns(UserWarning, match=f"backward ran {ran}.* planned for backward") as seen:
        _step(optimized, kwargs, backward_inside)
    assert seen[0].filename == __file__
    for _ in range(2):
        _assert_like_eager(_step(optimized, kwargs, backward_inside), eager)
    first, again = optimized.plans
    assert again.fingerprint != first.fingerprint  # fp32 attention matmuls in backward, not bf16
    return first, again


def _like_eager_from_the_first_step(model, kwargs, budget: int, eager):
    """fxmem.optimize at `budget`, backward outside autocast as PyTorch advises: planned so from the first step,
    eager's bit for bit at every step, with no warning and one plan per loop, measured within the budget."""
    optimized = fxmem.optimize(model, budget_gb=budget / GIB, time_limit_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _assert_like_eager(_step(optimized, kwargs, backward_inside=False), eager)
    plan = _one_plan_per_loop(optimized)
    assert plan.signature.endswith("autocast(cpu:bfloat16), backward outside autocast")
    measured = measure_peak_bytes(optimized, (), kwargs, step=lambda m, _, kw: _step(m, kw, False), warmup=False)
    assert measured <= budget
    return plan


def test_sdpa_dropout_with_backward_outside_autocast_trains_like_eager():
    """With nothing recomputed and at a budget that recomputes attention, gradients equal eager's from the
    first step (they were 4.9e-4 off at the step that planned)."""
    model, kwargs = _gpt2()
    eager = _step(copy.deepcopy(model), kwargs, backward_inside=False)
    kept = _like_eager_from_the_first_step(copy.deepcopy(model), kwargs, 100 * GIB, eager)
    assert not kept.recompute
    budget = kept.predicted_peak_bytes - 3 * kept.saved_bytes // 10
    recomputing = _like_eager_from_the_first_step(model, kwargs, budget, eager)
    assert any(r.decision == "recompute" and r.op == "_safe_softmax" and ".attn" in r.module
               for r in recomputing.nodes)


def test_sdpa_dropout_with_backward_inside_autocast_is_planned_again_once():
    """Backward called inside autocast, where it was not planned: one warning, then eager's gradients."""
    model, kwargs = _gpt2()
    eager = _step(copy.deepcopy(model), kwargs, backward_inside=True)
    first, again = _like_eager_after_one_warning(model, kwargs, 100 * GIB, eager, backward_inside=True)
    assert first.signature.endswith("backward outside autocast")
    assert again.signature.endswith("autocast(cpu:bfloat16)")


def test_backward_pass_autocast_off_is_eagers_from_the_first_step():
    """torch's switch for a backward outside autocast: planned so from the start, with no warning."""
    model, kwargs = _gpt2()
    eager = _step(copy.deepcopy(model), kwargs, backward_inside=False)
    optimized = fxmem.optimize(model, budget_gb=100.0, time_limit_s=2)
    with warnings.catch_warnings(), torch._functorch.config.patch(backward_pass_autocast="off"):
        warnings.simplefilter("error")
        _assert_like_eager(_step(optimized, kwargs, backward_inside=False), eager)
    (plan,) = optimized.plans  # one call: the output held
    assert plan.signature.endswith("backward outside autocast")


@pytest.mark.parametrize("attention, backward_inside", [("sdpa", False), ("eager", True), ("eager", False)])
def test_planned_once_where_backward_agrees(attention, backward_inside):
    """Backward outside autocast (where it is planned), or a backward that autocast does not change
    (eager attention: its matmuls are bf16 in forward): eager's gradients, no warning, one plan per loop."""
    model, kwargs = _gpt2(attention)
    eager = _step(copy.deepcopy(model), kwargs, backward_inside)
    optimized = fxmem.optimize(model, budget_gb=100.0, time_limit_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _assert_like_eager(_step(optimized, kwargs, backward_inside), eager)
    _one_plan_per_loop(optimized)


def test_states_and_settings():
    forward = (("cpu", torch.bfloat16),)
    assert bwa.traced_state(forward, "same_as_forward") == forward and bwa.traced_state(forward, "off") == ()
    assert bwa.expected_state(forward, "same_as_forward") == () and bwa.expected_state(forward, "off") == ()
    for backward in ((), forward, (("cpu", torch.float16),)):
        assert bwa.traced_state(forward, bwa.config_for(backward, forward)) == backward
    assert bwa.signature_suffix((), forward) == ", backward outside autocast"
    assert bwa.signature_suffix(forward, forward) == ""
    with torch.autocast(**BF16):
        assert bwa.live_state() == forward
    assert bwa.live_state() == ()
