"""The README's Quick start runs as written and does what it says: it trains like eager PyTorch,
its step is planned under the budget, and the step with AdamW's state measures within it."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_quick_start(optimize=None) -> dict:
    """Runs the Quick start from seed 0; with `optimize`, `fxmem.optimize` is replaced by it (and the
    plan table is not printed)."""
    import fxmem

    torch.manual_seed(0)
    scope: dict = {}
    text = quick_start() if optimize is None else quick_start().replace("print(step.plan.table())", "")
    code = compile(text, "README.md (Quick start)", "exec")
    if optimize is None:
        exec(code, scope)
        return scope
    real = fxmem.optimize
    fxmem.optimize = optimize
    try:
        exec(code, scope)
    finally:
        fxmem.optimize = real
    return scope


def test_quick_start_trains_like_eager_within_its_budget(capsys):
    pytest.importorskip("transformers")
    from fxmem.measure import _StepTracker, training_step

    planned = run_quick_start()
    assert "predicted peak" in capsys.readouterr().out  # the table was printed
    eager = run_quick_start(optimize=lambda model, **_: model)
    for (name, p), (_, q) in zip(planned["model"].named_parameters(), eager["model"].named_parameters()):
        assert torch.equal(p, q), name  # three AdamW steps through the plan equal eager's
    step, plan, ids = planned["step"], planned["step"].plan, planned["ids"]
    assert plan.recompute and plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert plan.budget_bytes == int(0.015 * 2**30) and plan.optimizer_state_bytes > 0
    tracker = _StepTracker()  # the step, with the optimizer's state held, by an independent meter
    tracker.track_external(step, planned["optimizer"], ids)
    with tracker:
        training_step(step, (), {"input_ids": ids, "labels": ids})
    measured = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert measured <= plan.budget_bytes
