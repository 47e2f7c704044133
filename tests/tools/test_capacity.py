"""max_batch_size / batch_search: the batch found fits the budget at the overhead allowed; one more does not."""
from __future__ import annotations

import pytest

import fxmem
from fxmem import models
from fxmem.tools.capacity import batch_search, max_batch_size, overhead
from tests.conftest import GIB

OPTS = dict(solver="greedy", time_limit_s=1)


def _factory():
    model = models.from_name("mlp-tiny")
    return lambda batch: (model, models.example_inputs("mlp-tiny", batch))


def _fits(factory, batch, budget_gb, max_overhead) -> bool:
    try:
        plan = fxmem.plan(*factory(batch), budget_gb=budget_gb, **OPTS)
    except fxmem.InfeasibleBudgetError:
        return False
    return overhead(plan) <= max_overhead


def test_largest_batch_fits_and_the_next_does_not():
    factory = _factory()
    budget_gb = fxmem.plan(*factory(1024)).baseline_peak_bytes * 1.2 / GIB  # room for about 1024..2048
    found = batch_search(factory, budget_gb, 0.1, min_batch=512, multiple_of=128, **OPTS)
    assert found.batch_size >= 1024 and found.batch_size % 128 == 0
    assert found.plan is not None and found.plan.signature.startswith(f"(float32[{found.batch_size},32]")
    assert found.plan.predicted_peak_bytes <= found.plan.budget_bytes == int(budget_gb * GIB)
    assert overhead(found.plan) <= 0.1
    assert not _fits(factory, found.batch_size + 128, budget_gb, 0.1)
    tried = {t.batch_size: t.fits for t in found.trials}
    assert tried[found.batch_size] and not any(fits for b, fits in tried.items() if b > found.batch_size)
    assert str(found.batch_size) in found.table()


def test_overhead_limit_and_nothing_fits():
    factory = _factory()
    budget_gb = fxmem.plan(*factory(1024)).baseline_peak_bytes * 0.95 / GIB  # 1024 only with recompute
    strict = max_batch_size(factory, budget_gb, max_overhead=0.0, min_batch=512, max_batch=1024, multiple_of=128,
                            **OPTS)
    assert 512 <= strict < 1024
    assert _fits(factory, strict, budget_gb, 0.0) and not _fits(factory, strict + 128, budget_gb, 0.0)
    assert max_batch_size(factory, 1e-6, **OPTS) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_batch"):
        batch_search(_factory(), 1.0, min_batch=0)
    with pytest.raises(ValueError, match="multiple_of"):
        batch_search(_factory(), 1.0, multiple_of=0)
    with pytest.raises(ValueError, match="max_overhead"):
        batch_search(_factory(), 1.0, max_overhead=-1)
