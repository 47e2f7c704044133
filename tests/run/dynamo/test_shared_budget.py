"""One budget shared by a step's Dynamo graphs (`fxmem.run.dynamo.shared_budget`): a budget below what the graphs
need together is refused naming a least that the next call, planned at exactly that budget, meets:
accepted, the measured peak within it, training exactly like eager."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.run.dynamo.step import eager_random
from fxmem.run.dynamo.shared_budget import need, saved_cap
from fxmem.measure import measure_peak_bytes
from fxmem.planner.margin import margin_for
from tests.conftest import GIB
from tests.conftest import step as torch_step


def step(module, inputs, kwargs=None, seed=1234):
    """A training step from `seed` for torch's and NumPy's generators (SpecAugment masks draw from NumPy's)."""
    np.random.seed(seed)
    return torch_step(module, inputs, kwargs, seed)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _TwoHalves(nn.Module):
    """Two wide blocks with a data-dependent branch between them: Dynamo plans two graphs, the first
    keeping its activations for backward while the second runs."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.second = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.first(x)
        if h.mean() > 0:  # a Python branch on a tensor's value: a graph break
            h = h * 0.5
        return self.second(h).square().mean()


def _refused_then_met(model, args, kwargs, fraction, seeds=(0,), compiled_reference=False, eager_seed=None):
    """Refused at `fraction` of eager's peak; the least it names accepted by the next call, whose
    gradients equal eager's (with `compiled_reference`, those of Dynamo's own graphs with eager
    kernels, `backend="aot_eager"`, whose sums across graphs may round otherwise than eager's) and
    whose measured peak is within it in a step from each of `seeds` (other masks, other layers dropped).
    `fraction` is of eager's step from `eager_seed` (None: unseeded)."""
    eager = measure_peak_bytes(copy.deepcopy(model), args, kwargs,
                               **({} if eager_seed is None else {"step": lambda m, a, k: step(m, a, k, eager_seed)}))
    low = int(fraction * eager)
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        step(fxmem.optimize(copy.deepcopy(model), budget_gb=low / GIB, time_limit_s=1), args, kwargs)
    least = refused.value.min_budget_bytes
    assert low < least < eager, refused.value
    torch._dynamo.reset()
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    optimized = fxmem.optimize(candidate, budget_gb=least / GIB, time_limit_s=1)
    runner = torch.compile(reference, backend="aot_eager") if compiled_reference else reference
    with eager_random():
        out, expected = step(optimized, args, kwargs), step(runner, args, kwargs)
    loss = lambda o: o if isinstance(o, torch.Tensor) else o.loss  # noqa: E731
    torch.testing.assert_close(loss(out), loss(expected), atol=0, rtol=0)
    ref = dict(reference.named_parameters())
    for name, p in candidate.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    assert len(optimized.plans) > 1
    for seed in seeds:
        measured = measure_peak_bytes(optimized, args, kwargs, step=lambda m, a, k: step(m, a, k, seed), warmup=False)
        assert measured <= least, f"seed {seed}: measured {measured} > the least named {least}"
    return refused.value


def test_graph_break_step_refused_names_a_least_the_next_call_meets():
    torch.manual_seed(0)
    error = _refused_then_met(_TwoHalves(), (torch.randn(512, 64),), {}, 0.3)
    assert "graphs together" in str(error) and "not proven" in str(error)


class _Switched(_TwoHalves):
    """_TwoHalves whose first graph reads a Python attribute (its activation): switching it after a step
    fails that graph's guard, and Dynamo recompiles it with another op in a later step."""

    def __init__(self, d: int = 64):
        super().__init__(d)
        self.act = "gelu"

    def forward(self, x):
        h = self.first[0](x)
        h = self.first[2](nn.functional.gelu(h) if self.act == "gelu" else nn.functional.silu(h))
        h = self.first[4](self.first[3](h))
        if h.mean() > 0:
            h = h * 0.5
        return self.second(h).square().mean()


def test_graph_recompiled_in_a_later_step_keeps_within_the_least_named():
    """A graph Dynamo recompiles after the first step (a guard failed) runs where the graph it replaces
    ran: it keeps no more for backward than leaves the later graphs their least, so the step is still
    within the least named, and trains as eager."""
    torch.manual_seed(0)
    model, x = _Switched(), torch.randn(512, 64)
    eager = measure_peak_bytes(copy.deepcopy(model), (x,))
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        step(fxmem.optimize(copy.deepcopy(model), budget_gb=0.3 * eager / GIB, time_limit_s=1), (x,))
    least = refused.value.min_budget_bytes
    torch._dynamo.reset()
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    optimized = fxmem.optimize(candidate, budget_gb=least / GIB, time_limit_s=1)
    step(optimized, (x,))
    planned = len(optimized.plans)
    reference.act = candidate.act = "silu"
    measured = measure_peak_bytes(optimized, (x,), warmup=False)
    assert len(optimized.plans) == planned + 1  # the first graph, recompiled
    assert measured <= least, f"measured {measured} > the least named {least}"
    for module in (candidate, reference):
        module.zero_grad(set_to_none=True)
    torch.testing.assert_close(step(optimized, (x,)), step(reference, (x,)), atol=0, rtol=0)
    ref = dict(reference.named_parameters())
    for name, p in candidate.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def test_wav2vec2_ctc_with_time_masking_refused_names_a_least_the_next_call_meets():
    """SpecAugment's time masks (transformers' default mask_time_prob) are drawn from NumPy's generator
    between Dynamo's graphs: the same masks as eager's, and every step's masks within the least named."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=32, layerdrop=0.0, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_feat_extract_layers=2, num_hidden_layers=1, num_attention_heads=4, hidden_size=64, intermediate_size=128))
    assert model.config.mask_time_prob > 0
    model.train()
    _refused_then_met(model, (torch.randn(2, 1600),), {"labels": torch.randint(1, 32, (2, 20))}, 0.3, seeds=(0, 1, 2))


def _layers_run(model, args, kwargs, seed):
    """Which encoder layers an eager step from `seed` runs (LayerDrop skips the others)."""
    ran = []
    hooks = [layer.register_forward_hook(lambda *_, k=k: ran.append(k))
             for k, layer in enumerate(model.wav2vec2.encoder.layers)]
    with torch.no_grad():
        np.random.seed(seed), torch.manual_seed(seed), model(*args, **kwargs)
    for hook in hooks:
        hook.remove()
    return ran


def test_wav2vec2_ctc_with_layerdrop_every_step_within_the_least_named():
    """LayerDrop decides per layer, eagerly, whether the layer's graph runs: the first step skips a
    layer, later steps run one layer or all three, and each is within the least the refusal named."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=32, layerdrop=0.5, mask_time_prob=0.0, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_feat_extract_layers=2, num_hidden_layers=3, num_attention_heads=4, hidden_size=64, intermediate_size=128))
    model.train()
    args, kwargs = (torch.randn(2, 1600),), {"labels": torch.randint(1, 32, (2, 20))}
    seeds = (4, 6, 7)
    runs = [len(_layers_run(copy.deepcopy(model), args, kwargs, seed)) for seed in (1234, *seeds)]
    assert runs[0] < 3 and runs[2] == 3 and min(runs[1:]) < 3, runs  # the planned step skips; later ones vary
    error = _refused_then_met(model, args, kwargs, 0.3, seeds=seeds, compiled_reference=True, eager_seed=seeds[1])
    assert "up to 3 times a step" in str(error), error


def test_need_counts_what_earlier_graphs_keep():
    assert need([10, 5, 8], [4, 3, 1]) == (15, 2)  # graph 2 runs while graphs 0 and 1 keep 7
    assert need([10], [100]) == (10, 0)
    # graph 1 runs three times (a loop's layers): its last run holds its first two runs' 3 each, and
    # graph 2 runs while graph 0 keeps 4 and graph 1's three runs keep 9
    assert need([10, 5, 8], [4, 3, 1], [1, 3, 1]) == (21, 2)
    assert need([10, 12, 8], [4, 3, 1], [1, 3, 1]) == (22, 1)


def test_saved_cap_leaves_later_graphs_their_least():
    from fxmem.run.dynamo.shared_budget import GraphShare

    shares = [GraphShare(k, "", peak, saved, None, 0) for k, (peak, saved) in enumerate([(50, 10), (40, 20), (30, 0)])]
    budget = 1 << 20
    # graph 1 needs 40 on top of graph 0's saved values, graph 2 needs 30 + the 20 graph 1 keeps
    assert saved_cap(shares, 0, budget, earlier=0) == budget - margin_for("cpu").bytes_for(budget) - 50
    assert saved_cap(shares, 1, budget, earlier=10) == budget - margin_for("cpu").bytes_for(budget) - 10 - 30
    assert saved_cap(shares, 2, budget, earlier=0) is None
    looped = [GraphShare(k, "", peak, saved, None, 0, runs) for k, (peak, saved, runs)
              in enumerate([(50, 10, 1), (40, 20, 3), (30, 0, 1)])]
    # graph 1's last run needs 40 + its two earlier runs' 40; graph 2 needs 30 + the 60 its three runs keep
    assert saved_cap(looped, 0, budget, earlier=0) == budget - margin_for("cpu").bytes_for(budget) - 90
    assert saved_cap(looped, 1, budget, earlier=10) == (budget - margin_for("cpu").bytes_for(budget) - 10 - 30) // 3
