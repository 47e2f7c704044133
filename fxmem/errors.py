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
    """The budget is below the least memory a training step of this model was found to need.

    `min_budget_bytes`: the least budget a plan was found for. `proven`: no plan needs less (else the
    search ran out of time, and `lower_bound_bytes` is the least any plan could need)."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int, breakdown: dict[str, int] | None = None,
                 *, lower_bound_bytes: int | None = None, proven: bool = True):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.proven = proven or lower_bound_bytes is not None and lower_bound_bytes >= min_budget_bytes
        self.lower_bound_bytes = min_budget_bytes if self.proven else lower_bound_bytes
        self.breakdown = dict(breakdown or {})
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.breakdown.items())
        super().__init__(
            f"budget {fmt_bytes(budget_bytes)} is below {least_words(self)} for this model and batch"
            + (f" ({parts})" if parts else "")
            + f"; raise budget_gb to at least {gb_at_least(min_budget_bytes)}, "
            + ("" if self.proven else "give the solver more time (time_limit_s), ")
            + "lower the batch size, or enable offload"
        )


def least_words(exc: InfeasibleBudgetError) -> str:
    """'the minimum X' when proven, else 'the least budget found X (proven >= Y)'."""
    if exc.proven:
        return f"the minimum {fmt_bytes(exc.min_budget_bytes)}"
    bound = f" (proven >= {fmt_bytes(exc.lower_bound_bytes)})" if exc.lower_bound_bytes else ""
    return f"the least budget found, {fmt_bytes(exc.min_budget_bytes)}{bound}"


class TraceError(FxmemError, RuntimeError):
    """The model could not be captured as a graph."""

    def __init__(self, construct: str, fix: str, detail: str = ""):
        self.construct = construct
        self.fix = fix
        msg = f"could not capture the model: {construct}. Fix: {fix}"
        if detail:
            msg += f"\n  (torch said: {detail.strip().splitlines()[0][:300]})"
        super().__init__(msg)


class CallError(FxmemError, TypeError):
    """A planned step was called with inputs its model (or its `loss_fn`) does not take."""


class PlanMismatchError(FxmemError, ValueError):
    """A plan was applied to a model, input signature or version it was not made for."""


class PackingError(FxmemError, ValueError):
    """Buffers given to the offset planner (`fxmem.pack_buffers`) are malformed."""
