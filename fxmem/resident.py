"""Memory on the device for the whole step that the step's graphs do not hold: the optimizer's state.

Reads a Plan made for the budget less that memory, or the refusal of one; returns them as the user's
budget sees them: peaks, budgets and minima raised by the resident bytes, which appear in the
breakdown and as `Plan.optimizer_state_bytes`. Writes nothing.
"""
from __future__ import annotations

import dataclasses

from fxmem.errors import InfeasibleBudgetError
from fxmem.plan import Plan

LABEL = "optimizer state"


def with_resident(plan: Plan, resident: int, budget: int | None) -> Plan:
    """`plan` (made for `budget - resident`) with the resident bytes counted in."""
    return dataclasses.replace(
        plan, budget_bytes=budget if budget is not None else plan.budget_bytes + resident,
        baseline_peak_bytes=plan.baseline_peak_bytes + resident,
        predicted_peak_bytes=plan.predicted_peak_bytes + resident,
        min_budget_bytes=None if plan.min_budget_bytes is None else plan.min_budget_bytes + resident,
        breakdown={LABEL: resident, **plan.breakdown}, optimizer_state_bytes=resident)


def refusal_with_resident(exc: InfeasibleBudgetError, resident: int, budget: int) -> InfeasibleBudgetError:
    """The planner's refusal for `budget - resident`, restated for the user's `budget`."""
    bound = exc.lower_bound_bytes
    return InfeasibleBudgetError(budget, exc.min_budget_bytes + resident, {LABEL: resident, **exc.breakdown},
                                 lower_bound_bytes=None if bound is None else bound + resident, proven=exc.proven)
