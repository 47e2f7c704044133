"""fxmem/run/dynamo/ledger.py: a step Dynamo splits into graphs is planned exactly across them. Each graph's plan
adds what the rest of the step holds (other graphs' parameters and saved values, tensors passed
between graphs counted once, gradients later graphs produced before its backward), so the step's
predicted peak is MemTracker's within 1% and the measured peak stays within the budget."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from fxmem.run.dynamo.compile import ledger_for
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB, step
from tests.run.dynamo.test_step import _assert_trains_like, _fresh_dynamo  # noqa: F401  (the autouse fixture)


class _Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _TiedBreak(nn.Module):
    """Embedding tied to the output head, with the model's own label check between them: two graphs,
    the tied weight in both; the head's gradient exists before the first graph's backward."""

    def __init__(self, vocab: int = 1000, d: int = 128):
        super().__init__()
        self.emb, self.first, self.second = nn.Embedding(vocab, d), _Mlp(d), _Mlp(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.vocab = vocab

    def forward(self, ids, labels):
        h = self.first(self.emb(ids))
        if labels.max() >= self.vocab:
            raise ValueError("label out of range")
        return F.cross_entropy(self.head(self.second(h)).flatten(0, 1), labels.flatten())


def _inputs():
    torch.manual_seed(0)
    return torch.randint(0, 1000, (8, 128)), torch.randint(0, 1000, (8, 128))


def test_step_split_by_dynamo_is_predicted_within_one_percent_and_fits():
    torch.manual_seed(0)
    model, inputs = _TiedBreak(), _inputs()
    eager = measure_peak_bytes(copy.deepcopy(model), inputs)
    predicted = {}
    for fraction in (1.0, 0.85):
        budget = int(fraction * eager)
        optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / GIB, time_limit_s=5)
        _assert_trains_like(copy.deepcopy(model), optimized, inputs)
        measured = measure_peak_bytes(optimized, inputs)
        plans = optimized.plans
        assert len(plans) == 2 and all(p.budget_bytes == budget for p in plans)
        predicted[fraction] = max(p.predicted_peak_bytes for p in plans)
        assert measured <= budget, f"{fraction}: measured {measured} > budget {budget}"
        assert abs(predicted[fraction] - measured) <= 0.01 * measured, (fraction, predicted[fraction], measured)
    assert predicted[0.85] < predicted[1.0]


def test_later_graphs_gradients_are_held_during_earlier_backward():
    torch.manual_seed(0)
    model, inputs = _TiedBreak(), _inputs()
    optimized = fxmem.optimize(model, budget_gb=1.0, time_limit_s=5)
    step(optimized, inputs)
    (ledger,) = [ledger_for(s.options) for s in _dynamo_steps(optimized)]
    assert len(ledger.survey) == 2
    first, second = ledger.records
    head = model.emb.weight.numel() * 4 + sum(p.numel() * 4 for p in model.second.parameters())
    forward, backward = first.held
    assert backward - forward == head  # the tied weight's and the second MLP's gradients
    # nothing runs backward before the last graph but the loss's own gradient, a float32 scalar (the eager
    # code after the last graph, here none, would add what it saved and allocates: fxmem.run.dynamo.eager_held)
    assert second.held[1] - second.held[0] == ledger.tail[1] == 4
    assert second.held[0] >= first.saved_bytes  # the first graph's saved values, while the second runs


def _dynamo_steps(optimized):
    return [s for s in optimized._steps.values() if hasattr(s, "options")]
