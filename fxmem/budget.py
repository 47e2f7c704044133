"""Budgets as users give them (GiB, 2**30 bytes) turned into bytes, once, at the public API.

Reads and writes nothing. Everything below the API speaks bytes; `None` means "no budget" (plan the
eager step and report its own peak as the budget).
"""
from __future__ import annotations

import math
from fxmem.errors import GIB


def budget_bytes(budget_gb: object, name: str = "budget_gb") -> int | None:
    """GiB -> bytes, refusing anything but a finite positive number (None stays None)."""
    if budget_gb is None:
        return None
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or budget_gb != budget_gb:
        raise ValueError(f"{name} must be a positive number of GiB (2**30 bytes), got {budget_gb!r}")
    if math.isinf(budget_gb):
        raise ValueError(f"{name} must be a finite number of GiB, got {budget_gb!r}; to plan without a budget, "
                         f"leave {name} out (the plan then keeps everything, as eager does)")
    if budget_gb <= 0 or int(budget_gb * GIB) <= 0:
        raise ValueError(f"{name} must be a positive number of GiB (2**30 bytes), got {budget_gb!r}")
    return int(budget_gb * GIB)


def per_device_budgets(budget_gb: object, num_devices: int) -> list[int] | None:
    """One budget in bytes per device, from one number of GiB or a list of one per device."""
    if budget_gb is None:
        return None
    per = list(budget_gb) if isinstance(budget_gb, (list, tuple)) else [budget_gb] * num_devices
    if len(per) != num_devices:
        raise ValueError(f"budget_gb must be a positive number or one per device ({num_devices}), got {budget_gb!r}")
    return [budget_bytes(b) for b in per]  # type: ignore[misc]

