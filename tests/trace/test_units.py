"""Cut units (`fxmem.trace.units`): containers and layer-list wrappers are opened, so a transformers decoder
is placed and pipelined between its layers, and still trains exactly like eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.trace.units import is_opened, unit_path
from tests.conftest import assert_trains_like


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Body(nn.Module):
    """A wrapper around a layer list, as a transformers `LlamaModel` is."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(_Layer(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.embed(x) * 2.0  # an op in the wrapper's own forward
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Body()
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.model(x))


def test_unit_paths_open_containers_and_layer_list_wrappers():
    model = _Nested()
    assert is_opened(model.model) and is_opened(model.model.layers) and not is_opened(model.head)
    assert unit_path(model, "model.layers.2.up") == "model.layers.2"
    assert unit_path(model, "model.embed") == "model.embed"
    assert unit_path(model, "model") == "model"  # the wrapper's own ops
    assert unit_path(model, "head") == "head"
    assert unit_path(model, "") == ""
    assert unit_path(model, "model.missing.x") == "model.missing"


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      use_cache=False)  # no GQA: see BENCHMARKS.md's known gaps
    return transformers.LlamaForCausalLM(config), (torch.randint(0, 128, (2, 16)),)


def _tight_placement(model, inputs):
    whole = fxmem.optimize(copy.deepcopy(model), budget_gb=1.0, devices=["cpu", "cpu"])
    whole(*inputs)
    total = sum(e.peak_bytes for e in whole.plan.devices)
    # the cut between layers and training as eager hold of any plan that fits: a short search
    return fxmem.optimize(model, budget_gb=0.6 * total / 2**30, devices=["cpu", "cpu"], time_limit_s=1)


@pytest.mark.parametrize("build", ["nested", "llama"])
def test_placement_splits_between_layers_and_trains_like_eager(build):
    if build == "nested":
        torch.manual_seed(0)
        model, inputs = _Nested(), (torch.randn(64, 32),)
    else:
        model, inputs = _llama()
    reference = copy.deepcopy(model)
    placed = _tight_placement(model, inputs)
    assert_trains_like(reference, placed, inputs)
    first, second = placed.plan.devices
    layers = "model.layers."
    assert any(m.startswith(layers) for m in first.modules) and any(m.startswith(layers) for m in second.modules), \
        f"the cut falls between two layers: {first.modules} | {second.modules}"


def test_pipeline_stages_of_a_llama_cut_between_layers():
    model, inputs = _llama()
    plan = fxmem.plan(model, inputs, num_stages=2, n_microbatches=2)
    units = plan.pipeline.units
    assert sum(u.startswith("model.layers.") for u in units) == 4, units
    first, second = (s.modules for s in plan.pipeline.stages)
    assert any(m.startswith("model.layers.") for m in first) and any(m.startswith("model.layers.") for m in second)
