"""Where planning's time goes (fxmem/stage_times.py): every stage a plan runs is counted once, its own time
without the stages inside it, so the stages never add up to more than the call took."""
from __future__ import annotations

import time

import fxmem
from fxmem import models, stage_times


def test_nested_stages_count_their_own_time_once():
    with stage_times.recording() as seconds:
        with stage_times.stage("solve"):
            time.sleep(0.05)
            with stage_times.stage("simulate"):
                time.sleep(0.1)
    assert 0.05 <= seconds["solve"] < 0.1 <= seconds["simulate"]
    with stage_times.stage("solve"):  # outside recording: nothing counted, nothing raised
        pass
    assert set(seconds) == {"solve", "simulate"}


def test_a_plan_names_where_its_time_went():
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    budget = 0.8 * fxmem.plan(model, inputs, cache=False).baseline_peak_bytes / 2**30
    start = time.perf_counter()
    with stage_times.recording() as seconds:
        plan = fxmem.plan(model, inputs, budget, time_limit_s=2, cache=False)
    took = time.perf_counter() - start
    assert plan.recompute
    assert {"capture", "eager meter", "price", "solve", "simulate"} <= set(seconds)  # the joint: kept
    assert "rewrite" not in seconds  # fxmem.plan returns the plan alone: no graph is rewritten
    assert all(s >= 0 for s in seconds.values()) and sum(seconds.values()) <= took
    text = stage_times.table(seconds, took)
    assert text.startswith(f"where the {took:.2f} s of planning went:") and "  solve " in text
