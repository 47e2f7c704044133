"""Models torch.export cannot capture whole train through Dynamo's graphs under one budget
(`fxmem.run.dynamo.step`): exactly like eager (outputs, gradients and which are None, buffers), the same
layers skipped for the same seed, the measured peak within the budget."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB, step


def _assert_trains_like(reference, optimized, inputs):
    """Same outputs, gradients (None where eager has None) and buffers after one step, same seed."""
    torch.testing.assert_close(step(optimized, inputs), step(reference, inputs), atol=0, rtol=0)
    ref = dict(reference.named_parameters())
    for name, p in optimized.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    ref_buffers = dict(reference.named_buffers())
    for name, b in optimized.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=0, rtol=0)


class _LabelCheck(nn.Module):
    """A model's own loss code with a data-dependent check, as transformers' CTC heads have."""

    def __init__(self, d: int = 64, classes: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, 4 * d), nn.GELU())
        self.head = nn.Linear(4 * d, classes)
        self.unused = nn.Linear(d, d)
        self.classes = classes

    def forward(self, x, labels):
        if labels.max() >= self.classes:
            raise ValueError("label out of range")
        return nn.functional.cross_entropy(self.head(self.body(x)), labels)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class _LayerDrop(nn.Module):
    """Layers skipped at random while training (LayerDrop), decided in Python from torch.rand."""

    def __init__(self, d: int = 64, n: int = 6, p: float = 0.3):
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.norm = nn.BatchNorm1d(d)
        self.p = p

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand(()) < self.p:
                continue
            x = layer(x)
        return self.norm(x).square().mean()


def _cases():
    torch.manual_seed(0)
    yield "label-check", _LabelCheck(d=128), (torch.randn(2048, 128), torch.randint(0, 16, (2048,)))
    torch.manual_seed(0)
    yield "layerdrop", _LayerDrop(d=128), (torch.randn(1024, 128),)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_label_check_trains_like_eager_within_budget():
    _, model, inputs = next(c for c in _cases() if c[0] == "label-check")
    with pytest.raises(fxmem.TraceError):
        fxmem.capture(model, inputs)
    eager = measure_peak_bytes(copy.deepcopy(model), inputs)
    for fraction in (1.0, 0.85):
        reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
        budget = int(fraction * eager)
        optimized = fxmem.optimize(candidate, budget_gb=budget / GIB, time_limit_s=2)
        for _ in range(2):
            _assert_trains_like(reference, optimized, inputs)
        plans = optimized.plans
        assert plans and all(p.predicted_peak_bytes <= budget for p in plans)
        measured = measure_peak_bytes(optimized, inputs)
        assert measured <= budget, f"at {fraction}: measured {measured} > budget {budget}"
        torch._dynamo.reset()


def test_layerdrop_skips_the_same_layers_and_counts_every_layer():
    """A graph run once per kept layer: the same layers are skipped as in eager for the same seed, and
    the budget counts a run per layer of the list (no warning that it counts fewer)."""
    _, model, inputs = next(c for c in _cases() if c[0] == "layerdrop")
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=1.0, time_limit_s=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _assert_trains_like(reference, optimized, inputs)
    assert not [w for w in caught if "fxmem" in str(w.message)], [str(w.message) for w in caught]


class _Repeat(nn.Module):
    """One block applied a random number of times, with a graph break in the loop: not a list of layers."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.block = _Block(d)

    def forward(self, x):
        for _ in range(int(torch.randint(1, 4, ()))):
            x = self.block(x)
            if x.mean() > 100:  # a Python branch on a tensor's value: the loop runs eagerly
                x = x * 0.5
        return x.square().mean()


def test_a_loop_run_more_often_than_counted_says_so_in_one_line():
    torch.manual_seed(0)
    model, inputs = _Repeat(), (torch.randn(256, 64),)
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=1.0, time_limit_s=2)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (2, 0, 1, 3):  # the first step loops once, later ones up to three times
            torch.manual_seed(seed)
            counts.append(int(torch.randint(1, 4, ())))
            step(optimized, inputs, seed=seed)
    said = [str(w.message) for w in caught if "fxmem: one step ran" in str(w.message)]
    assert max(counts[1:]) > counts[0], counts  # a later step loops more often than the planned one
    assert len(said) == 1 and "\n" not in said[0] and "budgeted for" in said[0], said


