"""The memory timeline PNG: written from a plan's simulated timelines, clear errors otherwise."""
from __future__ import annotations

import struct
import sys

import pytest

import fxmem
from fxmem import models
from fxmem.cli.plot import plot_timeline
from tests.conftest import GIB


@pytest.fixture(scope="module")
def recomputing_plan():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 512)
    eager = fxmem.plan(model, inputs)
    return fxmem.plan(model, inputs, budget_gb=eager.baseline_peak_bytes * 0.9 / GIB, solver="greedy",
                      eager_meter=True)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_timelines_are_the_planned_and_eager_steps(recomputing_plan):
    plan = recomputing_plan
    eager, planned = plan.timelines["eager"], plan.timelines["plan"]
    assert (eager.peak, planned.peak) == (plan.baseline_peak_bytes, plan.predicted_peak_bytes)
    assert planned.peak < eager.peak and plan.recompute
    recomputed = [n for n, ph in zip(planned.names, planned.phases) if ph == "backward" and n in plan.recompute]
    assert sorted(set(recomputed)) == sorted(plan.recompute)  # what the picture marks


def test_png_written(recomputing_plan, tmp_path):
    path = tmp_path / "timeline.png"
    assert plot_timeline(recomputing_plan, path) == str(path)
    width, height = png_size(path)
    assert width > 300 and height > 200


def test_plan_from_json_has_no_timeline(recomputing_plan, tmp_path):
    loaded = fxmem.Plan.from_json(recomputing_plan.to_json())
    assert loaded == recomputing_plan and loaded.timelines is None  # timelines stay out of the file
    with pytest.raises(fxmem.FxmemError, match="no memory timelines"):
        plot_timeline(loaded, tmp_path / "x.png")


def test_missing_matplotlib_is_a_clear_error(recomputing_plan, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(fxmem.FxmemError, match=r"pip install 'fxmem\[plot\]'"):
        plot_timeline(recomputing_plan, tmp_path / "x.png")


def test_the_picture_names_each_peak_as_the_table_does(recomputing_plan, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    legends, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()]), save(fig, *a, **k))[1])
    plan = recomputing_plan
    plot_timeline(plan, tmp_path / "t.png")
    (labels,) = legends
    table = plan.table()
    keep_all = next(label for label in labels if label.startswith("keep-all step"))
    eager = next(label for label in labels if label.startswith("PyTorch eager's peak"))
    assert plan.eager_peak_bytes != plan.baseline_peak_bytes  # two figures, each under its own name
    for label, figure in ((keep_all, plan.baseline_peak_bytes), (eager, plan.eager_peak_bytes)):
        assert f"{figure / 2**20:,.2f} MiB" in label
    assert "keep-all peak" in table and "PyTorch eager's peak" in table and not any(
        label.startswith("eager") for label in labels)
