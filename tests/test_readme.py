"""The README's Quick start runs as written, and does what its comments say."""
from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(quick_start(), "README.md (Quick start)", "exec"), scope)
    plan, model = scope["plan"], scope["model"]
    assert plan.recompute and plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert (tmp_path / "plan.json").exists() and "fxmem plan for GPT" in capsys.readouterr().out
    assert all(p.grad is not None for p in model.parameters())  # model2 and model3 trained `model`
    assert scope["model3"].plans[0].budget_bytes == plan.budget_bytes
