"""Planner: joint graph -> Plan -> forward/backward graphs, as an AOTAutograd partition function.

Reads the joint graph AOTAutograd traces (its `meta["val"]`), costs it, builds the MemoryProblem,
solves it, and checks each candidate decision by simulating the forward and backward graphs it
produces; tightens the solver's budget until the simulated peak fits. Applying a given Plan instead
checks its fingerprint first. Writes `meta["fxmem"]` on joint nodes; keeps the Plan on `self.plan`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.fx

from fxmem.cost import DEVICE_PRESETS, CostTable, DeviceSpec, estimate
from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.memory import MemoryTimeline, simulate_step, storages_of
from fxmem.plan import Plan, graph_fingerprint
from fxmem.problem import eager_decision, saved_set
from fxmem.schedule import JointSplit, Lowered, build_problem, split_joint
from fxmem.solve import Solution, make_solution, min_peak, solve
from fxmem.passes.recompute import partition, tag_decisions
from fxmem.passes.runner import run_passes

MAX_TIGHTENINGS = 8
log = logging.getLogger("fxmem")
# Plans aim a little below the budget: the simulator sizes storages from fake tensors, and a few
# kernels allocate more than that (CPU mse_loss returns a scalar whose storage is the size of its
# input), plus autograd's seed gradient for the loss. 0.5% or 64 KiB, whichever is larger.
SAFETY_FRACTION, SAFETY_MIN_BYTES = 0.005, 64 * 1024


def safety_bytes(budget: int) -> int:
    return max(SAFETY_MIN_BYTES, int(budget * SAFETY_FRACTION))


@dataclass
class PlanRequest:
    """What to plan for: an absolute budget (bytes) or a plan to apply; the model and input signature."""

    budget_bytes: int | None = None
    plan: Plan | None = None
    device: DeviceSpec = field(default_factory=lambda: DEVICE_PRESETS["cpu"])
    solver: str = "auto"
    time_limit_s: float = 10.0
    model: str = ""
    signature: str = ""


@dataclass(frozen=True)
class _Candidate:
    recompute: frozenset[int]
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    timeline: MemoryTimeline


class Planner:
    """Callable as AOTAutograd's `partition_fn`."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self.plan: Plan | None = None

    def __call__(self, joint: torch.fx.GraphModule, _joint_inputs, *, num_fwd_outputs: int, **_kw
                 ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        self.num_fwd_outputs = num_fwd_outputs
        fingerprint = graph_fingerprint(joint)
        if self.request.plan is not None:
            plan = self.request.plan
            plan.check_applies(model=self.request.model, signature=self.request.signature,
                               fingerprint=fingerprint, torch_version=torch.__version__)
            self.plan = plan
            return self._partition(joint, plan.saved, plan.recompute)
        self.plan, fw, bw = self._make_plan(joint, fingerprint)
        return fw, bw

    def _partition(self, joint, saved, recomputed):
        run_passes(joint, [tag_decisions], saved, recomputed)
        return partition(joint, saved, num_fwd_outputs=self.num_fwd_outputs)

    def _candidate(self, joint, lowered: Lowered, recompute: frozenset[int]) -> _Candidate:
        names = _saved_names(lowered, recompute)
        fw, bw = partition(joint, names, num_fwd_outputs=self.num_fwd_outputs)
        return _Candidate(recompute, fw, bw, simulate_step(fw, bw, self.num_fwd_outputs))

    def _make_plan(self, joint: torch.fx.GraphModule, fingerprint: str):
        request = self.request
        budget = request.budget_bytes
        split = split_joint(joint, self.num_fwd_outputs)
        costs = estimate(joint, request.device, backward=set(split.backward))
        lowered = build_problem(joint, split, costs, budget)
        log.info("joint graph: %d forward and %d backward ops, %d values backward may need",
                 len(split.forward), len(split.backward), lowered.problem.num_values)
        eager = self._candidate(joint, lowered, eager_decision(lowered.problem))
        start = time.perf_counter()
        chosen, solution, min_budget = eager, None, None
        if eager.timeline.peak + safety_bytes(budget) > budget:
            chosen, solution, min_budget = self._fit(joint, lowered, split, budget)
        solve_time = time.perf_counter() - start
        saved = [n.name for n in chosen.bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
        forward_names = {n.name for n in split.forward}
        recomputed = [n.name for n in chosen.bw.graph.nodes
                      if n.op == "call_function" and n.name in forward_names and not costs[n.name].is_view]
        fw, bw = self._partition(joint, saved, recomputed)
        plan = Plan(
            budget_bytes=int(budget), baseline_peak_bytes=eager.timeline.peak,
            predicted_peak_bytes=chosen.timeline.peak, min_budget_bytes=min_budget,
            extra_flops=sum(costs[n].flops for n in recomputed), total_flops=costs.total_flops(),
            predicted_step_s=costs.total_seconds() + sum(costs[n].seconds for n in recomputed),
            baseline_step_s=costs.total_seconds(), recompute=tuple(recomputed), saved=tuple(saved),
            solver=solution.solver if solution else "none",
            solver_status=solution.status if solution else "optimal",
            solver_gap=solution.gap if solution else 0.0, solve_time_s=solve_time,
            device=request.device.name, model=request.model, signature=request.signature,
            fingerprint=fingerprint, torch_version=torch.__version__,
            breakdown=_breakdown(split), nodes=_node_rows(lowered, costs, set(saved), set(recomputed)))
        return plan, fw, bw

    def _fit(self, joint, lowered: Lowered, split: JointSplit, budget: int):
        """Solve, simulate, and tighten the solver's budget by the overshoot until the graphs fit."""
        request, problem = self.request, lowered.problem
        margin = safety_bytes(budget)
        budget -= margin
        target = budget
        best: tuple[_Candidate, Solution] | None = None
        for _ in range(MAX_TIGHTENINGS):
            if target <= 0:
                break
            solution = solve(dataclasses.replace(problem, budget=target), request.solver, request.time_limit_s)
            if solution.status == "infeasible":
                break
            candidate = self._candidate(joint, lowered, solution.recompute)
            log.info("%s: %s in %.1f s, simulated peak %s for budget %s", solution.solver, solution.status,
                     solution.solve_time_s, fmt_bytes(candidate.timeline.peak), fmt_bytes(budget))
            if candidate.timeline.peak <= budget:
                best = (candidate, solution)
                break
            target -= candidate.timeline.peak - budget
        if best is not None:
            return best[0], best[1], None
        started = time.perf_counter()
        log.info("searching for the least feasible budget")
        _, decision = min_peak(problem, request.time_limit_s)
        lowest = self._candidate(joint, lowered, decision)
        if lowest.timeline.peak <= budget:
            solution = make_solution(problem, decision, "feasible", 0, started, "min-peak")
            return lowest, solution, _with_margin(lowest.timeline.peak)
        breakdown = _breakdown(split)
        breakdown["smallest activation set"] = max(0, lowest.timeline.peak - sum(breakdown.values()))
        raise InfeasibleBudgetError(int(budget + margin), _with_margin(lowest.timeline.peak), breakdown)


def _with_margin(peak: int) -> int:
    """The least budget whose safety margin still leaves `peak` room."""
    return max(peak + SAFETY_MIN_BYTES, int(peak / (1 - SAFETY_FRACTION)) + 1)


def _saved_names(lowered: Lowered, recompute: frozenset[int]) -> list[str]:
    """Saved candidates plus every parameter, buffer and input (alive anyway; the extraction drops
    the ones backward does not read)."""
    names = [lowered.nodes[i].name for i in saved_set(lowered.problem, recompute)]
    return names + [p.name for p in lowered.primals]


def _breakdown(split: JointSplit) -> dict[str, int]:
    static, grads = {}, {}
    for node in split.primals:
        static.update(storages_of(node))
    for node in split.grads:
        grads.update(storages_of(node))
    return {"parameters, buffers and inputs": sum(static.values()), "gradients": sum(grads.values())}


def _node_rows(lowered: Lowered, costs: CostTable, saved: set[str], recomputed: set[str]) -> tuple[dict, ...]:
    rows = []
    for i, node in enumerate(lowered.nodes):
        cost = costs[node.name]
        decision = "save" if node.name in saved else "recompute" if node.name in recomputed else "free"
        rows.append({"name": node.name, "op": cost.op, "module": cost.module, "bytes": lowered.problem.size[i] if lowered.problem.can_save[i] else 0,
                     "flops": cost.flops, "seconds": cost.seconds, "decision": decision})
    return tuple(rows)
