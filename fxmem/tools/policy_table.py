"""Policies side by side: one training step planned under each named policy and a budget, for
`fxmem.estimate(..., policies=True)`.

Reads the model and example inputs; captures and traces the step once on fake tensors and plans its
joint graph once per policy (`Planner.plan_only`), so the rows are the plans `fxmem.plan(...,
policy=...)` makes, at the cost of one trace (none where the step was planned before:
`fxmem.run.joint_cache`). Returns `PolicyRow`s and their table (tabulate, under 120 columns). Writes nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tabulate import tabulate

from fxmem.trace.capture import capture
from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.run.eager_step import eager_peak_within, eager_plan
from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.run.joint_cache import partitioning
from fxmem.planner.plan import Plan
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.planner.policies import POLICIES, PolicyError, parse_policy


@dataclass(frozen=True)
class PolicyRow:
    """One policy's (or the budget's) plan, or why there is none (`refused`)."""

    name: str
    plan: Plan | None
    refused: str = ""

    def cells(self, baseline_s: float) -> list[str]:
        if self.plan is None:
            return [self.name, "-", "-", "-", "-", self.refused]
        p = self.plan
        extra = (p.predicted_step_s / baseline_s - 1) * 100 if baseline_s else 0.0
        values = [r for r in p.nodes if r.bytes > 0]
        recomputed = sum(r.decision == "recompute" for r in values)
        how = "runs eagerly (PyTorch's step holds less)" if p.runs_eagerly else (p.policy.split(": ", 1)[-1]
                                                                                  if p.policy else "the budget's plan")
        return [self.name, fmt_bytes(p.predicted_peak_bytes), f"+{extra:.1f}%", f"{p.extra_flops_pct:.1f}%",
                f"{recomputed} of {len(values)}", how]


def _plan_each(joint: torch.fx.GraphModule, num_fwd_outputs: int, requests: Sequence[tuple[str, PlanRequest]]
               ) -> list[PolicyRow]:
    """The joint graph planned once per request (the comparison runs nothing)."""
    rows = []
    with partitioning(joint):
        for name, request in requests:
            try:
                rows.append(PolicyRow(name, Planner(request).plan_only(joint, num_fwd_outputs)))
            except (InfeasibleBudgetError, PolicyError) as exc:
                rows.append(PolicyRow(name, None, _short(str(exc))))
    return rows


def _short(message: str, limit: int = 70) -> str:
    first = message.split(";")[0]
    return first if len(first) <= limit else first[:limit - 3] + "..."


def compare_policies(model: torch.nn.Module, args: tuple, kwargs: dict, request: PlanRequest,
                     policies: Sequence[str] = POLICIES,
                     eager_peak: Callable[[], int | None] | None = None) -> tuple[PolicyRow, ...]:
    """The plan of each policy (and of `request.budget_bytes`, when set) for one step of `model`
    (already the step's module: `fxmem.trace.step.planned_step`), from one trace on fake tensors.
    `eager_peak`: PyTorch eager's peak for the step (`fxmem.trace.step.Step.eager_peak`), measured
    at most once here otherwise."""
    from fxmem.run.engine import ANY_BUDGET, traced_joint

    requests = [(name, dataclasses.replace(request, policy=parse_policy(name), budget_bytes=None))
                for name in policies]
    if request.budget_bytes is not None:
        requests.append((f"budget {fmt_bytes(request.budget_bytes)}", dataclasses.replace(request, policy=None)))
    gm = capture(model, args, kwargs)
    rows = []
    eager_peak = eager_peak or functools.cache(lambda: eager_peak_bytes(model, args, kwargs))
    for row in _plan_each(*traced_joint(model, gm, args, kwargs), requests):
        is_speed = row.plan is not None and row.name == "speed"
        is_budget = row.plan is not None and row.name.startswith("budget ")
        if is_speed or is_budget:  # as fxmem.plan does: PyTorch's own step where it holds less
            eager = eager_peak_within(model, args, kwargs, ANY_BUDGET if is_speed else request.budget_bytes,
                                      request.resident_bytes, eager_peak)
            as_eager = eager_plan(row.plan, eager) if eager is not None else None
            row = dataclasses.replace(row, plan=as_eager or row.plan)
        rows.append(row)
    return tuple(rows)


def format_policies(rows: Sequence[PolicyRow]) -> str:
    """The policies' table: peak, extra step time over keeping everything, extra FLOPs, what is recomputed."""
    baseline = next((r.plan.baseline_step_s for r in rows if r.plan is not None), 0.0)
    headers = ["policy", "peak", "step time", "extra FLOPs", "recomputed", "what it does"]
    table = tabulate([r.cells(baseline) for r in rows], headers=headers, tablefmt="simple", maxcolwidths=[None] * 5 + [46])
    return ("policies (predicted; step time over keeping everything, as fxmem prices it)\n" + table)
