"""fxmem.fit_batch: the micro-batch size and accumulation steps chosen for a global batch run within the
budget on every micro-batch (MemTracker), and the table shows every candidate weighed."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.cli.main import main as cli_main
from fxmem.measure import measure_peak_bytes

GLOBAL = 4


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny", dropout=0.0)
    return model, models.example_inputs("gpt-tiny", GLOBAL)


def accumulate(module, parts, steps):
    for args, kwargs in parts:
        module(*args, **kwargs).div(steps).backward()


def test_fit_batch_runs_within_the_budget_and_accumulates_as_eager(gpt, capsys):
    model, (x, y) = gpt
    keep_all = fxmem.plan(model, (x, y))
    budget = int(0.8 * keep_all.predicted_peak_bytes)  # the whole global batch does not fit keeping all
    fit = fxmem.fit_batch(copy.deepcopy(model), (x, y), budget / 2**30, time_limit_s=0.5)
    table = capsys.readouterr().out
    assert fit.micro_batch * fit.steps == GLOBAL and f"{fit.steps} x {fit.micro_batch}" in table
    assert {c.micro_batch for c in fit.candidates} == {1, 2, 4} and "chosen" in table
    weighed = [c for c in fit.candidates if c.fits]
    assert fit.predicted_seconds_per_sample == min(c.seconds_per_sample for c in weighed)
    assert all(c.peak_bytes <= budget for c in weighed)
    parts = fit.split(x, y)
    assert len(parts) == fit.steps and all(a[0].shape[0] == fit.micro_batch for a, _ in parts)
    torch.testing.assert_close(torch.cat([a[0] for a, _ in parts]), x)
    accumulate(fit.module, parts, fit.steps)  # plans each signature
    fit.module.zero_grad(set_to_none=True)
    peaks = [measure_peak_bytes(fit.module, a, kw, warmup=False, keep_grads=True,
                                step=lambda m, i, k: m(*i, **k).div(fit.steps).backward()) for a, kw in parts]
    assert max(peaks) <= budget, (peaks, budget)
    eager = copy.deepcopy(model)
    eager(x, y).backward()
    for (name, p), q in zip(eager.named_parameters(), fit.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_fit_batch_refuses_a_budget_no_micro_batch_fits_and_a_wrong_global_batch(gpt):
    model, (x, y) = gpt
    mlp = models.from_name("mlp-tiny")  # no attention or loss to rewrite: a refusal is planned in seconds
    with pytest.raises(fxmem.InfeasibleBudgetError, match="raise budget_gb"):  # micro-batches of 2 and 1 refused
        fxmem.fit_batch(mlp, models.example_inputs("mlp-tiny", 2), 1e-6, time_limit_s=0.5, quiet=True)
    with pytest.raises(ValueError, match="global_batch 3 is not the first dimension"):
        fxmem.fit_batch(model, (x, y), 1.0, global_batch=3, quiet=True)


def test_cli_global_batch_prints_the_candidates(capsys):
    assert cli_main(["mlp-tiny", "--budget-gb", "1", "--global-batch", "4", "--time-limit", "0.5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch" in out and "global batch 4 = 1 x 4" in out  # 1 GiB keeps everything at once
    assert "--global-batch" in fxmem.cli.main._parser().format_help()


def test_a_costly_step_makes_fewer_larger_micro_batches_the_choice(gpt):
    """What a step costs beyond its kernels is paid once per micro-batch: where it dominates, the largest
    micro-batch that fits is the fastest per sample (and without it, the choice is the kernels')."""
    import dataclasses

    from fxmem.price.cost import DEVICE_PRESETS

    model, (x, y) = gpt
    costly = dataclasses.replace(DEVICE_PRESETS["cpu"], step_overhead_s=10.0)
    budget = 0.8 * fxmem.plan(model, (x, y)).predicted_peak_bytes / 2**30  # the whole batch recomputes
    fit = fxmem.fit_batch(model, (x, y), budget, device=costly, calibrate=False, time_limit_s=0.5, quiet=True)
    assert (fit.micro_batch, fit.steps) == (GLOBAL, 1)
    by_size = {c.micro_batch: c.seconds_per_sample for c in fit.candidates if c.fits}
    assert by_size[GLOBAL] < min(t for size, t in by_size.items() if size != GLOBAL)


def test_the_module_fit_batch_returns_computes_the_loss_fn(gpt):
    """`loss_fn=` reaches the optimized module as well as the plans: it is called with target= as the plans were."""
    model, (x, y) = gpt
    ce = lambda logits, target: torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())  # noqa: E731
    fit = fxmem.fit_batch(model, (x,), 1.0, loss_fn=ce, example_target=y, time_limit_s=0.5, quiet=True)
    ((args, kwargs),) = fit.split(x, target=y)
    torch.testing.assert_close(fit.module(*args, **kwargs), model(x, y), rtol=0, atol=0)
