"""What a user sees when fxmem refuses: one clear error naming what was wrong and the fix, not torch's
debugging output, not a hint at an option that does not exist."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
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


# --- errors end at fxmem's own frame: each row of what a user did, its exception, message and a short print ---

SHORT = 20  # lines of the printed traceback: the user's call, nn.Module's two frames, fxmem's, the message


def printed(exc: BaseException) -> list[str]:
    return "".join(traceback.format_exception(exc)).splitlines()


def assert_short(exc: BaseException, bound: int = SHORT) -> None:
    lines = printed(exc)
    assert len(lines) <= bound, "\n".join(lines)
    text = "\n".join(lines)
    for inside in ("_functorch", "torch/export", "proxy_tensor", "During handling of the above exception"):
        assert inside not in text, text


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16), torch.randint(0, 4, (8,))


def _gpt2() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 64, (2, 8))


def _lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def test_a_budget_far_too_small_names_the_minimum_in_a_short_traceback():
    model, x, _ = _mlp()
    with pytest.raises(fxmem.InfeasibleBudgetError, match=r"below the minimum .* raise budget_gb to at least") as info:
        fxmem.plan(model, (x,), budget_gb=1e-6)
    assert info.value.proven and info.value.min_budget_bytes > 1e-6 * 2**30
    assert_short(info.value)
    optimized = fxmem.optimize(model, budget_gb=1e-6)
    with pytest.raises(fxmem.InfeasibleBudgetError) as called:
        optimized(x)
    assert called.value.min_budget_bytes == info.value.min_budget_bytes
    assert_short(called.value)


def test_a_loss_fn_without_a_scalar_is_one_short_error():
    model, x, y = _mlp()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=lambda out, target: out)
    with pytest.raises(fxmem.LossFnError, match=r"one element .* got shape \(8, 4\)") as info:
        optimized(x, target=y)
    assert_short(info.value)


def test_a_positional_target_is_refused_before_the_model_runs():
    model, ids = _gpt2()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=_lm_loss)
    with pytest.raises(fxmem.CallError, match=r"without target=, and the model fails .*opt\(\*inputs, target=y\)") \
            as info:
        optimized(ids, ids)
    assert optimized.plan is None and optimized.plans == []  # nothing traced nor planned
    assert_short(info.value)
    mlp, x, y = _mlp()  # a model whose forward takes one input: said from its signature alone
    with pytest.raises(fxmem.CallError, match=r"Sequential.forward does not take these inputs .*target=y"):
        fxmem.optimize(mlp, budget_gb=1.0, loss_fn=F.cross_entropy)(x, y)


def test_a_missing_target_says_so_before_the_model_runs():
    model, ids = _gpt2()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=_lm_loss)
    with pytest.raises(fxmem.CallError, match=r"without target=, and loss_fn\(outputs, None\) fails") as info:
        optimized(ids)
    assert "torch.export" not in str(info.value) and optimized.plan is None
    assert_short(info.value)
    with pytest.raises(fxmem.CallError, match="without target="):
        fxmem.plan(model, (ids,), 1.0, loss_fn=_lm_loss)  # the same for a plan without example_target=


def test_a_loss_fn_that_reads_no_target_needs_none():
    model, ids = _gpt2()
    optimized = fxmem.optimize(model, budget_gb=1.0, loss_fn=lambda out, _: out.loss)
    optimized(ids, labels=ids).backward()
    assert optimized.plan is not None


def test_the_users_own_error_keeps_the_users_frames_only():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) @ torch.ones(3, 3)  # the user's bug: shapes do not match

    with pytest.raises(fxmem.TraceError, match="test_errors.py:[0-9]+ in forward") as info:
        fxmem.plan(Broken(), (torch.randn(2, 8),), 1.0)
    assert "same reduction dim" in str(info.value.__cause__)  # torch's error, its user frames only
    text = "\n".join(printed(info.value))
    assert "self.lin(x) @ torch.ones(3, 3)" in text and "FXMEM_FULL_TRACEBACK=1" in text
    assert "site-packages/torch" not in text and len(printed(info.value)) <= SHORT, text


@pytest.mark.parametrize("call, error, message", [
    (lambda m, x: fxmem.plan(m, (x,), budget_gb="2"), ValueError, "budget_gb must be a positive number"),
    (lambda m, x: fxmem.plan(m, (x,), 1.0, solver="cp-sat"), ValueError, "unknown solver 'cp-sat'"),
    (lambda m, x: fxmem.optimize(m, budget_gb=1.0, solver="cp-sat"), ValueError, "unknown solver"),
    (lambda m, x: fxmem.optimize("model.pt", budget_gb=1.0), TypeError, "must be a torch.nn.Module, got str"),
    (lambda m, x: fxmem.plan(nn.ReLU(), (x,), 1.0), ValueError, "no parameter requires grad"),
    (lambda m, x: fxmem.optimize(m, budget_gb=1.0, loss_fn=3), TypeError, "loss_fn must be callable"),
])
def test_wrong_arguments_are_one_line(call, error, message):
    model, x, _ = _mlp()
    with pytest.raises(error, match=message) as info:
        call(model, x)
    assert_short(info.value, 12)  # the test, its lambda, fxmem's frame, the message


def test_torch_compile_raises_fxmems_error_without_dynamos_stack():
    model, x, _ = _mlp()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": 1e-6, "inner": "aot_eager"})
    with pytest.raises(fxmem.InfeasibleBudgetError, match="below the minimum") as info:
        compiled(x)
    assert_short(info.value, 24)
    with pytest.raises(ValueError, match="unknown options") as bad:
        torch.compile(model, backend="fxmem", options={"budget": 1.0})(x)
    assert_short(bad.value, 24)
    torch._dynamo.reset()


def test_fxmem_full_traceback_keeps_every_frame(monkeypatch):
    model, x, _ = _mlp()
    monkeypatch.setenv("FXMEM_FULL_TRACEBACK", "1")
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (x,), budget_gb=1e-6)
    lines = printed(info.value)  # the planner's own frames (and AOTAutograd's where this plan traced the step)
    assert len(lines) > 40 and "fxmem/planner/planner.py" in "\n".join(lines)


def test_cli_exits_quietly_when_its_reader_leaves():
    read, write = os.pipe()
    os.close(read)  # `fxmem-plan --list-models | head` after head has left
    try:
        done = subprocess.run([sys.executable, "-m", "fxmem.cli.main", "--list-models"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr
