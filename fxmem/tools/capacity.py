"""Capacity search: the largest batch size whose plan fits a budget at an acceptable overhead.

Reads a factory `factory(batch_size) -> (model, example_inputs)` and plans each batch size it
tries on fake tensors (`fxmem.plan`: nothing runs). Returns a frozen `Capacity`; writes nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fxmem.api import plan as make_plan
from fxmem.error_boundary import public
from fxmem.errors import InfeasibleBudgetError
from fxmem.planner.plan import Plan

log = logging.getLogger("fxmem")
Factory = Callable[[int], "tuple[Any, Sequence[Any]]"]


@dataclass(frozen=True)
class Trial:
    batch_size: int
    fits: bool
    overhead: float | None  # predicted step time over eager's, minus 1; None when no plan fits
    reason: str


@dataclass(frozen=True)
class Capacity:
    """`batch_size` 0 when not even `min_batch` fits; `plan` is the plan for `batch_size`."""

    batch_size: int
    plan: Plan | None
    trials: tuple[Trial, ...]
    max_overhead: float

    def __int__(self) -> int:
        return self.batch_size

    def table(self) -> str:
        from tabulate import tabulate

        rows = [[t.batch_size, "yes" if t.fits else "no",
                 "-" if t.overhead is None else f"+{100 * t.overhead:.1f}%", t.reason]
                for t in sorted(self.trials, key=lambda t: t.batch_size)]
        body = tabulate(rows, headers=["batch", "fits", "predicted overhead", "why"], tablefmt="simple")
        return f"{body}\n\nlargest batch: {self.batch_size} (overhead at most {100 * self.max_overhead:.0f}%)"


def overhead(plan: Plan) -> float:
    """Predicted step time of the plan over the eager step's, minus 1 (0.05 is 5% slower)."""
    return plan.predicted_step_s / plan.baseline_step_s - 1 if plan.baseline_step_s else 0.0


def batch_search(factory: Factory, budget_gb: float, max_overhead: float = 0.1, *, min_batch: int = 1,
                 max_batch: int = 1 << 16, multiple_of: int = 1, **plan_kwargs: Any) -> Capacity:
    """Double the batch from `min_batch` until a plan no longer fits (or costs more than
    `max_overhead`), then bisect between the last that fit and the first that did not, over
    multiples of `multiple_of`. Assumes a larger batch never needs less memory. `plan_kwargs`
    go to `fxmem.plan`."""
    if multiple_of < 1 or min_batch < 1 or max_batch < max(min_batch, multiple_of):
        raise ValueError(f"need 1 <= min_batch <= max_batch and 1 <= multiple_of <= max_batch, got min_batch "
                         f"{min_batch}, max_batch {max_batch}, multiple_of {multiple_of}")
    if max_overhead < 0:
        raise ValueError(f"max_overhead is a fraction >= 0 (0.1 = 10% slower), got {max_overhead}")
    trials: dict[int, tuple[Trial, Plan | None]] = {}

    def fits(units: int) -> bool:
        batch = units * multiple_of
        model, inputs = factory(batch)
        try:
            plan = make_plan(model, inputs, budget_gb, **plan_kwargs)
        except InfeasibleBudgetError as exc:
            trial = Trial(batch, False, None, f"needs at least {exc.min_budget_bytes / 2**30:.4g} GiB")
            plan = None
        else:
            cost = overhead(plan)
            ok = cost <= max_overhead
            trial = Trial(batch, ok, cost, "fits" if ok else "fits, but too slow")
        log.info("batch %d: %s", batch, trial.reason)
        trials[batch] = (trial, plan if trial.fits else None)
        return trial.fits

    good, bad = 0, None  # in units of multiple_of
    units, top = -(-min_batch // multiple_of), max_batch // multiple_of
    while True:
        if not fits(units):
            bad = units
            break
        good = units
        if units == top:
            break
        units = min(2 * units, top)
    while good and bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    batch = good * multiple_of
    plan = trials[batch][1] if batch in trials else None
    return Capacity(batch, plan, tuple(t for t, _ in trials.values()), max_overhead)


@public
def max_batch_size(factory: Factory, budget_gb: float, max_overhead: float = 0.1, **kwargs: Any) -> int:
    """The largest batch size whose plan fits `budget_gb` with predicted overhead <= `max_overhead`
    (0 when even `min_batch` does not). See `batch_search` for the trials and the plan."""
    return batch_search(factory, budget_gb, max_overhead, **kwargs).batch_size
