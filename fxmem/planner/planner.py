"""Planner: joint graph -> Plan -> forward/backward graphs, as an AOTAutograd partition function.

Reads the joint graph AOTAutograd traces (its `meta["val"]`), costs it, builds the MemoryProblem,
solves it, and checks each candidate decision by simulating the forward and backward graphs it
produces; tightens the solver's budget until the simulated peak fits, then spends the slack the
solver's model leaves (`fxmem.planner.fitting`). On graphs of more than `LARGE_CANDIDATES` candidates, and
whenever the solver fits nothing, it also relaxes the least decision found to the budget and keeps
the cheaper. With offload allowed it plans recompute-only too and keeps the faster of the two plans
that fit. A named policy (`fxmem.planner.policies`) gives the decision instead of the solver ("memory": the
least budget found, then planned as a budget). Applying a given Plan instead checks its fingerprint
first. Then runs the step's passes (`STEP_PASSES`: recompute, rng, offload, pool) on the graphs for
that plan. Keeps the Plan on `self.plan`; writes what the passes write in `meta`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.fx

from fxmem.price.cost import DEVICE_PRESETS, HOST_LINKS, CostTable, DeviceSpec, estimate
from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.planner.fitting import lowest, refused_at_bound, relax_seconds, solved, spend_slack
from fxmem.price import price_record
from fxmem.price.kernel_timer import KernelTimer
from fxmem.planner.margin import margin_for
from fxmem.price.memory import EXACT, AllocatorModel, MemoryTimeline, simulate_step
from fxmem.passes.dropout_backward import eager_dropout_backward
from fxmem.passes.host_gradients import host_gradient_joint
from fxmem.passes.offload import offload, offload_pass
from fxmem.passes.pool import pool_pass, pool_stats
from fxmem.passes.recompute import partition, recompute_pass
from fxmem.passes.rng import replay_random_ops, rng_pass
from fxmem.passes.runner import StepGraphs, run_passes
from fxmem.planner.plan import Plan, PoolSection, graph_fingerprint
from fxmem.planner.plan_cache import cached_plan
from fxmem.planner.plan_facts import breakdown, graph_device, node_rows, timing, trained_parameters
from fxmem.planner.policies import Policy, describe, every_block_checkpointed, policy_recompute, policy_within_budget
from fxmem.solve.problem import MemoryProblem, eager_decision, offload_cost, recompute_cost, saved_set
from fxmem.planner.host_state import plan_with_host_state
from fxmem.planner.shape_reuse import decision_key, keep_seed, remember, reused, seeded, unseeded
from fxmem.planner.resident import refusal_with_resident, resident_parts, with_resident
from fxmem.price.joint_problem import JointSplit, Lowered, allow_offload, build_problem, split_joint
from fxmem.solve.recompute import least_peak, solve
from fxmem.solve.solution import Solution, make_solution
from fxmem.stage_times import stage

STEP_PASSES = (recompute_pass, rng_pass, offload_pass, pool_pass)

MAX_TIGHTENINGS = 8
LOWER_SHARE = 0.2  # of the time limit, for the in-order descent below the searches' least peak
# Beyond this many candidates the solvers prove nothing within seconds and often fit nothing below
# far more than the least: the least decision, relaxed, is offered beside theirs, each search with
# its share of the time limit.
LARGE_CANDIDATES, SOLVER_SHARE = 200, 0.5
log = logging.getLogger("fxmem")
# Values smaller than this are never offloaded: a copy's fixed cost outweighs the bytes it frees.
OFFLOAD_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: a budget in bytes (None: keep everything, as eager does) or a plan to apply;
    the device to price for, the solver, the model and input signature, offload and pool options."""

    budget_bytes: int | None = None
    plan: Plan | None = None
    device: DeviceSpec = field(default_factory=lambda: DEVICE_PRESETS["cpu"])
    solver: str = "auto"
    time_limit_s: float = 10.0
    model: str = ""
    signature: str = ""
    offload: bool = False
    offload_min_bytes: int = OFFLOAD_MIN_BYTES
    pool: bool | str = False
    calibrate: bool = False  # time the graph's kernels on the device here (fxmem.price.kernel_timer)
    resident_bytes: int = 0  # on the device for the whole step besides the graphs: the optimizer's state
    resident_gradient_bytes: int = 0  # gradients that exist when the step starts (fxmem.price.accumulation)
    resident_gradients: str = ""  # what they are, for the plan's table ("accumulating", zeros)
    # with offload: (name, optimizer-state bytes, value bytes) of each parameter whose state may live on the host,
    # in gradient order, and the host CPU's update rate (parameter bytes/s); the planner decides (planner/host_state.py)
    host_state: tuple[tuple[str, int, int], ...] = ()
    host_update_bytes_per_s: float = 0.0
    primal_names: tuple[str, ...] = ()  # the joint graph's parameter inputs by name, in order (passes/host_gradients.py)
    held_bytes: tuple[int, int] = (0, 0)  # what the step's other graphs hold during this graph's forward, backward
    capture: str = ""  # how the graph was captured, for the plan's table
    loss: str = ""  # where the step's loss is (fxmem.trace.loss), for the plan's table
    replay_random: bool = True  # random ops may be recomputed with their generator state (passes/rng.py)
    replay_ops: str = "functions"  # replayed through passes/rng.py's functions, or torch's ops ("torch", Inductor)
    inner: str = "aot_eager"  # the planned graphs run with eager kernels, or compiled by Inductor (fxmem.run.inductor.step)
    chunk_loss: bool = False  # the loss may be computed in chunks of tokens where the budget needs it (fxmem.planner.loss_chunks)
    policy: Policy | None = None  # a named policy (fxmem.planner.policies) decides instead of the budget
    cache: bool = True  # a plan made before for this graph and request is read from disk (fxmem.planner.plan_cache)
    refuse_at_bound: bool = False  # a budget under the peak's lower bound is refused naming it, no least searched


