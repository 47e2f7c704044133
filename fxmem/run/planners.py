"""Every specialisation of the planner (`fxmem.planner.planner.Planner`, AOTAutograd's partition function),
in one place: what each adds to planning one graph.

- `KeepingPlanner` (the engine): keeps the joint graph it is given (`fxmem.run.joint_cache`), and applies
  the plan it made when called again.
- `ProbePlanner` (a step Dynamo splits, its first forward): each graph's keep-all plan and joint, so its
  least is searched only where keeping everything does not fit (`fxmem.run.dynamo.shared_budget`).
- `RecordingPlanner` (the `torch.compile` backend and the engine's Dynamo path): records each graph's plan
  in the compile call's ledger, keeping to its share of the budget; writes it to `plan_out` when asked; on the
  backend's own path, a refusal waits for the graph that ends the frame (`fxmem.run.dynamo.step_least`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch

from fxmem.errors import GIB, InfeasibleBudgetError
from fxmem.planner.plan import graph_fingerprint
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.run.dynamo.compile import CompileSettings
from fxmem.run.dynamo import step_least
from fxmem.run.dynamo.ledger import GraphRecord, Ledger
from fxmem.run.dynamo.shared_budget import GraphShare, least_plan, saved_cap
from fxmem.run.joint_cache import keep

log = logging.getLogger("fxmem")

CAP_TRIES, CAP_STEP_BYTES = 4, 4096  # plans at tightened budgets before a graph keeps its least plan


class KeepingPlanner(Planner):
    """The planner, keeping the joint graph AOTAutograd gives it as traced (with `key`), and applying the
    plan it made when called again: planned on a joint kept, then traced when its step first runs."""

    key: tuple | None = None

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        if self.plan is not None:  # the plan as made (and as `plan_with_rewrites` states its chunks)
            self.request = dataclasses.replace(self.request, plan=self.plan)
        elif self.key is not None:
            keep(self.key, joint, num_fwd_outputs)
        return super().__call__(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


class ProbePlanner(Planner):
    """The planner of one graph of the probe: keeps its joint graph and keep-all plan, so its least
    is searched only when keeping everything does not fit the step."""

    def __init__(self, request, ledger: Ledger, record: GraphRecord):
        super().__init__(request)
        self.ledger, self.record = ledger, record
        self.runs = 1  # set by the probe: calls of this graph in the step that runs every layer

    def __call__(self, joint, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        fw, bw = super().__call__(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.joint, self.fingerprint = joint, graph_fingerprint(joint)
        self.record.plan = self.plan
        self.ledger.records.append(self.record)
        return fw, bw

    def least(self) -> GraphShare:
        """This graph's least plan: the least budget the planner names, then the plan made for it."""
        plan, bound = least_plan(self, self.joint, self.fingerprint)
        return GraphShare(self.record.index, self.request.capture, plan.predicted_peak_bytes, plan.saved_bytes,
                          plan, bound, self.runs)


def plan_path(plan_out: str | os.PathLike, index: int) -> str:
    """Where graph `index`'s plan is written: `plan.json` -> `plan.0.json`, `plan.1.json`, ..."""
    stem, ext = os.path.splitext(os.fspath(plan_out))
    return f"{stem}.{index}{ext or '.json'}"


class RecordingPlanner(Planner):
    """The fxmem Planner, recording its plan in the ledger."""

    def __init__(self, request: PlanRequest, ledger: Ledger, record: GraphRecord, settings: CompileSettings):
        super().__init__(request)
        self.ledger, self.record, self.settings = ledger, record, settings

    def _make_plan(self, joint, fingerprint):
        """The plan for the budget; where the step's graphs share it (`fxmem.run.dynamo.shared_budget`), one that
        keeps no more for backward than leaves every later graph room for its least plan (the budget
        tightened until it does, else this graph's least plan)."""
        self.joint, self.fingerprint = joint, fingerprint  # for its least, asked when the frame ends (step_least)
        shares = self.ledger.shares
        index = self.ledger.position(self.record)  # a recompiled frame: the graph it replaces
        if not shares and index == 0 and self.ledger.survey is None:  # this step refused before: its shares
            shares = self.ledger.shares = step_least.remembered(fingerprint, self.settings, self.request.budget_bytes)
        if not shares or index >= len(shares):
            return self._alone(joint, fingerprint)
        budget, earlier = self.request.budget_bytes, self.ledger.earlier_saved(self.record)
        least = shares[index]
        if least.plan.fingerprint != fingerprint:  # recompiled (its inputs in another order): its own least
            plan, _ = least_plan(self, joint, fingerprint)
            least = dataclasses.replace(least, plan=plan, peak=plan.predicted_peak_bytes - earlier,
                                        saved=plan.saved_bytes)
        if least.runs > 1:  # a loop's graph, run once per layer: each run at its least (fxmem.run.dynamo.shared_budget)
            return dataclasses.replace(least.plan, budget_bytes=budget, capture=self.request.capture,
                                       predicted_peak_bytes=least.peak + earlier + (least.runs - 1) * least.saved)
        cap = saved_cap(shares, index, budget, earlier)
        asked, target = self.request, budget
        try:
            for _ in range(CAP_TRIES):
                self.request = dataclasses.replace(asked, budget_bytes=target)
                try:
                    plan = super()._make_plan(joint, fingerprint)
                except InfeasibleBudgetError:
                    break
                if cap is None or plan.saved_bytes <= cap:
                    return dataclasses.replace(plan, budget_bytes=budget)
                target -= max(plan.saved_bytes - cap, CAP_STEP_BYTES)
        finally:
            self.request = asked
        log.info("fxmem: %s keeps its least plan, so that the graphs after it fit", asked.capture)
        return dataclasses.replace(least.plan, budget_bytes=budget, predicted_peak_bytes=least.peak + earlier,
                                   capture=asked.capture)

    def _alone(self, joint, fingerprint):
        """The plan for the budget with no shares known; on the backend's own path a graph whose least is above it
        and that more graphs follow is planned at its least, and the graph that ends the frame settles the step
        (`fxmem.run.dynamo.step_least`)."""
        self.record.planner = self
        try:
            plan = super()._make_plan(joint, fingerprint)
        except InfeasibleBudgetError:
            if not step_least.waits(self.ledger, self.record):
                raise
            self.record.refused = True
            plan, _ = least_plan(self, joint, fingerprint)
            plan = dataclasses.replace(plan, budget_bytes=self.request.budget_bytes)
        if step_least.pending(self.ledger, self.record):
            step_least.settle(self.ledger, self.record, self.settings)
        return plan

    def __call__(self, joint, joint_inputs, **kwargs):
        fw, bw = super().__call__(joint, joint_inputs, **kwargs)
        plan = self.plan
        self.record.plan = plan
        self.ledger.records.append(self.record)
        if self.settings.plan_out:
            self.record.path = plan_path(self.settings.plan_out, self.record.index)
            plan.save(self.record.path)
        if self.settings.verbose:
            forward, backward = self.record.held
            print(f"fxmem: graph {self.record.index}, budget {self.ledger.budget_bytes / GIB:.4f} GiB for the step"
                  + (f"; the rest of the step holds {forward / GIB:.4f} GiB during its forward, "
                     f"{backward / GIB:.4f} GiB during its backward" if backward else ""))
            print(plan.table())
        return fw, bw


def recording_planner(ledger: Ledger, settings: CompileSettings
                      ) -> Callable[[PlanRequest, GraphRecord], Planner]:
    """Each graph's planner for a compile call: its plan recorded in `ledger` (and written, and printed)."""
    return lambda request, record: RecordingPlanner(request, ledger, record, settings)
