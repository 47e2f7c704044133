"""Never above eager: at a budget that covers PyTorch eager's peak, the step measures at most eager's
peak; where fxmem's keep-all step would hold more, it runs eagerly and its plan says so."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxmem
from fxmem.run.eager_step import eager_plan
from fxmem.measure import measure_peak_bytes
from tests.conftest import GIB


def _mistral():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                        use_cache=False, attn_implementation="eager")
    return transformers.MistralForCausalLM(config), torch.randint(0, 1024, (2, 128))


@pytest.mark.parametrize("times_eager", [1.0, 1.5])
def test_at_a_budget_covering_eager_the_step_measures_at_most_eagers_peak(times_eager):
    model, ids = _mistral()
    reference = copy.deepcopy(model)
    eager = measure_peak_bytes(copy.deepcopy(model), (ids,), {"labels": ids})
    optimized = fxmem.optimize(model, budget_gb=times_eager * eager / GIB, time_limit_s=2)
    measured = measure_peak_bytes(optimized, (ids,), {"labels": ids})
    assert measured <= eager
    plan = optimized.plan
    assert plan.runs_eagerly == ("eagerly" in plan.table())
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = q.grad = None
    torch.manual_seed(3)
    loss = optimized(ids, labels=ids).loss
    loss.backward()
    torch.manual_seed(3)
    expected = reference(ids, labels=ids).loss
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_plan_above_eager_becomes_an_eager_plan_and_one_at_or_below_stays():
    from fxmem import models

    model = models.from_name("gpt-tiny")
    plan = fxmem.plan(model, models.example_inputs("gpt-tiny"), budget_gb=None)
    plan = dataclasses.replace(plan, budget_bytes=2 * plan.baseline_peak_bytes)
    assert eager_plan(plan, plan.baseline_peak_bytes) is None
    eager = eager_plan(plan, plan.baseline_peak_bytes - 1)
    assert eager.runs_eagerly and eager.predicted_peak_bytes == plan.baseline_peak_bytes - 1
    tight = dataclasses.replace(plan, budget_bytes=plan.baseline_peak_bytes)  # no room for the margin
    assert eager_plan(tight, plan.baseline_peak_bytes - 1) is None
    assert not eager.recompute and eager.extra_flops == 0
    again = fxmem.Plan.from_json(eager.to_json())
    assert again.runs_eagerly


def test_a_saved_eager_plan_runs_eagerly_when_applied():
    from fxmem import models

    model = models.from_name("gpt-tiny")
    inputs = models.example_inputs("gpt-tiny")
    plan = fxmem.plan(model, inputs, budget_gb=None)
    eager = eager_plan(dataclasses.replace(plan, budget_bytes=2 * plan.baseline_peak_bytes),
                       plan.baseline_peak_bytes - 1)
    optimized = fxmem.optimize(model, plan=eager)
    optimized(*inputs).backward()
    assert type(optimized._steps[next(iter(optimized._steps))]).__name__ == "EagerStep"
    assert optimized.plan is eager