def test_plan_given_is_refused_on_this_path():
    _, model, inputs = next(_cases())
    made = fxmem.plan(nn.Linear(64, 16), (torch.randn(2, 64),))
    with pytest.raises(fxmem.TraceError, match="plan="):
        fxmem.optimize(model, plan=made)(*inputs)


def _transformers_cases():
    transformers = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    deberta = transformers.DebertaV2ForSequenceClassification(
        transformers.DebertaV2Config(vocab_size=128, num_labels=3, **small))
    yield "deberta-v2 labels (nonzero in its loss)", deberta, (torch.randint(0, 128, (4, 32)),), \
        {"labels": torch.randint(0, 3, (4,))}
    torch.manual_seed(0)
    wav2vec2 = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=32, layerdrop=0.0, mask_time_prob=0.0, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_feat_extract_layers=2, **small))
    yield "wav2vec2-ctc labels (labels.max() check)", wav2vec2, (torch.randn(4, 1600),), \
        {"labels": torch.randint(1, 32, (4, 20))}


@pytest.mark.parametrize("case", range(2), ids=["deberta-v2", "wav2vec2-ctc"])
def test_transformers_models_export_refuses_train_like_eager_below_eager(case):
    """At 0.9 of eager's measured peak (the budget at eager's peak, on this path, is the label-check test's)."""
    name, model, args, kwargs = list(_transformers_cases())[case]
    model.train()
    eager = measure_peak_bytes(copy.deepcopy(model), args, kwargs)
    fraction = 0.9
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    budget = int(fraction * eager)
    optimized = fxmem.optimize(candidate, budget_gb=budget / GIB, time_limit_s=2)
    torch.testing.assert_close(step(optimized, args, kwargs).loss, step(reference, args, kwargs).loss,
                               atol=0, rtol=0)
    ref = dict(reference.named_parameters())
    for pname, p in candidate.named_parameters():
        assert (p.grad is None) == (ref[pname].grad is None), pname
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[pname].grad, atol=0, rtol=0)
    plans = optimized.plans
    assert len(plans) > 1 and all(p.capture.startswith("Dynamo graph") for p in plans), name
    measured = measure_peak_bytes(optimized, args, kwargs)
    assert measured <= budget, f"{name} at {fraction}: measured {measured} > budget {budget}"
    # safe, and close: a graph's outputs are counted until the step ends, though Python may drop one
    # sooner (DeBERTa's first graph returns a hidden state the loss code drops: +3%)
    assert max(p.predicted_peak_bytes for p in plans) <= 1.05 * measured


@pytest.mark.parametrize("fraction", [0.7, 0.8])
def test_wav2vec2_ctc_with_layerdrop_and_masking_every_call_within_budget(fraction):
    """transformers' defaults (LayerDrop 0.1, time masking 0.05), below eager's peak with every layer running:
    each call measured with a new MemTracker, the first included. The probe that learns the graphs keeps no
    activations beyond the graph it runs (the first call held eager's whole forward before); Dynamo's compile
    garbage, which held real activations, is collected before each new graph runs (the first call measured 7%
    over at 0.7, after other tests); what the eager code between the graphs (the CTC loss, after a
    data-dependent `masked_select`) keeps for backward is counted (0.8% over at 0.8 before); each MemTracker's
    global module hooks fail a Dynamo guard, so each call compiles its frames again, and past Dynamo's recompile
    limit (1 here, 8 by default) a frame would run eagerly, unplanned."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1  # set and set back, never deleted: later tests of the worker read it
    try:
        import numpy as np

        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
            vocab_size=32, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
            num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128))
        assert model.config.layerdrop > 0 and model.config.mask_time_prob > 0
        model.train()
        args, kwargs = (torch.randn(2, 1600),), {"labels": torch.randint(1, 32, (2, 20))}
        np.random.seed(0)
        torch.manual_seed(0)  # no layer dropped: eager's largest step
        eager = measure_peak_bytes(copy.deepcopy(model), args, kwargs, warmup=False)
        budget = int(fraction * eager)
        torch._dynamo.reset()
        optimized = fxmem.optimize(model, budget_gb=budget / GIB, time_limit_s=1)
        calls = []
        for seed in range(3):
            np.random.seed(seed)
            torch.manual_seed(seed)
            calls.append(measure_peak_bytes(optimized, args, kwargs, warmup=False))
        assert max(calls) <= budget, (calls, budget)
        assert all(p.capture.startswith("Dynamo graph") for p in optimized.plans)

    finally:
        torch._dynamo.config.recompile_limit = limit