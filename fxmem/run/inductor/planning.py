"""Planning for Inductor: Inductor's own pipeline (`compile_fx`) with fxmem's planner as its partitioner,
and the plan fitted to the step as Inductor runs it.

`compile_with_partitioner` compiles a captured graph with a planner splitting Inductor's joint graph
(Inductor's joint-graph passes run first). `FusedPlanning` plans on fake tensors on Inductor's joint graph
(`inductor_joint`: traced once a graph, whatever the number of plans fitted on it), and stops Inductor once
the planned forward and backward graphs exist; each is then lowered and fused by Inductor, its code
generated and nothing compiled (`schedule`), and the step as that code runs it is simulated
(`fxmem.price.inductor_memory`) and priced (`fxmem.price.inductor_time`). The planner's target moves until the fused
step fits the budget (`FusedPlanning.fit`). Used by `fxmem.run.inductor.step` (`fxmem.optimize`) and by the
torch.compile backend.

Reads a captured graph and fake inputs; sets the planner's `plan`; writes nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode

from fxmem.run.joint_cache import copy_joint
from fxmem.stage_times import stage

FUSED_TRIES = 5  # plans made (each lowered by Inductor) to fit the fused step to a budget
# Inductor's settings while a plan is scheduled: C++ kernels generated without vectors, which read off the
# same buffers, reuse and kernel work (every schedule of gpt-small, GPT-2 and Llama planned, 44 of 44) in
# 30% less time than vectorized ones (scalar, vector and tail loops each generated)
SCHEDULE_CONFIG = {"cpp.simdlen": 1}


class _InductorPartitioner:
    """Wraps the planner as Inductor's `custom_partitioner_fn` (Inductor's joint-graph passes run first)."""

    def __init__(self, planner: Callable[..., Any]):
        self.planner = planner

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        return self.planner(gm, joint_inputs, **kwargs)

    def __deepcopy__(self, memo):
        # Inductor deep-copies its config to write repro strings; the planner holds the step's graphs
        # and plans (fake tensors under dynamic shapes), which neither need nor allow a copy.
        return self

    def uuid(self) -> Any:
        return None  # never cache: the plan depends on the budget and on the other graphs


def compile_with_partitioner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                             partitioner: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's compile_fx pipeline for `gm`, with `partitioner` (fxmem's planner) splitting the joint
    graph into forward and backward; caches off, since a plan depends on the budget, not only the graph."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class FxmemPartitioner(_InductorPartitioner, CustomPartitionerFn):
        pass

    with stage("compile"), torch._functorch.config.patch(enable_autograd_cache=False), \
            inductor_config.patch(custom_partitioner_fn=FxmemPartitioner(partitioner), fx_graph_cache=False):
        return compile_fx(gm, list(example_inputs))


def partition_only(gm: torch.fx.GraphModule, fakes: Sequence[Any], partitioner: Callable[..., Any]) -> None:
    """Runs Inductor's pipeline for `gm` up to its partitioner, which sees Inductor's joint graph (a
    `fxmem.run.engine.JointFingerprint` records it), and stops there: no plan made, no code."""

    joint, joint_inputs, kwargs = inductor_joint(gm, fakes)
    partitioner(joint, joint_inputs, **kwargs)


def inductor_joint(gm: torch.fx.GraphModule, fakes: Sequence[Any]) -> tuple[torch.fx.GraphModule, Any, dict]:
    """Inductor's joint graph of `gm` as its partitioner receives it (after Inductor's joint-graph passes),
    with the joint's inputs and the partitioner's keyword arguments: what a planner is called with."""
    found: list[Any] = []

    def keep(joint, joint_inputs, **kwargs):
        found[:] = [copy_joint(joint), joint_inputs, kwargs]
        raise _Planned

    try:
        compile_with_partitioner(gm, list(fakes), keep)
    except _Planned:
        pass
    return tuple(found)


class FusedPlanning:
    """Plans with `planner` for Inductor (`plan`), fitting the fused step to the budget. `call`: how the
    planner is called as a partitioner while fitting (the planner itself unless told: the torch.compile
    backend's records only the plan it compiles)."""

    def __init__(self, planner: Any, call: Callable[..., Any] | None = None):
        self.planner = planner
        self.call = call or planner
        self.timer: Any = None  # a KernelTimer for the aten kernels Inductor calls, where the planner calibrates
        self.scheduled: dict[str, tuple[Any, Any]] = {}  # planned graphs' code -> as Inductor schedules them
        self.joint: tuple[Any, ...] | None = None  # (gm, Inductor's joint graph of it, its inputs, the partitioner's kwargs)

    def plan_at(self, gm: torch.fx.GraphModule, fakes: list[Any], request: Any) -> tuple[Any, Any]:
        """The planner's plan for Inductor's joint graph of `gm` under `request` (Inductor makes no code), with
        the step as Inductor runs it: its peak and timeline (`timelines["inductor"]`, `fxmem.price.inductor_memory`)
        and its time (`fxmem.price.inductor_time`) as the plan's predictions; the unfused graph's peak stays in
        `timelines["plan"]`, and the step's time with nothing recomputed moves with the fused one."""
        from fxmem.price.inductor_memory import simulate_fused
        from fxmem.price.inductor_time import step_seconds
        from fxmem.planner.plan_facts import trained_parameters

        planner = self.planner
        planner.request, planner.plan = request, None
        if self.joint is None or self.joint[0] is not gm:  # Inductor traces a graph's joint once (seconds)
            self.joint = (gm, *inductor_joint(gm, fakes))
        _, joint, joint_inputs, kwargs = self.joint
        fw, bw = self.call(copy_joint(joint), joint_inputs, **kwargs)
        fw, bw, num_parameters = copy_joint(fw), copy_joint(bw), trained_parameters(joint, planner.num_fwd_outputs)
        key = _graphs_key(fw, bw)  # targets that give the same plan are scheduled once (seconds each on a CPU)
        if key not in self.scheduled:
            self.scheduled[key] = (schedule(fw, False),
                                   schedule(bw, True, donated_inputs(fw, bw, planner.num_fwd_outputs)))
        fused_fw, fused_bw = self.scheduled[key]
        fused = simulate_fused(fw, bw, fused_fw, fused_bw, planner.num_fwd_outputs, planner.allocator)
        plan = planner.plan
        if request.calibrate and self.timer is None:
            from fxmem.price.kernel_timer import KernelTimer

            self.timer = KernelTimer(next(t.device for t in fakes if isinstance(t, torch.Tensor)))
        seconds = step_seconds(fused_fw, fused_bw, request.device, num_parameters, self.timer)
        plan = dataclasses.replace(plan, predicted_peak_bytes=fused.peak, predicted_step_s=seconds,
                                   timelines={**(plan.timelines or {}), "inductor": fused},
                                   baseline_step_s=max(0.0, seconds - (plan.predicted_step_s - plan.baseline_step_s)))
        return plan, fused

    def plan(self, gm: torch.fx.GraphModule, fakes: list[Any]) -> None:
        """The plan whose step, as Inductor fuses it, fits the budget (`_fit_fused`), with the fused step's
        peak and time as its predictions (`_plan_at`). Without a budget, or under a policy, the fused step
        is only simulated."""
        planner = self.planner
        asked = planner.request
        budget = asked.budget_bytes
        try:
            if budget is None or asked.policy is not None:
                plan, fused = self.plan_at(gm, fakes, asked)
            else:
                plan, fused = self.fit(gm, fakes, asked, budget - planner.margin.bytes_for(budget))
        finally:
            planner.request = asked
        planner.plan = dataclasses.replace(plan, budget_bytes=plan.budget_bytes if budget is None else budget)

    def fit(self, gm, fakes, asked, limit: int) -> tuple[Any, Any]:
        """A plan whose fused step is within `limit` (the budget less the planning margin), and that step.
        The planner fits its problem to a target (first the budget; below the planner's least, that least),
        the fused step is simulated, and the target moves down by what it overshot (halfway to a target
        that fit) or up by what it left (at least 5%, doubling, halfway to a target that did not fit):
        at most `FUSED_TRIES` plans, each lowered by Inductor. The plan Inductor's own partitioner would
        make is tried too (`policies.FUSIBLE`: every pointwise op recomputed, the rest kept), which the
        unfused graph prices too high, and which, fused, may be the faster step even where nothing need be
        recomputed (a pointwise op recomputed inside its reader saves a write and a read). Of the plans that
        fit, the one predicted fastest; where none fits, the step with nothing recomputed is tried too, and the budget
        refused naming the least fused step tried."""
        from fxmem.errors import InfeasibleBudgetError
        from fxmem.planner.policies import FUSIBLE

        target, fits, over, refusal = asked.budget_bytes, [], [], None
        fitted = missed = None  # the largest target whose fused step fit; the least whose did not
        rise = 0
        for attempt in range(FUSED_TRIES):
            if attempt == FUSED_TRIES - 1 and not fits:
                target = 1  # the last try: the planner's least
            try:
                plan, fused = self.plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=target))
            except InfeasibleBudgetError as refused:
                if target >= refused.min_budget_bytes:
                    raise
                refusal, target = refused, refused.min_budget_bytes  # its least, planned instead
                plan, fused = self.plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=target))
            if fused.peak <= limit:
                fits.append((plan, fused))
                if not plan.recompute or fused.peak * 1.005 > limit:
                    break  # nothing recomputed, or the fused step just under the budget
                # the fused peak follows the target loosely (fusion frees more of a plan that recomputes
                # pointwise ops than the planner counts): rise by the room left, growing, at least 5%
                fitted, rise = max(fitted or 0, target), max(limit - fused.peak, 2 * rise, target // 20)
                step = target + rise
                if missed is not None:
                    step = min(step, (target + missed) // 2)
            else:
                over.append((plan, fused))
                missed = min(missed or target, target)
                # down by the overshoot; between a target that fit and this one, halfway (a small move
                # barely changes the fused step)
                step = target + limit - fused.peak if fitted is None else (fitted + target) // 2
            if step == target or refusal is not None and step < refusal.min_budget_bytes:
                break  # no other plan to try (below the planner's least: planned already)
            target = step
        # Inductor's own choice, whatever fit (where nothing need be recomputed too)
        plan, fused = self.plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=None, policy=FUSIBLE))
        (fits if fused.peak <= limit else over).append((plan, fused))
        if not fits:  # nothing recomputed, too: where recomputing does not shrink the fused step, it is the least
            plan, fused = self.plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=None, policy=None))
            (fits if fused.peak <= limit else over).append((plan, fused))
        if not fits:
            least = min(fused.peak for _, fused in over)
            raise InfeasibleBudgetError(asked.budget_bytes, self.planner.margin.least_budget(least),
                                        refusal.breakdown if refusal is not None else {}) from None
        return min(fits, key=lambda fit: fit[0].predicted_step_s)


