"""The allocator model: CUDA block rounding, BLAS workspaces and kernel scratch in the simulated step,
checked against allocator traces recorded on an H100 (tests/fixtures, made by scripts/gpu_trace.py
from torch.cuda.memory snapshots); on the CPU the model adds nothing. No GPU needed."""
from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import replace

import pytest
import torch

import fxmem
from fxmem.price.cost import DEVICE_PRESETS, SM80_WORKSPACE, SM90_WORKSPACE, DeviceSpec, preset_for
from fxmem.price.memory import EXACT, AllocatorModel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import gpu_trace  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "h100_gpt_small_b32.json")
MIB = 2**20


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(30, 50), torch.nn.Linear(50, 7)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=-1)).sum()


def test_cpu_allocator_adds_nothing():
    assert AllocatorModel.for_device(DEVICE_PRESETS["cpu"]) == EXACT
    assert EXACT.round(3) == 3 and EXACT.workspaces([]) == 0


def test_cuda_presets_round_and_hold_workspaces(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    h100 = AllocatorModel.for_device(DEVICE_PRESETS["h100"])
    assert (h100.round(0), h100.round(4), h100.round(512), h100.round(513)) == (0, 512, 512, 1024)
    assert h100.workspace_bytes == SM90_WORKSPACE == 32 * MIB
    assert AllocatorModel.for_device(DEVICE_PRESETS["a100"]).workspace_bytes == SM80_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert DEVICE_PRESETS["h100"].workspace_bytes() == 8 * MIB + 128 * 1024
    assert DEVICE_PRESETS["cpu"].workspace_bytes() == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":lots")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        DEVICE_PRESETS["h100"].workspace_bytes()


def test_plan_for_cuda_counts_workspaces_rounding_and_scratch(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model, x = Net(), torch.randn(64, 30)
    h100 = DEVICE_PRESETS["h100"]
    exact = fxmem.plan(model, [x], target=replace(h100, block_bytes=1, blas_workspace_bytes=0, scratch_ops=()))
    plan = fxmem.plan(model, [x], target=h100)
    workspaces = 2 * SM90_WORKSPACE  # forward's and autograd's backward thread's
    assert plan.breakdown["BLAS workspaces"] == workspaces and "BLAS workspaces" not in exact.breakdown
    extra = plan.baseline_peak_bytes - exact.baseline_peak_bytes - workspaces
    assert 0 < extra <= 64 * 50 * 4 + 40 * 512  # softmax backward's scratch, plus blocks rounded up
    timeline = plan.timelines["eager"]
    assert timeline.workspace == workspaces and min(timeline.live) >= timeline.static + workspaces


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        fixture = json.load(f)
    return fixture, {r["fraction"]: r for r in gpu_trace.predict(fixture, [1.0, 0.45])}


def test_trace_shows_what_the_model_holds(recorded):
    fixture, rows = recorded
    traced = {p["fraction"]: p["trace"] for p in fixture["plans"] if p["where"] == "cuda" and p["trace"]}
    held = traced[1.0]["held_across_steps"]  # the first plan in the process allocated them
    assert sorted(w["graph"] for w in held) == ["backward", "forward"]
    assert all(w["bytes"] == SM90_WORKSPACE for w in held)
    assert rows[1.0]["workspace_mib"] * MIB == sum(w["bytes"] for w in held)
    for frac, trace in traced.items():  # one scratch of softmax backward's output size per layer
        scratch = sorted(s["bytes"] for s in trace["scratch"] if s["graph"] == "backward" for _ in range(s["count"]))
        assert scratch == sorted(rows[frac]["scratch_bytes"])


@pytest.mark.parametrize("frac", [1.0, 0.45])
def test_prediction_for_h100_matches_measured_peaks(recorded, frac):
    """The recorded plans, predicted for the h100 with the allocator model, against every measured
    run of them (max_memory_allocated after a warm-up step) within 0.5%."""
    _, rows = recorded
    row = rows[frac]
    if not row["same_plan"]:  # the layered solver's per-layer options are time-limited: a loaded machine finds others
        pytest.skip("re-made plan differs from the recorded one (machine under load); its measured peaks do not apply")
    for measured in row["measured_mib"]:
        assert abs(row["predicted_mib"] - measured) <= 0.005 * measured, (frac, row)


def test_stray_run_is_explained_not_fitted():
    with open(FIXTURE) as f:
        fixture = json.load(f)
    stray = [r for p in fixture["plans"] for r in p["runs"] if r.get("excluded")]
    assert len(stray) == 1 and stray[0]["measured_mib"] == 968.3 and "parameters" in stray[0]["excluded"]


def test_unknown_gpu_gets_workspace_by_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA Future 1")
    for major, expected in ((9, SM90_WORKSPACE), (10, SM90_WORKSPACE), (8, SM80_WORKSPACE)):
        props = types.SimpleNamespace(total_memory=2**34, major=major)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None, p=props: p)
        spec = preset_for("cuda:0")
        assert isinstance(spec, DeviceSpec) and spec.blas_workspace_bytes == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the meter's CUDA path and the allocator "
                    "model on a real GPU are untested on this machine")
def test_meter_and_prediction_on_cuda():
    """On a GPU: the meter counts the cuBLAS workspaces the step allocates (as an OOM would), and the
    plan's prediction for this GPU is within 1% of it."""
    from fxmem.measure import measure_peak_bytes
    from fxmem import models
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny", dropout=0.0).cuda()
    inputs = [x.cuda() for x in models.example_inputs("gpt-tiny")]
    plan = fxmem.plan(model, inputs)
    measured = measure_peak_bytes(fxmem.optimize(model, plan=plan), inputs)
    assert measured >= plan.breakdown.get("BLAS workspaces", 0) > 0
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured, (plan.predicted_peak_bytes, measured)
