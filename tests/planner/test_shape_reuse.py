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


def test_a_shorter_sequence_reuses_the_decision_and_stays_within_budget():
    model = _gpt2(64)
    reference = copy.deepcopy(model)
    budget = 0.8 * measure_peak_bytes(copy.deepcopy(model), (), _batch(64))
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=2)
    peaks = {}
    for seq in (64, 60, 56):
        peaks[seq] = measure_peak_bytes(optimized, (), _batch(seq), warmup=False)
    solvers = [plan.solver for plan in optimized.plans]
    assert solvers[0] != "reused" and solvers[1:] == ["reused", "reused"], solvers
    assert max(peaks.values()) <= budget, (peaks, budget)
    assert all(plan.recompute for plan in optimized.plans)  # the same decision, still recomputing
    batch = _batch(56)
    assert_trains_like(reference, optimized, (), batch)


def test_a_longer_sequence_the_decision_does_not_fit_is_solved_again():
    model = _gpt2(96)
    budget = 0.8 * measure_peak_bytes(copy.deepcopy(model), (), _batch(64))
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=2)
    first = measure_peak_bytes(optimized, (), _batch(64), warmup=False)
    second = measure_peak_bytes(optimized, (), _batch(72), warmup=False)
    assert optimized.plans[-1].solver != "reused"
    assert max(first, second) <= budget, (first, second, budget)


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