def _graphs_key(*graphs: torch.fx.GraphModule) -> str:
    """What decides how Inductor schedules `graphs`: their code, and their inputs' shapes, strides and dtypes."""
    def described(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{value.dtype}{tuple(value.shape)}{value.stride()}"
        return repr(value)

    return "".join(g.code + ",".join(described(n.meta.get("val")) for n in g.graph.find_nodes(op="placeholder"))
                   for g in graphs)


class _Planned(Exception):
    """Raised by a plan-only partitioner once the plan is made: stops Inductor before code generation."""


def schedule(graph: torch.fx.GraphModule, is_backward: bool, donated: Sequence[int] = ()) -> Any:
    """`graph` (a planned forward or backward graph) as Inductor lowers and fuses it: its
    `fxmem.price.inductor_memory.ScheduledGraph`; no code is made. `donated`: backward's inputs AOTAutograd
    hands over to it (`donated_inputs`), whose storage Inductor may write a result into. Inductor runs with
    `SCHEDULE_CONFIG`."""
    from unittest import mock

    from torch._inductor import config as inductor_config

    from fxmem.price.inductor_memory import schedule_only

    inputs = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
    found: list[Any] = []
    mode = detect_fake_mode([x for x in inputs if isinstance(x, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext(), inductor_config.patch(SCHEDULE_CONFIG), \
            mock.patch("torch._inductor.graph.get_donated_idxs", lambda: list(donated) or None):
        schedule_only(found.append)(copy_joint(graph), inputs, is_backward=is_backward)
    return found[0]


def donated_inputs(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_user_outputs: int) -> list[int]:
    """The indices of `bw`'s inputs that AOTAutograd donates to Inductor's backward, as it finds them after
    partitioning (`collect_fw_donated_buffer_idxs`, under `torch._functorch.config.donated_buffer`): the
    values saved for backward that share no storage with forward's inputs, its user outputs or backward's
    outputs. Inductor may write a result into their storage (its in-place reuse)."""
    if not torch._functorch.config.donated_buffer:
        return []
    from torch._functorch._aot_autograd.graph_compile import collect_fw_donated_buffer_idxs

    from fxmem.price.memory import graph_outputs

    def val(node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else None

    outputs = graph_outputs(fw)
    saved = [n for n in outputs[num_user_outputs:] if isinstance(val(n), torch.Tensor)]
    found = collect_fw_donated_buffer_idxs([val(n) for n in fw.graph.find_nodes(op="placeholder")],
                                           [val(n) for n in outputs[:num_user_outputs]],
                                           [val(n) for n in graph_outputs(bw)], [val(n) for n in saved])
    names = {saved[i].name for i in found}
    return [i for i, node in enumerate(bw.graph.find_nodes(op="placeholder")) if node.name in names]
