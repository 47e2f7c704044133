"""The planning margin is measured: on the suite's models every measured peak is within the CPU margin
of the prediction, a refusal's breakdown states the margin, and a budget equal to the least named is
accepted."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.errors import InfeasibleBudgetError
from fxmem.planner.margin import FLOOR_BYTES, MARGINS, margin_for
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB


@pytest.mark.parametrize("kind", sorted(MARGINS))
@pytest.mark.parametrize("peak", [0, 1, 4096, 10**6, 30714 * 2**20])
def test_least_budget_is_the_least_that_leaves_the_peak_room(kind, peak):
    margin = MARGINS[kind]
    least = margin.least_budget(peak)
    assert least - margin.bytes_for(least) >= peak > least - 1 - margin.bytes_for(least - 1)


def test_gpus_get_their_measured_margin_and_the_cpu_its_own():
    assert margin_for("h100") is MARGINS["cuda"] and margin_for("cpu") is MARGINS["cpu"]
    assert MARGINS["cuda"].bytes_for(0) >= FLOOR_BYTES + 2 * 2**20  # the H100's largest error, 2.06 MiB


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    ids = torch.randint(0, 512, (4, 64))
    return transformers.GPT2LMHeadModel(config), (ids,), {"labels": ids}


def _zoo():
    from fxmem import models
    return models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny"), {}


@pytest.mark.parametrize("build", [_zoo, _gpt2], ids=["gpt-tiny", "transformers-gpt2"])
def test_measured_peaks_exceed_predictions_by_at_most_the_cpu_margin(build):
    model, args, kwargs = build()
    with pytest.raises(InfeasibleBudgetError) as refused:
        fxmem.plan(model, args, example_kwargs=kwargs, budget_gb=1e-6, time_limit_s=2)
    assert any(key.startswith("planning margin (64 KiB + the largest error measured on CPU")
               for key in refused.value.breakdown)
    least = refused.value.min_budget_bytes
    eager = measure_peak_bytes(copy.deepcopy(model), args, kwargs)
    for budget in (least, (least + eager) // 2):
        optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / GIB, time_limit_s=2)
        measured = measure_peak_bytes(optimized, args, kwargs)
        predicted = optimized.plan.predicted_peak_bytes
        assert measured <= budget
        assert measured - predicted <= MARGINS["cpu"].bytes_for(budget)
