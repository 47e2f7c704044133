"""capture(): symbolic_trace where it works, export where it does not, clear errors otherwise."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.trace.capture import capture


def test_symbolic_trace_path_has_fake_values_everywhere():
    model = models.from_name("mlp-tiny")
    gm = capture(model, models.example_inputs("mlp-tiny"))
    assert gm.meta["fxmem"]["capture"] == "symbolic_trace"
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function", "call_module", "call_method", "get_attr"):
            assert "val" in node.meta, node.name
    assert all(p is q for p, q in zip(gm.parameters(), model.parameters()))


class KwargsAndDictOut(torch.nn.Module):
    """symbolic_trace cannot follow **kwargs; export can. Output keeps its dict structure."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, **extra):
        scale = extra.get("scale", 1.0)
        return {"y": self.lin(x) * scale, "n": x.shape[0]}


def test_export_fallback_keeps_output_structure():
    model = KwargsAndDictOut()
    x = torch.randn(4, 8)
    gm = capture(model, (x,), {"scale": 2.0})
    assert gm.meta["fxmem"]["capture"] == "export"
    optimized = fxmem.optimize(model, budget_gb=1.0)
    out = optimized(x, scale=2.0)
    assert set(out) == {"y", "n"} and out["n"] == 4
    torch.testing.assert_close(out["y"], model(x, scale=2.0)["y"])


def test_the_export_fallback_leaves_no_cycle_holding_the_callers_values():
    """symbolic_trace's error, kept while export runs, is let go: its traceback would hold the caller's frames
    (the step's real inputs and outputs) until the next garbage collection."""
    import gc
    import weakref

    def call_site():
        x = torch.randn(4, 8)
        capture(KwargsAndDictOut(), (x,), {"scale": 2.0})
        return weakref.ref(x)

    gc.disable()
    try:
        alive = call_site()
        assert alive() is None
    finally:
        gc.enable()


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            return h.relu().sum()
        return h.sum()


def test_data_dependent_control_flow_is_named():
    with pytest.raises(fxmem.TraceError) as info:
        fxmem.plan(DataDependent(), (torch.randn(4, 8),), budget_gb=1.0)
    message = str(info.value)
    assert "data-dependent control flow" in message and "torch.where" in message


def test_capture_restores_buffers():
    model = models.from_name("resnet-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, models.example_inputs("resnet-tiny"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], msg=key)


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


class _BooleanMask(torch.nn.Module):
    def forward(self, h):
        return h[h > 0]


class _MaskedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.mask = torch.nn.Linear(8, 8), _BooleanMask()

    def forward(self, x):
        return self.mask(self.proj(x)).sum()


def test_data_dependent_shape_is_one_line_naming_op_module_and_line():
    import fxmem
    from fxmem.errors import TraceError

    model, x = _MaskedModel(), torch.randn(4, 8)
    with pytest.raises(TraceError) as info:
        fxmem.plan(model, (x,), budget_gb=1.0)
    text = str(info.value)
    assert "\n" not in text
    assert "aten.nonzero" in text and "module mask" in text and "test_capture.py" in text and "h[h > 0]" in text
    assert "torch.where" in text


def test_optimize_runs_a_data_dependent_shape_through_dynamo():
    """fxmem.optimize does not stop there: Dynamo breaks the graph at the op and runs it eagerly."""
    import copy

    import fxmem

    torch.manual_seed(0)
    model, x = _MaskedModel(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    optimized = fxmem.optimize(model, budget_gb=1.0)
    loss = optimized(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=0, rtol=0)
    torch.testing.assert_close(model.proj.weight.grad, reference.proj.weight.grad, atol=0, rtol=0)
    torch._dynamo.reset()


def test_library_files_are_matched_by_package_folder_not_by_folder_name(tmp_path):
    import importlib
    import os

    import fxmem.models.gpt
    import fxmem.passes.recompute
    from fxmem.error_boundary import is_library_file

    capture_module = importlib.import_module("fxmem.trace.capture")

    user_file = tmp_path / "fxmem" / "torch" / "user_code.py"
    user_file.parent.mkdir(parents=True)
    user_file.write_text("x = 1\n")
    assert not is_library_file(str(user_file))
    for module in (capture_module, fxmem.passes.recompute, fxmem.models.gpt, torch.nn.functional):
        assert is_library_file(module.__file__), module.__name__
    linked = tmp_path / "linked_capture.py"  # a link to fxmem's file is fxmem's file
    os.symlink(capture_module.__file__, linked)
    assert is_library_file(str(linked))


def test_data_dependent_shape_names_user_line_in_a_folder_named_fxmem(tmp_path):
    import importlib.util

    from fxmem.errors import TraceError

    source = tmp_path / "fxmem" / "user_code.py"
    source.parent.mkdir()
    source.write_text("import torch\n\n\nclass Masked(torch.nn.Module):\n    def __init__(self):\n"
                      "        super().__init__()\n        self.proj = torch.nn.Linear(8, 8)\n\n"
                      "    def forward(self, x):\n        h = self.proj(x)\n        return h[h > 0].sum()\n")
    spec = importlib.util.spec_from_file_location("user_code", source)
    user_code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_code)
    with pytest.raises(TraceError) as info:
        fxmem.plan(user_code.Masked(), (torch.randn(4, 8),), budget_gb=1.0)
    assert "user_code.py:11 (return h[h > 0].sum())" in str(info.value)


def test_a_tuple_of_tensors_is_described_by_shapes_for_real_and_fake_tensors():
    """A block's rotary `position_embeddings` (a tuple of tensors): one signature whatever their values, and the
    same on fake tensors (an FSDP2 rank simulated on fakes, fxmem.fsdp) as on real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxmem.trace.capture import describe_input
    pair = (torch.randn(1, 4, 2), torch.zeros(1, 4, 2))
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(t) for t in pair)
    assert describe_input(pair) == describe_input(fake) == "(float32[1,4,2], float32[1,4,2])"
    assert describe_input([pair[0]]) == "[float32[1,4,2]]" and describe_input((1, "a")) == "(1, 'a')"
