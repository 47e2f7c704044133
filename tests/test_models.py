"""The model zoo: every preset builds; tiny presets train, trace and export like eager."""
from __future__ import annotations

import copy

import pytest
import torch

from fxmem import models
from fxmem.models import gpt, mlp, resnet, unet

ALL = models.list_models()
TINY = [name for name in ALL if name.endswith("-tiny")]
BIG = ["gpt-small", "gpt2", "resnet18", "unet-small"]


def build(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.from_name(name, **overrides)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_presets_are_the_contract():
    expected = {"gpt-tiny", "gpt-small", "gpt2", "resnet-tiny", "resnet18",
                "unet-tiny", "unet-small", "mlp-tiny", "mlp-small"}
    assert set(ALL) == expected
    assert models.DEFAULT_MODEL in ALL
    assert set(BIG) <= set(ALL)


def test_each_preset_is_in_its_family_with_a_batch_size_and_no_name_twice():
    families = {"gpt": gpt, "mlp": mlp, "resnet": resnet, "unet": unet}
    assert sum(len(family.presets) for family in families.values()) == len(ALL)
    for name, (family, batch) in models.PRESETS.items():
        assert name in families[family].presets and batch == models.default_batch_size(name) > 0


@pytest.mark.parametrize("name", ALL)
def test_constructs_on_meta_and_traces(name):
    with torch.device("meta"):
        model = models.from_name(name)
    assert all(p.is_meta for p in model.parameters())
    graph = torch.fx.symbolic_trace(model).graph
    n_inputs = 3 if name.startswith("unet") else 2
    assert sum(node.op == "placeholder" for node in graph.nodes) == n_inputs


@pytest.mark.parametrize("name", ALL)
def test_default_batch_runs_on_meta(name):
    with torch.device("meta"):
        model = models.from_name(name)
    inputs = models.example_inputs(name, device="meta")
    assert inputs[0].shape[0] == models.default_batch_size(name)
    loss = model(*inputs)
    assert loss.shape == () and loss.is_meta
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name, expected", [
    ("gpt2", 124_439_808),
    ("gpt-small", 10_745_088),
    ("resnet18", 11_689_512),
])
def test_parameter_counts_match_reference_models(name, expected):
    with torch.device("meta"):
        model = models.from_name(name)
    assert n_params(model) == expected


def test_unet_small_is_a_realistic_size():
    with torch.device("meta"):
        model = models.from_name("unet-small")
    assert 5e6 < n_params(model) < 50e6


def test_gpt_ties_lm_head_to_token_embedding():
    model = build("gpt-tiny")
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    model = build(name)
    inputs = models.example_inputs(name)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", TINY)
def test_tiny_prediction_shape(name):
    model = build(name).eval()
    *inputs, targets = models.example_inputs(name, 3)
    prediction = model(*inputs)
    if name.startswith("gpt"):
        assert prediction.shape == (*targets.shape, model.config.vocab_size)
    elif name.startswith("unet"):
        assert prediction.shape == inputs[0].shape == targets.shape
    else:
        assert prediction.shape == (3, model.config.num_classes)


@pytest.mark.parametrize("name", TINY)
def test_tiny_symbolic_trace_matches_eager(name):
    model = build(name).eval()
    inputs = models.example_inputs(name)
    traced = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)
    predict = torch.fx.symbolic_trace(model, concrete_args={"targets": None})
    torch.testing.assert_close(predict(*inputs[:-1]), model(*inputs[:-1]), rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY)
def test_tiny_export_matches_eager(name):
    model = build(name).eval()
    inputs = models.example_inputs(name)
    exported = torch.export.export(model, inputs, strict=False)
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs))


@pytest.mark.parametrize("name", TINY)
def test_tiny_train_mode_graphs_match_eager_under_same_seed(name):
    model = build(name)
    inputs = models.example_inputs(name)
    exported = torch.export.export(copy.deepcopy(model), inputs, strict=False).module()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    losses = []
    for fn in (model, exported, traced):
        torch.manual_seed(1)
        losses.append(fn(*inputs))
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(losses[2], losses[0])


def test_unknown_name_lists_presets():
    with pytest.raises(KeyError) as info:
        models.from_name("no-such-model")
    assert all(name in str(info.value) for name in ALL)
    with pytest.raises(KeyError):
        models.example_inputs("no-such-model")
    with pytest.raises(KeyError):
        models.default_batch_size("no-such-model")


def test_config_overrides_apply():
    model = build("gpt-tiny", n_layer=1, dropout=0.0)
    assert (model.config.n_layer, model.config.dropout) == (1, 0.0)
    assert len(model.blocks) == 1
    assert models.from_name("gpt-tiny").config.n_layer == 2
    assert len(build("resnet-tiny", depths=(2, 1, 1)).stages[0]) == 2
    assert build("mlp-tiny", hidden=(8,)).head.in_features == 8
    model = build("gpt-tiny", block_size=16)
    inputs = models.example_inputs("gpt-tiny", 2, block_size=16)
    assert inputs[0].shape == (2, 16) and model(*inputs).dim() == 0
    with pytest.raises(TypeError):
        models.from_name("gpt-tiny", no_such_field=1)
    with pytest.raises(ValueError):
        models.from_name("gpt-tiny", n_head=5)


@pytest.mark.parametrize("name", TINY)
def test_init_is_deterministic_given_seed(name):
    a, b = build(name).state_dict(), build(name).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_example_inputs_batch_size_and_seed():
    name = "gpt-tiny"
    idx, targets = models.example_inputs(name)
    assert idx.shape[0] == models.default_batch_size(name)
    assert models.example_inputs(name, 5)[0].shape[0] == 5
    again = models.example_inputs(name, seed=3)[0]
    assert torch.equal(again, models.example_inputs(name, seed=3)[0])
    assert not torch.equal(again, idx)
    assert idx.dtype == targets.dtype == torch.long


def test_batchnorm_updates_running_stats_only_in_train_mode():
    model = build("resnet-tiny")
    inputs = models.example_inputs("resnet-tiny")
    bn = model.stem[0][1]
    before = bn.running_mean.clone()
    model(*inputs)
    assert not torch.equal(bn.running_mean, before)
    after_train = bn.running_mean.clone()
    model.eval()
    model(*inputs)
    assert torch.equal(bn.running_mean, after_train)


def test_dropout_follows_train_and_eval():
    model = build("gpt-tiny")
    inputs = models.example_inputs("gpt-tiny")
    assert not torch.equal(model(*inputs), model(*inputs))
    model.eval()
    assert torch.equal(model(*inputs), model(*inputs))


def test_unet_accepts_float_timesteps():
    model = build("unet-tiny").eval()
    x, t, targets = models.example_inputs("unet-tiny")
    torch.testing.assert_close(model(x, t.float(), targets), model(x, t, targets))
