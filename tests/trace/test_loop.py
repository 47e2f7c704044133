"""The user's loop learned from backward (`fxmem.trace.loop`): a transformers model called with `labels=` and
optimized without `keep_outputs=` is planned with its outputs held until a call is seen dropping them before
backward, then for the loop that drops them, and held again once a call is seen holding its output; every call,
the ones that plan included, measured within the budget by MemTracker, and the gradients are eager's."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.measure import measure_peak_bytes
from fxmem.trace.loop import DROPPED, HELD, LoopWatch


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 1000, (4, 64))


def held(module, args, kwargs):
    out = module(*args, **kwargs)
    out.loss.backward()
    return out


def dropped(module, args, kwargs):
    module(*args, **kwargs).loss.backward()


def logits_kept(module, args, kwargs):
    out = module(*args, **kwargs)
    loss, logits = out.loss, out.logits
    del out
    loss.backward()
    return logits


def test_the_loop_is_seen_at_backward_and_every_call_is_within_budget():
    model, ids = _gpt2()
    kwargs = {"input_ids": ids, "labels": ids}
    budget = 0.7 * measure_peak_bytes(copy.deepcopy(model), (), kwargs)
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / 2**30, time_limit_s=2)
    planned_for, calls = [], []
    for loop in (dropped, dropped, held, logits_kept, dropped):
        calls.append(measure_peak_bytes(optimized, (), kwargs, step=loop, warmup=False))
        planned_for.append(HELD if "holds them" in optimized.plan.loss else DROPPED)
    assert max(calls) <= budget, (calls, budget)
    # the third call runs the dropped plan and is seen holding its output; the fourth keeps the logits alone
    assert planned_for == [HELD, DROPPED, DROPPED, HELD, HELD]
    assert len(optimized.plans) == 2 and all(p.recompute for p in optimized.plans)
    assert optimized.plans[1].solver.startswith("seeded")  # the dropped step starts from the held one's decision
    assert optimized.fxmem_model.transformer.h[0].mlp.c_fc.weight.grad is not None


def test_the_dropped_plan_returns_the_loss_alone_with_eagers_gradients():
    model, ids = _gpt2()
    reference, kwargs = copy.deepcopy(model), {"input_ids": ids, "labels": ids}
    optimized = fxmem.optimize(model, budget_gb=1.0, time_limit_s=2)
    dropped(optimized, (), kwargs)
    model.zero_grad(set_to_none=True)
    out = optimized(**kwargs)
    assert out.logits is None and "drops them before backward" in optimized.plan.loss
    out.loss.backward()
    expected = reference(**kwargs).loss
    expected.backward()
    torch.testing.assert_close(out.loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_outputs_are_watched_by_weak_reference_where_they_can_be():
    transformers = pytest.importorskip("transformers")
    w = torch.ones(3, requires_grad=True)

    def output():
        return transformers.modeling_outputs.CausalLMOutput(loss=(w * 2).sum(), logits=w.detach() * 3)

    watch = LoopWatch()
    out = output()
    watch.watch(out)
    out.loss.backward()
    assert watch.loop == HELD
    loss = output()
    watch.watch(loss)
    loss = loss.loss
    loss.backward()
    assert watch.loop == DROPPED
    watch.watch(out := {"loss": (w * 2).sum(), "logits": w.detach()})  # a plain dict: not seen
    del out
    watch.watch({"loss": (w * 2).sum()})
    assert watch.loop == DROPPED
