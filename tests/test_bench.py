"""The benchmark's baselines train like eager, and the benchmark measures every method."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from fxmem import models
from tests.conftest import assert_trains_like

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import baselines  # noqa: E402
import bench  # noqa: E402


@pytest.mark.parametrize("name,block", [("gpt-tiny", "Block"), ("mlp-tiny", "HiddenLayer"),
                                        ("resnet-tiny", "BasicBlock"), ("unet-tiny", "ResBlock")])
def test_blocks_are_the_repeated_layers(name, block):
    found = baselines.blocks_of(models.from_name(name))
    assert {type(b).__name__ for b in found} == {block} and len(found) >= 2


@pytest.mark.parametrize("method", ["full-ac", "sqrt-n"])
def test_checkpointed_baselines_train_like_eager(method):
    model, inputs = models.from_name("gpt-tiny", dropout=0.0), models.example_inputs("gpt-tiny")
    wrapped = baselines.full_ac(model) if method == "full-ac" else baselines.sqrt_n(model, inputs)
    assert_trains_like(model, wrapped, inputs, atol=1e-6, rtol=1e-5)


def test_sqrt_n_needs_chained_blocks():
    model, inputs = models.from_name("unet-tiny"), models.example_inputs("unet-tiny")
    assert baselines.sqrt_n(model, inputs) is None


def test_bench_measures_every_method(tmp_path):
    out = tmp_path / "rows.json"
    code = bench.main(["--quick", "--models", "mlp-tiny", "--budgets", "0.3", "--repeats", "1",
                       "--time-limit", "1", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert code == 0
    methods = {r["method"] for r in rows}
    assert methods == {"eager", "full-ac", "sqrt-n", "torch-budget", "fxmem"}
    for r in rows:
        if r["method"] == "fxmem" and r["peak_mib"] is not None:
            assert r["within_budget"] is not False
    full = next(r for r in rows if r["method"] == "full-ac")
    if not torch.cuda.is_available():  # on a GPU mlp-tiny's 64 MiB of cuBLAS workspaces outweigh what it saves
        assert full["peak_mib"] < next(r for r in rows if r["method"] == "eager")["peak_mib"]
    assert any(r["setting"] == "@ full-ac" for r in rows)
    torch._dynamo.reset()
