"""Memory on the device for the whole step that the step's graphs do not hold: the optimizer's state,
and the gradients a step accumulates into (gradient accumulation, `zero_grad(set_to_none=False)`).

Reads a Plan made for the budget less that memory, or the refusal of one; returns them as the user's
budget sees them: peaks, budgets and minima raised by the resident bytes, which appear in the
breakdown (one line per part), as `Plan.optimizer_state_bytes` and `Plan.resident_gradient_bytes`.
Writes nothing.
"""
from __future__ import annotations

import dataclasses

from fxmem.errors import InfeasibleBudgetError
from fxmem.planner.plan import Plan

LABEL = "optimizer state"
GRADIENTS = "gradients resident ({})"  # filled with fxmem.price.accumulation's description of them


def resident_parts(optimizer_bytes: int, gradient_bytes: int = 0, gradients: str = "") -> dict[str, int]:
    """The breakdown lines of what stays on the device for the whole step (zero parts left out)."""
    parts = {LABEL: optimizer_bytes} if optimizer_bytes else {}
    if gradient_bytes:
        parts[GRADIENTS.format(gradients or "accumulating")] = gradient_bytes
    return parts


def with_resident(plan: Plan, parts: dict[str, int], budget: int | None) -> Plan:
    """`plan` (made for `budget` less the `parts`) with the resident bytes counted in."""
    resident = sum(parts.values())
    return dataclasses.replace(
        plan, budget_bytes=budget if budget is not None else plan.budget_bytes + resident,
        baseline_peak_bytes=plan.baseline_peak_bytes + resident,
        predicted_peak_bytes=plan.predicted_peak_bytes + resident,
        min_budget_bytes=None if plan.min_budget_bytes is None else plan.min_budget_bytes + resident,
        breakdown={**parts, **plan.breakdown}, optimizer_state_bytes=parts.get(LABEL, 0),
        resident_gradient_bytes=resident - parts.get(LABEL, 0))


def refusal_with_resident(exc: InfeasibleBudgetError, parts: dict[str, int], budget: int) -> InfeasibleBudgetError:
    """The planner's refusal for `budget` less the `parts`, restated for the user's `budget`."""
    resident = sum(parts.values())
    bound = exc.lower_bound_bytes
    return InfeasibleBudgetError(budget, exc.min_budget_bytes + resident, {**parts, **exc.breakdown},
                                 lower_bound_bytes=None if bound is None else bound + resident, proven=exc.proven)
