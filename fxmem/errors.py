"""The errors fxmem raises at its boundary: each says what was wrong, where, and the fix.

Reads and writes nothing.
"""
from __future__ import annotations

import math

GIB = 2**30


def fmt_bytes(nbytes: float) -> str:
    """Human-readable byte count: '3.40 GiB', '12.0 MiB', '512 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"


class FxmemError(Exception):
    """Base class of fxmem's own errors."""


def gb_at_least(nbytes: int) -> str:
    """nbytes in GiB, rounded up at three significant digits (a budget_gb that is enough)."""
    gb = nbytes / GIB
    decimals = max(0, 2 - math.floor(math.log10(gb))) if gb > 0 else 0
    return f"{math.ceil(gb * 10**decimals) / 10**decimals:.{decimals}f}"


class InfeasibleBudgetError(FxmemError, ValueError):
    """The budget is below the least memory a training step of this model can use."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int, breakdown: dict[str, int] | None = None):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.breakdown = dict(breakdown or {})
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.breakdown.items())
        super().__init__(
            f"budget {fmt_bytes(budget_bytes)} is below the minimum {fmt_bytes(min_budget_bytes)} "
            f"for this model and batch" + (f" ({parts})" if parts else "")
            + f"; raise budget_gb to at least {gb_at_least(min_budget_bytes)}, lower the batch size, "
            "or enable offload"
        )


class TraceError(FxmemError, RuntimeError):
    """The model could not be captured as a graph."""

    def __init__(self, construct: str, fix: str, detail: str = ""):
        self.construct = construct
        self.fix = fix
        msg = f"could not capture the model: {construct}. Fix: {fix}"
        if detail:
            msg += f"\n  (torch said: {detail.strip().splitlines()[0][:300]})"
        super().__init__(msg)


class PlanMismatchError(FxmemError, ValueError):
    """A plan was applied to a model, input signature or version it was not made for."""


class PackingError(FxmemError, ValueError):
    """Buffers given to the offset planner (`fxmem.pack_buffers`) are malformed."""
