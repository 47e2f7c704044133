"""Pipeline parallelism: choose stage boundaries with the stage solver, run them on torch.distributed.pipelining.

`plan_pipeline` (called by `fxmem.plan(..., num_stages=S)`) captures the model, costs AOTAutograd's
joint graph on fake tensors, sums forward+backward seconds and saved bytes per unit of the captured
graph, solves `fxmem.solve.stages`, and plans recompute inside any stage that only fits with it
(the engine's `plan_step` on that stage's module). `pipeline_stage` rebuilds one stage on a rank and
wraps it in a `PipelineStage`. Reads the model and inputs; writes nothing to disk.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.fx

from fxmem.trace.capture import capture
from fxmem.run.engine import OptimizedModule, plan_step, signature_of, traced_joint
from fxmem.errors import FxmemError, InfeasibleBudgetError, PlanMismatchError, fmt_bytes, gb_at_least
from fxmem.run.joint_cache import partitioning
from fxmem.passes.shard import crossing, split_stages, tag_units
from fxmem.planner.plan import PipelineSection, Plan, StageRow, graph_fingerprint
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.solve.stages import StageProblem, solve_stages, stage_cost
from fxmem.dist.stage_costs import (PipelineRequest, _example, _input_specs, baseline_cuts, build_problem,  # noqa: F401
                               layer_units, problem_from_plan)
from fxmem.meta_keys import PARAM_NAMES, tag

MAX_ROUNDS = 4
CHECK_TRIES = 4  # plans at the least a refusal names (raised each time) before naming it unchecked


def eager_plan_and_joint(model, args, kwargs, request: PlanRequest):
    """The whole model's eager plan (one microbatch) and the joint graph it was made from (traced once
    per step: `fxmem.run.joint_cache`)."""
    planner = Planner(dataclasses.replace(request, budget_bytes=None))
    gm = capture(model, args, kwargs)
    joint, num_fwd_outputs = traced_joint(model, gm, args, kwargs)
    with partitioning(joint):
        planner(joint, None, num_fwd_outputs=num_fwd_outputs)
    return planner.plan, joint, gm


def plan_pipeline(model: torch.nn.Module, args: tuple, kwargs: dict, plan_request, request: PipelineRequest) -> Plan:
    """The pipeline Plan: the whole model's eager plan for one microbatch, plus stages, balance and
    the recompute plans of stages that only fit with recompute. A refusal names a per-stage budget
    that planning at it was seen to meet (`_checked_refusal`)."""
    try:
        return _plan_pipeline_at(model, args, kwargs, plan_request, request)
    except InfeasibleBudgetError as refused:
        if plan_request.budget_bytes is None:
            raise
        raise _checked_refusal(refused, model, args, kwargs, plan_request, request) from None


def _checked_refusal(refused: InfeasibleBudgetError, model, args, kwargs, plan_request, request: PipelineRequest
                     ) -> InfeasibleBudgetError:
    """`refused`, naming the least per-stage budget found that the planner meets: the stage model's
    and the stage planners' figures are estimates (additive memory, the least of one stage), so the
    figure is planned at, and raised to what a refusal there names, until a plan is made."""
    budget = plan_request.budget_bytes
    least, checked = max(refused.min_budget_bytes, budget + 1), False
    for _ in range(CHECK_TRIES):
        try:
            _plan_pipeline_at(model, args, kwargs, dataclasses.replace(plan_request, budget_bytes=least), request)
            checked = True
            break
        except InfeasibleBudgetError as again:
            least = max(again.min_budget_bytes, least + max(least // 64, 1))
    error = InfeasibleBudgetError(budget, least, refused.breakdown, proven=False)
    found = (f"planned at {fmt_bytes(least)} per stage every stage fits" if checked else
             f"the least per-stage budget found is about {fmt_bytes(least)}, not yet seen to fit")
    error.args = (f"no split into {request.num_stages} pipeline stages fits {fmt_bytes(budget)} per stage once "
                  f"fxmem's planner checks each stage's step (with recompute); the least per-stage budget found: "
                  f"{found}; raise budget_gb to at least {gb_at_least(least)}, use more stages, fewer microbatches "
                  "in flight (schedule='1f1b'), or a smaller microbatch",)
    return error


def _plan_pipeline_at(model: torch.nn.Module, args: tuple, kwargs: dict, plan_request, request: PipelineRequest
                      ) -> Plan:
    if kwargs:
        raise FxmemError(f"pipeline planning takes positional inputs only, got keyword inputs {sorted(kwargs)}: "
                         "the first stage receives the schedule's positional microbatch arguments")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("no parameter requires grad: there is no training step to plan")
    _input_specs(args)
    budget_bytes, time_limit_s, solver = plan_request.budget_bytes, plan_request.time_limit_s, plan_request.solver
    base, joint, gm = eager_plan_and_joint(model, args, kwargs, plan_request)
    if request.schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {request.schedule!r}")
    units = tag_units(gm, model)
    m = request.n_microbatches or request.num_stages
    problem, readers = build_problem(gm, model, units, joint, base.saved_bytes_by_node(), budget_bytes=budget_bytes, request=request,
                                     device_name=base.device, n_microbatches=m)
    if problem.num_stages > problem.num_units:
        raise ValueError(f"num_stages={problem.num_stages} but the model has only {problem.num_units} units "
                         f"to place ({', '.join(problem.names)}); use fewer stages")
    cuts = crossing(gm, problem.num_units)
    needs: list[int] = []
    seen: dict[tuple[int, int, int], Any] = {}
    for _ in range(MAX_ROUNDS):  # the stage model proposes, fxmem's planner checks each stage's step
        try:
            solved = solve_stages(problem)
        except InfeasibleBudgetError:
            if not problem.excluded:
                raise
            raise _planner_infeasible(problem, budget_bytes, needs) from None
        modules = split_stages(gm, list(solved.cuts), problem.num_units)
        for k, st in enumerate(solved.stages):
            if (st.first, st.last, k) not in seen:
                seen[st.first, st.last, k] = _check_stage(modules[k], k, st, problem, cuts, args, budget_bytes,
                                                          time_limit_s, solver, needs)
        checked = [seen[st.first, st.last, k] for k, st in enumerate(solved.stages)]
        misfits = {(st.first, st.last, k) for k, (st, c) in enumerate(zip(solved.stages, checked)) if c is None}
        if not misfits:
            break
        problem = dataclasses.replace(problem, excluded=problem.excluded | misfits)
    else:
        raise _planner_infeasible(problem, budget_bytes, needs)
    stages = []
    for k, (st, (stage_plan, peak)) in enumerate(zip(solved.stages, checked)):
        # time: the eager stage plus what the stage's own recompute plan adds (not the model's every-unit guess)
        eager = stage_cost(problem, st.first, st.last, k)
        extra = stage_plan["predicted_step_s"] - stage_plan["baseline_step_s"] if stage_plan else 0.0
        params = sorted(name for name, users in readers.items() if any(st.first <= u <= st.last for u in users))
        stages.append(StageRow(
            index=k, modules=tuple(u.label for u in units[st.first:st.last + 1]),
            nodes=tuple(n for u in units[st.first:st.last + 1] for n in u.nodes),
            parameters=tuple(params), param_bytes=st.param_bytes, activation_bytes=st.act_bytes,
            in_flight=st.in_flight, predicted_peak_bytes=peak, time_s=eager.time_s + extra,
            compute_s=eager.compute_s + extra, transfer_s=eager.transfer_s,
            sends=tuple(n.name for n in cuts[st.last]) if st.last < problem.num_units - 1 else (),
            recompute=stage_plan is not None, plan=stage_plan,
            peak_from="stage model" if budget_bytes is None else "fxmem planner"))
    shared = tuple(sorted(name for name, users in readers.items()
                          if sum(any(s.first <= u <= s.last for u in users) for s in solved.stages) > 1))
    slowest = max(s.time_s for s in stages)
    section = PipelineSection(
        num_stages=problem.num_stages, schedule=problem.schedule, n_microbatches=m, optimizer=request.optimizer,
        stages=tuple(stages), balance=slowest / solved.lower_bound_s if solved.lower_bound_s else 1.0,
        lower_bound_s=solved.lower_bound_s, slowest_s=slowest, first_units=tuple(solved.cuts),
        num_units=problem.num_units, units=tuple(problem.names), graph_fingerprint=graph_fingerprint(gm),
        inputs=tuple(_input_specs(args)), shared_parameters=shared, link_bytes_per_s=problem.link_bytes_per_s,
        unit_time_s=tuple(problem.time_s), unit_recompute_s=tuple(problem.recompute_s),
        unit_param_bytes=tuple(problem.param_bytes), unit_act_bytes=tuple(problem.act_bytes),
        unit_ckpt_bytes=tuple(problem.ckpt_bytes), cut_bytes=tuple(problem.cut_bytes),
        shared=tuple((size, tuple(users)) for size, users in problem.shared),
        opt_bytes_per_param_byte=problem.opt_bytes_per_param_byte, budget_bytes=budget_bytes)
    peak = max(s.predicted_peak_bytes for s in stages)
    return dataclasses.replace(base, budget_bytes=int(budget_bytes) if budget_bytes is not None else peak,
                               predicted_peak_bytes=peak, pipeline=section)


def _stage_inputs(k: int, problem: StageProblem, cuts, args: tuple, first: int) -> list[torch.Tensor]:
    if k == 0:
        return [torch.zeros_like(a) for a in args]
    vals = [n.meta["val"] for n in cuts[first - 1]]
    return [torch.zeros(v.shape, dtype=v.dtype).requires_grad_(v.is_floating_point()) for v in vals]


def _planner_infeasible(problem: StageProblem, budget_bytes: int, needs: list[int]) -> InfeasibleBudgetError:
    """`needs`: the least stage budgets fxmem's planner reported for the stages it refused."""
    need = min(needs, default=budget_bytes + 1)
    err = InfeasibleBudgetError(budget_bytes, need, proven=False)  # the least the searches found, not a proof
    found = (f"the splits the stage model found feasible need at least {fmt_bytes(need)}" if needs else
             "every split the stage model found feasible needs more than that")
    raise_to = f"raise budget_gb to at least {need / 2**30:.3f}" if needs else "raise budget_gb"
    err.args = (f"no split into {problem.num_stages} pipeline stages fits {fmt_bytes(budget_bytes)} per stage: "
                f"{found} once fxmem's planner checks each stage's step (with recompute); {raise_to}, "
                "use more stages, fewer microbatches in flight (schedule='1f1b'), or a smaller microbatch",)
    return err