@dataclass(frozen=True)
class _Candidate:
    recompute: frozenset[int]
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    timeline: MemoryTimeline
    offloaded: frozenset[int] = frozenset()


class Planner:
    """Callable as AOTAutograd's `partition_fn`."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self.plan: Plan | None = None
        self.decided: tuple[MemoryProblem, frozenset[int]] | None = None  # the last plan's problem and decision (its estimates)
        self.gradient_sink = None  # where the backward graph's host gradients go (passes/host_gradients.py)
        self._seconds: dict[str, float] = {}  # per joint node, for timing offload copies
        self._views: frozenset[str] = frozenset()
        self.allocator = EXACT  # what the target device's allocator holds beside the tensors
        self.margin = margin_for(request.device.name)  # how far below the budget plans aim (fxmem.planner.margin)

    def __call__(self, joint: torch.fx.GraphModule, _joint_inputs, *, num_fwd_outputs: int, **_kw
                 ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        self.num_fwd_outputs = num_fwd_outputs
        eager_dropout_backward(joint)
        fingerprint = graph_fingerprint(joint)
        plan = self.request.plan
        if plan is not None:
            plan.check_applies(model=self.request.model, signature=self.request.signature,
                               fingerprint=fingerprint, torch_version=torch.__version__)
            device = _device_named(plan.device, self.request.device)
            self.allocator = AllocatorModel.for_device(device).holding(*self.request.held_bytes)
            link = HOST_LINKS.get(plan.host_link, device.host_link)
            if plan.offload:  # the copies are timed by the clock of the device and link the plan was made for
                self._price_copies(estimate(joint, device))
        else:
            plan, link = self._make_plan(joint, fingerprint), self.request.device.host_link
        joint, self.gradient_sink = host_gradient_joint(joint, plan.host_gradients, self.request.primal_names)
        graphs = StepGraphs(joint, num_fwd_outputs, seconds=self._seconds, host_link=link, pool=self.request.pool,
                            replay_ops=self.request.replay_ops)
        with stage("rewrite"):
            graphs = run_passes(graphs, plan, STEP_PASSES)
        if self.request.pool:
            plan = dataclasses.replace(plan, pool=self._pool_section(plan, graphs))
        self.plan = plan
        return graphs.fw, graphs.bw

    def plan_only(self, joint: torch.fx.GraphModule, num_fwd_outputs: int) -> Plan:
        """The plan for `joint` without partitioning it: several requests planned on one traced step
        (`fxmem.tools.policy_table`)."""
        self.num_fwd_outputs = num_fwd_outputs
        eager_dropout_backward(joint)
        return self._make_plan(joint, graph_fingerprint(joint))

    def _pool_section(self, plan: Plan, graphs: StepGraphs) -> PoolSection:
        """The arenas of the pooled graphs; an arena is held across its graph, so the pooled step is
        simulated again."""
        peak = simulate_step(graphs.fw, graphs.bw, graphs.num_fwd_outputs, self.allocator).peak
        if peak > plan.budget_bytes:
            log.warning("fxmem: pooled graphs hold their arenas across the graph; the simulated peak "
                        "%d bytes exceeds the budget %d bytes (unpooled %d)", peak, plan.budget_bytes,
                        plan.predicted_peak_bytes)
        return PoolSection(pool_stats(graphs.fw), pool_stats(graphs.bw), peak)

    def _offload(self, fw, bw, offloaded):
        if not offloaded:
            return fw, bw
        link = self.request.device.host_link
        if link is None:
            raise ValueError(f"device {self.request.device.name} has no host link to offload over; "
                             "give it one with DeviceSpec.with_link(...)")
        return offload(fw, bw, offloaded, self._seconds, link.seconds)

    def _price_copies(self, costs: CostTable) -> None:
        """Keep what the offload pass needs (node seconds) and which nodes are views, as plain,
        picklable values: Inductor pickles its partitioner, and so this object."""
        self._seconds = {name: c.seconds for name, c in costs.nodes.items()}
        self._views = frozenset(name for name, c in costs.nodes.items() if c.is_view)

    def _candidate(self, joint, lowered: Lowered, recompute: frozenset[int],
                   offloaded: frozenset[int] = frozenset()) -> _Candidate:
        with stage("simulate"):
            return self._simulated(joint, lowered, recompute, offloaded)

    def _simulated(self, joint, lowered: Lowered, recompute: frozenset[int], offloaded: frozenset[int]) -> _Candidate:
        names = _saved_names(lowered, recompute)
        fw, bw = partition(joint, names, num_fwd_outputs=self.num_fwd_outputs, lazy=True)  # simulated, never run
        # as rng_pass will: the simulation sees the saved generator states, as on the device planned for (a
        # GPU's: CUDA's seed and offset, on the host, not the 5056 bytes of a CPU generator where traced there)
        replay_random_ops(fw, bw, for_gpu=self.request.device.gpu)
        fw, bw = self._offload(fw, bw, [lowered.nodes[i].name for i in sorted(offloaded)])
        inlined = frozenset(lowered.nodes[i].name for i in recompute if lowered.problem.inlined(i))
        return _Candidate(recompute, fw, bw, simulate_step(fw, bw, self.num_fwd_outputs, self.allocator, inlined),
                          frozenset(offloaded))

    def _make_plan(self, joint: torch.fx.GraphModule, fingerprint: str) -> Plan:
        """The plan for this graph and request: read from the plan cache where it was made before (what
        making it sets on the planner set as for a given plan), else made and kept there."""
        made = []

        def make() -> Plan:
            made.append(True)
            return self._fresh_plan(joint, fingerprint)

        plan = cached_plan(fingerprint, self.request, make, {"num_fwd_outputs": self.num_fwd_outputs})
        if not made:
            self.allocator = AllocatorModel.for_device(self.request.device).holding(*self.request.held_bytes)
            if plan.offload:
                self._price_copies(estimate(joint, self.request.device))
        return plan

    def _fresh_plan(self, joint: torch.fx.GraphModule, fingerprint: str) -> Plan:
        """The plan for the budget less the resident bytes (`fxmem.planner.resident`: the optimizer's state, the
        gradients accumulated into), stated for the whole budget; with offload and `host_state`, the state's
        place (device or host) decided with it (`fxmem.planner.host_state`)."""
        request = self.request
        if request.offload and request.host_state and request.budget_bytes is not None and request.policy is None:
            return plan_with_host_state(request, lambda state, grads=(): self._resident_plan(
                host_gradient_joint(joint, grads, request.primal_names)[0], fingerprint, state),
                self.margin.bytes_for(request.budget_bytes))
        return self._resident_plan(joint, fingerprint, request.resident_bytes)

    def _resident_plan(self, joint: torch.fx.GraphModule, fingerprint: str, state_bytes: int) -> Plan:
        """The plan with `state_bytes` of optimizer state on the device."""
        request = self.request
        budget = request.budget_bytes
        parts = resident_parts(state_bytes, request.resident_gradient_bytes, request.resident_gradients)
        resident = sum(parts.values())
        policy = request.policy
        if not resident:
            return policy_within_budget(self._plan_within(joint, fingerprint, budget), policy, budget)
        if budget is not None and budget <= resident:
            raise InfeasibleBudgetError(budget, resident + 1, parts)
        try:
            plan = self._plan_within(joint, fingerprint, None if budget is None else budget - resident)
        except InfeasibleBudgetError as exc:
            raise refusal_with_resident(exc, parts, budget) from None
        plan = with_resident(plan, parts, None if policy else budget)
        if request.resident_gradient_bytes:
            plan = dataclasses.replace(plan, resident_gradients=request.resident_gradients)
        return policy_within_budget(plan, policy, budget)

    def _least_budget(self, joint, lowered: Lowered, split: JointSplit, budget: int | None) -> int:
        """The least budget found for the step (the "memory" policy); a `budget` below it is refused as
        any budget is."""
        try:
            self._fit(joint, lowered, split, 1)
        except InfeasibleBudgetError as exc:
            if budget is not None and budget < exc.min_budget_bytes:
                self._fit(joint, lowered, split, budget)  # raises the refusal a budget alone gets
            return exc.min_budget_bytes
        raise AssertionError("a one-byte budget was met")

    def _plan_within(self, joint: torch.fx.GraphModule, fingerprint: str, budget: int | None) -> Plan:
        with stage("solve"):  # what pricing and simulating inside leave is the search's own time
            return self._searched(joint, fingerprint, budget)

    def _searched(self, joint: torch.fx.GraphModule, fingerprint: str, budget: int | None) -> Plan:
        request = self.request
        split = split_joint(joint, self.num_fwd_outputs)
        timer = KernelTimer(graph_device(joint)) if request.calibrate else None
        with stage("price"):
            costs = estimate(joint, request.device, backward=set(split.backward), timer=timer and timer.seconds,
                             fused=request.inner == "inductor")
            price_record.flush()  # what was measured, for the next plan
            self._price_copies(costs)
            self.allocator = AllocatorModel.for_device(request.device).holding(*request.held_bytes)
            lowered = build_problem(joint, split, costs, budget or 0, self.allocator, request.replay_random,
                                    fused=request.inner == "inductor")
        if request.offload:
            lowered = allow_offload(lowered, split, costs, request.offload_min_bytes)
        log.info("joint graph: %d forward and %d backward ops, %d values backward may need",
                 len(split.forward), len(split.backward), lowered.problem.num_values)
        # not under Inductor (a fused step can hold less than this graph's bound) nor for host-state mixes (compared
        # by their leasts)
        if request.refuse_at_bound and budget is not None and request.policy is None and request.inner != "inductor" \
                and not request.host_state:
            refusal = refused_at_bound(lowered.problem, budget, self.margin.least_budget, breakdown(split, self.allocator))
            if refusal is not None:
                raise refusal
        eager = self._candidate(joint, lowered, eager_decision(lowered.problem))
        start = time.perf_counter()
        chosen, solution, min_budget = eager, None, None
        policy, described = request.policy, ""
        if policy is not None and policy.name == "memory":  # the least budget, then planned as any budget
            budget, described = self._least_budget(joint, lowered, split, budget), describe(policy, ())
        if policy is not None and policy.name != "memory":  # the policy decides; _make_plan checks the budget
            recompute, described = (policy_recompute(policy, lowered.problem, lowered.nodes, split.forward,
                                                     request.model)
                                    if policy.checkpoints else (eager.recompute, describe(policy, ())))
            chosen, budget = self._candidate(joint, lowered, recompute), None  # its budget: its peak
        elif budget is not None and eager.timeline.peak + self.margin.bytes_for(budget) > budget:
            key = decision_key(joint, request, (budget, self.num_fwd_outputs))
            try:
                simulate = lambda rec, off=frozenset(): self._candidate(joint, lowered, rec, off)  # noqa: E731
                target = budget - self.margin.bytes_for(budget)
                relax_s = relax_seconds(request.time_limit_s)
                found = reused(key, fingerprint, lowered, simulate, target) or seeded(lowered, simulate, target, relax_s)
                chosen, solution, min_budget = found or unseeded() or self._fit_both(joint, lowered, split, budget)
                remember(key, fingerprint, lowered.nodes, chosen.recompute, chosen.offloaded)
                keep_seed(lowered.nodes, chosen.recompute)
            except InfeasibleBudgetError:
                if eager.timeline.peak > budget:
                    raise
                # nothing fits under the margin, but the step as PyTorch runs it fits the budget itself
                log.info("no plan under the margin; the eager step fits the budget: keeping everything")
        if policy is not None and policy.name == "memory":
            min_budget = budget
        self.decided = (lowered.problem, chosen.recompute)
        solve_time = time.perf_counter() - start
        in_joint = {n.name for n in joint.graph.nodes}  # not the generator states passes/rng.py saves
        inputs = {n.name for n in joint.graph.find_nodes(op="placeholder")}  # unread ones: see partition(lazy=)
        saved = [n.name for n in chosen.bw.graph.find_nodes(op="placeholder")
                 if not n.name.startswith("tangents") and n.name in in_joint and (n.users or n.name not in inputs)]
        recomputed = _recomputed(chosen, split, self._views)
        offloaded = [lowered.nodes[i].name for i in sorted(chosen.offloaded)]
        exposed_s = offload_cost(lowered.problem, chosen.offloaded) / 1e9
        fixed_s = request.device.fixed_seconds(trained_parameters(joint, self.num_fwd_outputs))
        return Plan(
            budget_bytes=int(budget) if budget is not None else chosen.timeline.peak, policy=described,
            baseline_peak_bytes=eager.timeline.peak,
            predicted_peak_bytes=chosen.timeline.peak, min_budget_bytes=min_budget,
            extra_flops=sum(costs[n].flops for n in recomputed), total_flops=costs.total_flops(),
            predicted_step_s=costs.total_seconds() + fixed_s + sum(costs[n].seconds for n in recomputed) + exposed_s,
            baseline_step_s=costs.total_seconds() + fixed_s, recompute=tuple(recomputed), saved=tuple(saved),
            solver=solution.solver if solution else "policy" if policy is not None else "none",
            solver_status=solution.status if solution else "optimal",
            solver_gap=solution.gap if solution else 0.0, solve_time_s=solve_time,
            device=request.device.name, model=request.model, signature=request.signature, capture=request.capture,
            loss=request.loss, inner=request.inner,
            fingerprint=fingerprint, torch_version=torch.__version__,
            breakdown=breakdown(split, self.allocator),
            nodes=node_rows(lowered, costs, set(saved), set(recomputed), set(offloaded)),
            offload=tuple(offloaded), exposed_transfer_s=exposed_s,
            offloaded_bytes=sum(lowered.problem.size[i] for i in chosen.offloaded),
            host_link=request.device.host_link.name if request.offload and request.device.host_link else "",
            timing=timing(request.device, timer), graph_device=graph_device(joint).type,
            fallback_ops=costs.fallback_ops(), priced_as=costs.kernels(),
            timelines={"eager": eager.timeline, "plan": chosen.timeline})

    def _fit_both(self, joint, lowered: Lowered, split: JointSplit, budget: int):
        """`_fit` with offload allowed and recompute-only; the faster plan that fits (recompute-only on ties)."""
        problem = lowered.problem
        if not any(problem.can_offload):
            return self._fit(joint, lowered, split, budget)
        plain = dataclasses.replace(lowered, problem=dataclasses.replace(problem, can_offload=()))
        try:
            best = self._fit(joint, plain, split, budget)
        except InfeasibleBudgetError as error:
            best, refusal = None, error
        offloaded = self._fit(joint, lowered, split, budget, fallback=False)
        if offloaded is not None:
            def extra_s(fit) -> float:  # what the plan adds to the step, as predicted_step_s counts it
                return sum(self._seconds[n] for n in _recomputed(fit[0], split, self._views)) \
                    + offload_cost(problem, fit[0].offloaded) / 1e9
            if best is None or extra_s(offloaded) < extra_s(best):
                best = offloaded
        if best is None:
            raise refusal
        return best

    def _fit(self, joint, lowered: Lowered, split: JointSplit, budget: int, fallback: bool = True):
        """The cheaper of the solver's decision and the least decision, each with the slack it leaves
        spent (`fxmem.planner.fitting`), checked on the simulated graphs; the least is tried when the solver
        fits nothing or the problem is large (`LARGE_CANDIDATES`), there first, and the solver is not run where
        the least the search found on the solvers' own model is over the budget. Returns (candidate, solution, the
        least budget when it was searched), None when nothing fits and not `fallback`; raises
        `InfeasibleBudgetError` naming the least budget found otherwise."""
        request, problem = self.request, lowered.problem
        margin = self.margin.bytes_for(budget)
        budget -= margin
        simulate = lambda rec, offloaded=frozenset(): self._candidate(joint, lowered, rec, offloaded)
        relax_s = relax_seconds(request.time_limit_s)
        large, started = fallback and problem.num_values > LARGE_CANDIDATES, time.perf_counter()
        least = self._least(problem, large) if large else None  # searched whatever on large problems: first
        fitted = None
        if least is None or least.peak <= budget:  # else the solvers, on the model it searched, fit nothing
            fitted = self._solver_fit(problem, budget, margin,
                                      request.time_limit_s * (SOLVER_SHARE if large else 1), simulate)
        if fitted is not None:
            fitted = spend_slack(problem, *fitted, budget, simulate, relax_s)
        if not fallback or (fitted is not None and not large):
            return None if fitted is None else (*fitted, None)
        least = least or self._least(problem, large)
        low = lowest(problem, least.recompute, simulate, request.time_limit_s * LOWER_SHARE, self.allocator,
                     also=every_block_checkpointed(problem, lowered.nodes, split.forward))
        if low.timeline.peak <= budget:
            solution = make_solution(problem, low.recompute, "feasible", 0, started, "min-peak")
            relaxed = spend_slack(problem, low, solution, budget, simulate, relax_s)
            if fitted is None or recompute_cost(problem, relaxed[0].recompute) < recompute_cost(
                    problem, fitted[0].recompute):  # recompute-only both: offload plans never fall back
                fitted = relaxed
            return *fitted, self.margin.least_budget(low.timeline.peak)
        if fitted is not None:
            return *fitted, None
        parts = breakdown(split, self.allocator)
        parts["smallest activation set"] = max(0, low.timeline.peak - sum(parts.values()))
        parts[f"planning margin ({self.margin.describe()})"] = \
            self.margin.least_budget(low.timeline.peak) - low.timeline.peak
        bound = min(least.lower_bound, low.timeline.peak)
        raise InfeasibleBudgetError(int(budget + margin), self.margin.least_budget(low.timeline.peak), parts,
                                    lower_bound_bytes=self.margin.least_budget(bound), proven=least.proven)

    def _least(self, problem, large: bool):
        """`least_peak` of `problem`, within the share of the time limit the solvers leave it."""
        log.info("searching for the least feasible budget")
        return least_peak(problem, self.request.time_limit_s * (1 - SOLVER_SHARE if large else 1))

    def _solver_fit(self, problem, budget: int, margin: int, time_limit_s: float, simulate
                    ) -> tuple[_Candidate, Solution] | None:
        """The solver's decision at `budget`, its budget tightened by the simulated overshoot until
        the graphs fit (at most `MAX_TIGHTENINGS` solves); None when it finds nothing that fits."""
        target = budget
        for _ in range(MAX_TIGHTENINGS):
            if target <= 0:
                break
            solution = solved(solve, dataclasses.replace(problem, budget=target), self.request.solver, time_limit_s)
            if not solution.fits:  # "infeasible", or "unknown": nothing found within its limit
                break
            candidate = simulate(solution.recompute, solution.offloaded)
            log.info("%s: %s in %.1f s, simulated peak %s, budget %s less a %s margin", solution.solver,
                     solution.status, solution.solve_time_s, fmt_bytes(candidate.timeline.peak),
                     fmt_bytes(budget + margin), fmt_bytes(margin))
            if candidate.timeline.peak <= budget:
                return candidate, solution
            target -= candidate.timeline.peak - budget
        return None


def _saved_names(lowered: Lowered, recompute: frozenset[int]) -> list[str]:
    """Saved candidates plus every parameter, buffer and input (alive anyway; the extraction drops
    the ones backward does not read)."""
    names = [lowered.nodes[i].name for i in saved_set(lowered.problem, recompute)]
    return names + [p.name for p in lowered.primals]


def _recomputed(candidate: _Candidate, split: JointSplit, views: set[str] | frozenset[str]) -> list[str]:
    """Forward values the candidate's backward graph recomputes (`views` excluded: they are free)."""
    forward_names = {n.name for n in split.forward}
    return [n.name for n in candidate.bw.graph.nodes
            if n.op == "call_function" and n.name in forward_names and n.name not in views]


def _device_named(name: str, default: DeviceSpec) -> DeviceSpec:
    try:
        return DeviceSpec.from_name(name)
    except KeyError:
        return default
