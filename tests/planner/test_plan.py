"""Plan files: JSON round trip, tables, and refusing plans made for something else."""
from __future__ import annotations

import json

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.planner.plan import Plan


@pytest.fixture(scope="module")
def gpt_plan():
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny")
    inputs = models.example_inputs("gpt-tiny")
    eager = fxmem.plan(model, inputs)
    plan = fxmem.plan(model, inputs, budget_gb=0.75 * eager.baseline_peak_bytes / 2**30, time_limit_s=1)
    return model, inputs, plan


def test_json_round_trip(gpt_plan, tmp_path):
    _, _, plan = gpt_plan
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and list(data) == sorted(data)
    assert Plan.load(path) == plan


def test_table_lists_modules_and_summary(gpt_plan):
    _, _, plan = gpt_plan
    text = plan.table()
    for needle in ("blocks.0.attn", "recompute", "keep-all peak", "predicted peak", "budget", "solver"):
        assert needle in text
    assert "native_dropout" in plan.table(by="op")


def test_plan_for_another_model_is_refused(gpt_plan):
    _, _, plan = gpt_plan
    other = models.from_name("mlp-tiny")
    with pytest.raises(fxmem.PlanMismatchError, match="model"):
        fxmem.optimize(other, plan=plan)(*models.example_inputs("mlp-tiny"))


def test_plan_for_other_inputs_is_refused(gpt_plan):
    model, _, plan = gpt_plan
    with pytest.raises(fxmem.PlanMismatchError, match="inputs"):
        fxmem.optimize(model, plan=plan)(*models.example_inputs("gpt-tiny", batch_size=2))


def test_plan_for_another_config_is_refused(gpt_plan):
    _, inputs, plan = gpt_plan
    deeper = models.from_name("gpt-tiny", n_layer=3)
    with pytest.raises(fxmem.PlanMismatchError, match="graph"):
        fxmem.optimize(deeper, plan=plan)(*inputs)


def test_other_torch_version_is_named(gpt_plan, tmp_path):
    _, _, plan = gpt_plan
    data = json.loads(plan.to_json())
    data["torch_version"] = "1.0.0"
    with pytest.raises(fxmem.PlanMismatchError, match="torch"):
        Plan.from_json(json.dumps(data)).check_applies(
            model=plan.model, signature=plan.signature, fingerprint=plan.fingerprint, torch_version=torch.__version__)


def test_garbage_files_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(fxmem.PlanMismatchError, match="not a plan file"):
        Plan.load(bad)
    bad.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(fxmem.PlanMismatchError, match="schema"):
        Plan.load(bad)


@pytest.mark.parametrize("budget", [0, -1.0, float("nan")])
def test_nonpositive_budget(budget):
    with pytest.raises(ValueError, match="positive"):
        fxmem.plan(models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny"), budget_gb=budget)


def test_infeasible_budget_names_the_minimum():
    model = models.from_name("mlp-tiny")
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, models.example_inputs("mlp-tiny"), budget_gb=1e-6, time_limit_s=5)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.min_budget_bytes > 1e-6 * 2**30
    assert "minimum" in str(err) and "raise budget_gb" in str(err) and "gradients" in str(err)
    ok = fxmem.plan(model, models.example_inputs("mlp-tiny"), budget_gb=err.min_budget_bytes / 2**30,
                    time_limit_s=5)
    assert ok.predicted_peak_bytes <= err.min_budget_bytes


def test_fingerprint_is_the_same_in_another_process():
    import subprocess
    import sys

    code = ("from fxmem.planner.plan import graph_fingerprint; from fxmem import models; from fxmem.trace.capture import capture; "
            "print(graph_fingerprint(capture(models.from_name('gpt-tiny'), models.example_inputs('gpt-tiny'))))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    from fxmem.trace.capture import capture
    from fxmem.planner.plan import graph_fingerprint

    here = graph_fingerprint(capture(models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")))
    assert runs == {here}


def test_plan_files_from_before_fallback_pricing_still_load(gpt_plan):
    _, _, plan = gpt_plan
    data = json.loads(plan.to_json())
    assert data["fallback_ops"] == [] and data["priced_as"] == {}  # the zoo's GPT has a formula or traffic for every op
    older = {k: v for k, v in data.items() if k not in ("fallback_ops", "priced_as")}
    loaded = Plan.from_json(json.dumps(older))
    assert loaded == plan and loaded.fallback_ops == () and loaded.priced_as == {}
    assert "priced by memory traffic" not in loaded.table()