def _stage_request(module, inputs, budget: int | None, time_limit_s: float, solver: str) -> PlanRequest:
    return PlanRequest(budget_bytes=budget, solver=solver, time_limit_s=time_limit_s, model=type(module).__qualname__,
                       signature=signature_of(module, inputs, {}))


def _check_stage(module, k, st, problem: StageProblem, cuts, args, budget_bytes, time_limit_s, solver,
                 needs: list[int]):
    """(recompute plan as a dict or None, predicted stage peak) for one stage, or None if it cannot fit.

    The stage's peak: fxmem's simulated peak of one microbatch's step (its parameters, gradients,
    inputs, activations and temporaries), plus what the other microbatches in flight keep (the
    activations the step saves and their received inputs), plus optimizer state. Without recompute
    if that fits, else with fxmem's recompute plan under the budget that leaves, tightened until it fits."""
    if budget_bytes is None:  # nothing to check against: the stage model's (additive) estimate
        return None, st.memory_bytes
    inputs = _stage_inputs(k, problem, cuts, args, st.first)
    received = problem.cut_bytes[st.first - 1] if st.first else 0
    opt = int(st.param_bytes * problem.opt_bytes_per_param_byte)
    others = st.in_flight - 1
    eager = plan_step(module, inputs, {}, _stage_request(module, inputs, None, time_limit_s, solver))
    total = eager.baseline_peak_bytes + others * (eager.saved_bytes + received) + opt
    if total <= budget_bytes:
        return None, total
    # the least the other microbatches can keep: every unit checkpointed where that keeps less
    least_kept = sum(min(c, a) for c, a in zip(problem.ckpt_bytes[st.first:st.last + 1],
                                               problem.act_bytes[st.first:st.last + 1]))
    step_budget = min(eager.baseline_peak_bytes - 1, budget_bytes - opt - others * (least_kept + received))
    for _ in range(6):
        if step_budget <= 0:
            return None
        try:
            plan = plan_step(module, inputs, {}, _stage_request(module, inputs, step_budget, time_limit_s, solver))
        except InfeasibleBudgetError as exc:
            needs.append(exc.min_budget_bytes + opt + others * (least_kept + received))
            return None
        total = plan.predicted_peak_bytes + others * (plan.saved_bytes + received) + opt
        if total <= budget_bytes:
            return json.loads(plan.to_json()), total
        # a byte less in the step's budget is about a byte less kept for each other microbatch too
        step_budget -= max((total - budget_bytes) // (1 + others), 4096)
    needs.append(total)
    return None


def stage_modules(model: torch.nn.Module, plan: Plan) -> list[torch.fx.GraphModule]:
    """Every stage's module, rebuilt from the model as the plan says (checks the graph is the same)."""
    info = plan.pipeline
    if not info:
        raise PlanMismatchError("this plan has no pipeline stages; make it with fxmem.plan(..., num_stages=S)")
    args = [_example(spec) for spec in info.inputs]
    gm = capture(model, args)
    units = tag_units(gm, model)
    if graph_fingerprint(gm) != info.graph_fingerprint or len(units) != info.num_units:
        raise PlanMismatchError(f"the pipeline plan was made for another graph (model {plan.model}); make the plan "
                                "again for this model, configuration and torch version")
    return split_stages(gm, list(info.first_units), len(units))


def pipeline_stage(model: torch.nn.Module, plan: Plan, stage_index: int, device: torch.device | str,
                   group: Any = None):
    """This rank's `torch.distributed.pipelining.PipelineStage`. The stage module holds `model`'s own
    parameters under their original names (mapping `stage.fxmem_param_names`); where the plan
    recomputes inside the stage, the module runs the stage's plan as `fxmem.optimize` would."""
    from torch.distributed.pipelining import PipelineStage  # only on ranks that run stages

    num_stages = plan.pipeline.num_stages if plan.pipeline else 0
    if not 0 <= stage_index < max(num_stages, 1) or not num_stages:
        raise ValueError(f"stage_index {stage_index} is not a stage of this plan ({num_stages} stages)")
    module = stage_gm = stage_modules(model, plan)[stage_index].to(device)
    names = tag(module, PARAM_NAMES)
    stage_plan = plan.pipeline.stages[stage_index].stage_plan()
    if stage_plan is not None:
        module = OptimizedModule(module, lambda _, args, kwargs: PlanRequest(
            budget_bytes=stage_plan.budget_bytes, plan=stage_plan, model=type(stage_gm).__qualname__,
            signature=signature_of(stage_gm, args, kwargs)), loss_options=None, fixed_plan=True)
    # Static shapes from the plan (one microbatch): PipelineStage then skips its shape inference, which
    # runs the stage on uninitialised tensors (integer ids or targets there would be out of range).
    ins, outs = _stage_io(stage_gm, stage_index > 0)
    integers = [n.name for n, t in zip(stage_gm.graph.find_nodes(op="placeholder"), ins) if not t.is_floating_point()]
    if stage_index > 0 and integers and _receives_only_gradients():
        raise FxmemError(f"stage {stage_index} receives integer tensors ({', '.join(integers)}) from the stage before it, "
                         f"and this torch ({torch.__version__}) makes every tensor a stage receives require grad, which "
                         "integer tensors cannot: use torch 2.13 or later, or pass targets to the last stage through "
                         "the schedule (schedule.step(target=...) with a loss_fn) instead of through the model")
    stage = PipelineStage(module, stage_index, num_stages, torch.device(device), input_args=ins, output_args=outs,
                          group=group)
    stage.fxmem_param_names = names
    stage.fxmem_shared = {name: model.get_parameter(name) for name in plan.pipeline.shared_parameters}
    return stage


def _receives_only_gradients() -> bool:
    """True on torch releases (2.11 and earlier) whose `PipelineStage` calls `requires_grad_(True)` on
    every buffer it receives into when the schedule runs backward: integer tensors then fail there."""
    import inspect

    from torch.distributed.pipelining import PipelineStage

    return "r.buffer.requires_grad_(True)" in inspect.getsource(PipelineStage._prepare_forward_infra)


def _stage_io(gm: torch.fx.GraphModule, receives: bool) -> tuple[tuple, tuple]:
    """Meta tensors shaped like a stage's inputs and outputs for one microbatch."""
    def meta(node: Any, grad: bool = False) -> torch.Tensor:
        v = node.meta["val"]
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return t.requires_grad_(grad and t.is_floating_point())

    ins = tuple(meta(n, receives) for n in gm.graph.find_nodes(op="placeholder"))
    out = gm.graph.output_node().args[0]
    outs = tuple(meta(n, True) for n in (out if isinstance(out, (tuple, list)) else (out,)))
    return ins, outs


def sync_shared_grads(stages, group: Any = None) -> None:
    """Sum the gradients of parameters several stages read (tied embeddings) across all ranks.
    Call once on every rank after `schedule.step(...)` and before `optimizer.step()`, with this
    rank's stage or, for interleaved schedules, the list of its stages."""
    import torch.distributed as dist

    stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    held = {id(p) for stage in stages for p in stage.submod.parameters()}
    shared = stages[0].fxmem_shared
    for name in sorted(shared):
        param = shared[name]
        mine = id(param) in held
        grad = param.grad if mine and param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=group)
        if mine:
            param.grad = grad


def output_is_loss(output: torch.Tensor, target: Any = None) -> torch.Tensor:
    """`loss_fn` for a schedule whose model returns its own loss (pass any `target`, it is ignored)."""
    return output

