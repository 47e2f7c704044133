"""fxmem.planner.shape_reuse: a new sequence length tries the decision chosen for the last one first; it is
the plan where its simulated peak fits the budget (measured by MemTracker within it, training as eager), and
a shape it does not fit is solved afresh."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.measure import measure_peak_bytes
from fxmem.planner import shape_reuse
from tests.conftest import assert_trains_like


def _gpt2(seq: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=seq,
                                     use_cache=False, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _batch(seq: int) -> dict:
    ids = torch.randint(0, 1000, (4, seq))
    return {"input_ids": ids, "labels": ids}


def test_a_shorter_sequence_reuses_the_decision_and_a_longer_one_it_does_not_fit_is_solved_again():
    model = _gpt2(96)
    reference = copy.deepcopy(model)
    budget = 0.8 * measure_peak_bytes(copy.deepcopy(model), (), _batch(64))
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=1)
    peaks = {seq: measure_peak_bytes(optimized, (), _batch(seq), warmup=False) for seq in (64, 60, 56, 72)}
    solvers = [plan.solver for plan in optimized.plans]
    assert solvers[0] != "reused" and solvers[1:3] == ["reused", "reused"] and solvers[3] != "reused", solvers
    assert max(peaks.values()) <= budget, (peaks, budget)
    assert all(plan.recompute for plan in optimized.plans[:3])  # the same decision, still recomputing
    assert_trains_like(reference, optimized, (), _batch(56))


def test_the_key_ignores_sizes_but_not_the_graph():
    from torch.fx import symbolic_trace

    class Add(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class Mul(torch.nn.Module):
        def forward(self, x):
            return x * 2

    a, b = symbolic_trace(Add()), symbolic_trace(Mul())
    assert shape_reuse.structure_key(a) == shape_reuse.structure_key(symbolic_trace(Add()))
    assert shape_reuse.structure_key(a) != shape_reuse.structure_key(b)


def test_chunk_counts_after_the_first_start_from_the_decision_before(monkeypatch):
    """Within one search over the loss's chunk counts, a count after the first is planned from the decision of
    the one before (`seeded`), its slack spent, where that fits: here the loss as traced fits by recomputing,
    and 2 chunks start from its decision; every plan made fits the budget, the one chosen is the fastest."""
    import torch.nn.functional as F

    import fxmem.planner.loss_chunks as loss_chunks

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=2, vocab_size=3000, n_positions=128, use_cache=False))
    ids = torch.randint(0, 3000, (4, 128))
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    budget = 0.6 * fxmem.plan(model, (ids,), loss_fn=loss, example_target=ids).baseline_peak_bytes
    made, chunked_plan = [], loss_chunks.chunked_plan
    monkeypatch.setattr(loss_chunks, "chunked_plan", lambda *a: made.append(chunked_plan(*a)) or made[-1])
    plan = fxmem.plan(model, (ids,), budget / 2**30, loss_fn=loss, example_target=ids, time_limit_s=1)
    assert made and made[0].solver.startswith("seeded"), [(p.loss_chunks, p.solver) for p in made]
    assert all(p.predicted_peak_bytes <= budget for p in made) and plan.predicted_peak_bytes <= budget
    assert plan.predicted_step_s <= min(p.predicted_step_s for p in made)
