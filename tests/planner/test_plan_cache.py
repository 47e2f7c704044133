"""The plan cache (fxmem/planner/plan_cache.py): a plan made once is read back, in this process or another,
equal to the one made; anything that decides a plan gives another entry; an entry that does not fit says so
in one line and is planned again; a folder that cannot be written plans without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fxmem
from fxmem import models
from fxmem import user_cache
from fxmem.planner import plan_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE", "1")
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    return tmp_path


def _entries(folder) -> list:
    return sorted((folder / "plans").glob("*.json")) if (folder / "plans").exists() else []


def _gpt():
    torch.manual_seed(0)
    return models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")


def _budget(model, inputs) -> float:
    return 0.8 * fxmem.plan(model, inputs, cache=False).baseline_peak_bytes / 2**30


def _solves(monkeypatch) -> list:
    """Counts the planner's fresh plans (a plan read from the cache makes none)."""
    from fxmem.planner.planner import Planner

    calls, fresh = [], Planner._fresh_plan
    monkeypatch.setattr(Planner, "_fresh_plan", lambda self, *a: calls.append(1) or fresh(self, *a))
    return calls


def test_a_plan_made_once_is_read_back_equal(cache, monkeypatch):
    model, inputs = _gpt()
    budget = _budget(model, inputs)
    solves = _solves(monkeypatch)
    first = fxmem.plan(model, inputs, budget, time_limit_s=2)
    made, kept = len(solves), len(_entries(cache))
    assert made >= 1 and kept == made  # each plan the planner made (the least search's too) is kept
    second = fxmem.plan(model, inputs, budget, time_limit_s=2)
    assert len(solves) == made  # read back: nothing solved again
    assert second.to_json() == first.to_json()
    fxmem.plan(model, inputs, budget * 0.95, time_limit_s=2)  # another budget: another plan
    assert len(solves) > made and len(_entries(cache)) > kept
    made, kept = len(solves), len(_entries(cache))
    fxmem.plan(model, inputs, budget, time_limit_s=2, cache=False)
    assert len(solves) > made and len(_entries(cache)) == kept


def test_an_optimized_module_trains_the_same_from_a_cached_plan(cache):
    model, inputs = _gpt()
    budget = _budget(model, inputs)
    grads, kept = [], []
    for _ in range(2):  # the second module's plan is read from the cache
        torch.manual_seed(0)
        fresh = models.from_name("gpt-tiny")
        optimized = fxmem.optimize(fresh, budget_gb=budget, time_limit_s=2)
        optimized(*inputs).backward()
        grads.append([p.grad for p in fresh.parameters()])
        kept.append(len(_entries(cache)))
        assert optimized.plan.recompute
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert kept[0] >= 1 and kept[1] == kept[0]


def test_a_second_process_reads_the_plan_the_first_made(cache):
    code = ("import torch, fxmem, sys\nfrom fxmem import models\nfrom fxmem.planner.planner import Planner\n"
            "torch.manual_seed(0)\nm, x = models.from_name('gpt-tiny'), models.example_inputs('gpt-tiny')\n"
            "made = []\nfresh = Planner._fresh_plan\n"
            "Planner._fresh_plan = lambda self, *a: made.append(1) or fresh(self, *a)\n"
            "p = fxmem.plan(m, x, float(sys.argv[1]), time_limit_s=2)\n"
            "print(len(made), p.predicted_peak_bytes, sorted(p.recompute))\n")
    budget = str(_budget(*_gpt()))
    env = {**os.environ, "FXMEM_CACHE": "1", "FXMEM_CACHE_DIR": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", code, budget], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    (made_first, *first), (made_second, *second) = (r.stdout.split(" ", 2) for r in runs)
    assert int(made_first) >= 1 and made_second == "0" and first == second


def test_an_entry_that_does_not_fit_is_planned_again_with_one_line(cache):
    model, inputs = _gpt()
    budget = _budget(model, inputs)
    made = fxmem.plan(model, inputs, budget, time_limit_s=2)
    entry = next(e for e in _entries(cache) if json.loads(e.read_text())["plan"]["budget_bytes"] == made.budget_bytes)
    entry.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the cache entry .*; planning again"):
        again = fxmem.plan(model, inputs, budget, time_limit_s=2)
    assert again.fingerprint == made.fingerprint
    data = json.loads(entry.read_text())  # written anew; now made for another graph
    data["plan"]["fingerprint"] = "0" * 16
    entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="made for another graph"):
        fxmem.plan(model, inputs, budget, time_limit_s=2)


def test_a_folder_that_cannot_be_written_plans_without_the_cache(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be
    monkeypatch.setenv("FXMEM_CACHE", "1")
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(blocked))
    user_cache._warned_unwritable.clear()
    model, inputs = _gpt()
    with pytest.warns(UserWarning, match="plans are not cached: .* cannot be written"):
        plan = fxmem.plan(model, inputs, _budget(model, inputs), time_limit_s=2)
    assert plan.recompute


def test_every_field_that_decides_a_plan_is_in_its_key():
    from fxmem.planner.planner import PlanRequest

    base = PlanRequest(budget_bytes=1 << 30)
    key = plan_cache.entry_key("f" * 16, base)[0]
    for change in ({"budget_bytes": 1 << 29}, {"solver": "greedy"}, {"time_limit_s": 5.0}, {"offload": True},
                   {"resident_bytes": 8}, {"inner": "inductor"}, {"chunk_loss": True}, {"held_bytes": (1, 2)}):
        assert plan_cache.entry_key("f" * 16, PlanRequest(**{**vars(base), **change}))[0] != key, change
    assert plan_cache.entry_key("e" * 16, base)[0] != key
    assert plan_cache.entry_key("f" * 16, PlanRequest(**{**vars(base), "cache": False}))[0] == key
