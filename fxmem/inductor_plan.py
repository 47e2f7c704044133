"""Plans for Inductor's code: the planner's decision checked against what Inductor's fused code holds,
and its target moved until that fits the budget.

The solver plans the unfused graph, where every value is a buffer; Inductor fuses pointwise chains into
their consumers, so the planned graphs hold less than planned for (1.5-1.7x less on the test GPTs).
Each try partitions a copy of Inductor's joint graph at a target, lowers and fuses the two graphs with
Inductor (no code made) and simulates the step on Inductor's buffers (`fxmem.inductor_memory`). The
target starts at the budget. Where the fused step leaves room under the budget, the target is raised by
that room, so less is recomputed; where it overshoots, lowered by the excess; a budget below the least
the planner finds for the unfused graph is tried at that least. The plan kept is the fastest whose fused
step fits the budget less the planning margin, stated for the budget, its predicted peak the fused one.
Where none fits, the refusal names the fused peak of the least plan plus the margin, which the next
call at that budget meets.

Reads the planner (`fxmem.planner.Planner`) and Inductor's joint graph; writes the plan on the planner.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch.fx

from fxmem.errors import InfeasibleBudgetError
from fxmem.inductor_memory import ScheduledGraph, simulate_fused
from fxmem.joint_cache import copy_joint, partitioning
from fxmem.plan import Plan

log = logging.getLogger(__name__)

MAX_TRIES = 4  # plans lowered by Inductor per budget (each one lowers both graphs)
CLOSE_ENOUGH = 0.01  # room under the budget, as a share of it, not worth another try


@dataclasses.dataclass
class _Try:
    plan: Plan
    peak: int  # the fused step's peak, with what the plan adds beside its graphs (resident bytes)
    timeline: Any


def fused_plan(planner: Any, joint: torch.fx.GraphModule, num_fwd_outputs: int,
               schedule: Callable[..., ScheduledGraph]) -> Plan:
    """The plan for `joint` whose step, as Inductor fuses it (`schedule(graph, is_backward)`), fits the
    planner's budget; sets `planner.plan`. Raises `InfeasibleBudgetError` naming the fused least."""
    request = planner.request

    def attempt(target: int | None) -> _Try:
        planner.request, planner.plan = dataclasses.replace(request, budget_bytes=target), None
        copied = copy_joint(joint)
        with partitioning(copied):
            fw, bw = planner(copied, None, num_fwd_outputs=num_fwd_outputs)
        plan = planner.plan
        timeline = simulate_fused(fw, bw, schedule(fw, False), schedule(bw, True), num_fwd_outputs,
                                  planner.allocator)
        beside = plan.predicted_peak_bytes - plan.timelines["plan"].peak
        log.info("target %d: unfused %d, fused %d bytes", target or 0, plan.predicted_peak_bytes,
                 timeline.peak + beside)
        return _Try(plan, timeline.peak + beside, timeline)

    try:
        budget = request.budget_bytes
        if budget is None or request.plan is not None:  # a policy's plan, or a plan given: its own peak
            found, least = attempt(budget), None
        else:
            found, least = _within(attempt, budget, budget - planner.margin.bytes_for(budget))
        if found is None:
            raise InfeasibleBudgetError(budget, planner.margin.least_budget(least.peak),
                                        {"step as Inductor runs it, least plan": least.peak})
    finally:
        planner.request = request
    plan = found.plan
    planner.plan = dataclasses.replace(
        plan, budget_bytes=budget if budget is not None else found.peak, predicted_peak_bytes=found.peak,
        min_budget_bytes=planner.margin.least_budget(least.peak) if least is not None else None,
        timelines={**plan.timelines, "plan": found.timeline})
    return planner.plan


def _within(attempt: Callable[[int], _Try], budget: int, limit: int) -> tuple[_Try | None, _Try | None]:
    """The fastest try whose fused peak is at most `limit`, and the least plan's try where one was made."""
    best = least = lowest = None
    target, tried = budget, set()
    for _ in range(MAX_TRIES):
        tried.add(target)
        try:
            found = attempt(target)
        except InfeasibleBudgetError as refusal:
            if least is not None or refusal.min_budget_bytes in tried:
                break
            target = refusal.min_budget_bytes  # the unfused least: planned there, it is met
            tried.add(target)
            found = least = attempt(target)
        if lowest is None or found.peak < lowest.peak:
            lowest = found
        if found.peak <= limit:
            if best is None or found.plan.predicted_step_s < best.plan.predicted_step_s:
                best = found
            room = limit - found.peak
            if room <= CLOSE_ENOUGH * budget or not found.plan.recompute:
                break
            target += room
        else:
            target -= found.peak - limit
        if target in tried or target <= 0:
            break
    return best, least or (lowest if best is None else None)
