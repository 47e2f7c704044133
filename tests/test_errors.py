"""What a user sees when fxmem refuses: one clear error naming what was wrong and the fix, not torch's
debugging output, not a hint at an option that does not exist."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fxmem


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h.relu().sum() if h.sum() > 0 else h.sum()


class Unserializable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import json

        json.dumps(self.lin(x))  # neither tracer can run this


def test_failed_export_prints_no_graph_dumps(capfd):
    with pytest.raises(fxmem.TraceError, match="data-dependent control flow") as info:
        fxmem.plan(DataDependent(), (torch.randn(4, 8),), budget_gb=1.0)
    err = capfd.readouterr().err
    assert "def forward" not in err and "Unable to find user code" not in err, err
    assert "def forward" in info.value.__cause__.torch_output  # kept, for whoever debugs it


def test_a_successful_trace_keeps_what_torch_prints(capfd):
    class Warns(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *rest):  # *rest: symbolic_trace refuses, torch.export captures it
            import sys

            print("hello from forward", file=sys.stderr)
            return self.lin(x).sum()

    fxmem.capture(Warns(), (torch.randn(2, 8),))
    assert "hello from forward" in capfd.readouterr().err


def test_generic_trace_error_points_at_options_that_exist():
    with pytest.raises(fxmem.TraceError) as info:
        fxmem.plan(Unserializable(), (torch.randn(2, 8),), budget_gb=1.0)
    message = str(info.value)
    assert "fxmem.capture(model, example_inputs, method='export')" in message and "__cause__" in message
    assert "method" not in inspect.signature(fxmem.plan).parameters  # so the hint must not say "pass method="
    assert "method" in inspect.signature(fxmem.capture).parameters
    assert "not JSON serializable" in str(info.value.__cause__)
    for method in ("export", "symbolic_trace"):
        with pytest.raises(fxmem.TraceError) as one:
            fxmem.capture(Unserializable(), (torch.randn(2, 8),), method=method)
        assert "JSON serializable" in str(one.value.__cause__)


def test_transformers_cache_names_use_cache_false():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(fxmem.TraceError, match="use_cache=False") as info:
        fxmem.plan(model, (ids,), 1.0, example_kwargs={"labels": ids})
    assert "DynamicCache" in str(info.value)
    plan = fxmem.plan(model, (ids,), 1.0, example_kwargs={"labels": ids, "use_cache": False})
    assert plan.predicted_peak_bytes > 0


def test_a_bare_tensor_is_one_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    bare, wrapped = fxmem.plan(model, x, 1.0), fxmem.plan(model, (x,), 1.0)
    assert bare.signature == wrapped.signature == "(float32[4,8])"
    assert bare.predicted_peak_bytes == wrapped.predicted_peak_bytes
    with pytest.raises(TypeError, match="example_kwargs"):
        fxmem.plan(model, {"input": x}, 1.0)
    with pytest.raises(TypeError, match=r"a tuple such as \(x,\)"):
        fxmem.plan(model, 3, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_absent_devices_are_refused_at_once():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="cuda") as info:
        fxmem.optimize(model, budget_gb=1.0, devices=["cuda:0", "cuda:1"])
    message = str(info.value)
    assert ("without CUDA" in message or "no cuda device" in message) and "devices=['cpu', 'cpu']" in message
    with pytest.raises(ValueError, match="not a device name"):
        fxmem.optimize(model, budget_gb=1.0, devices=["gpu0", "cpu"])
    fxmem.optimize(model, budget_gb=1.0, devices=["cpu", "cpu:1"])  # present: accepted
