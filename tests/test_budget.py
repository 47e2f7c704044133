"""Budgets (fxmem/budget.py): GiB to bytes once, with a clear refusal of anything else."""
from __future__ import annotations

import pytest

from fxmem.budget import budget_bytes, per_device_budgets


def test_gib_to_bytes():
    assert budget_bytes(2) == 2 * 2**30
    assert budget_bytes(0.5) == 2**29
    assert budget_bytes(None) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "2", 1e-12])
def test_nonpositive_or_not_a_number_is_refused(bad):
    with pytest.raises(ValueError, match="positive number of GiB"):
        budget_bytes(bad)


def test_infinite_budget_says_how_to_plan_without_one():
    with pytest.raises(ValueError, match="finite.*leave budget_gb out"):
        budget_bytes(float("inf"))


def test_per_device():
    assert per_device_budgets(1, 2) == [2**30, 2**30]
    assert per_device_budgets([1, 2], 2) == [2**30, 2 * 2**30]
    assert per_device_budgets(None, 3) is None
    with pytest.raises(ValueError, match="one per device"):
        per_device_budgets([1, 2, 3], 2)
