"""The public front door: `fxmem.plan` and `fxmem.optimize`.

Reads the user's arguments: checks them and turns the budget into bytes once, then hands the work to
the planner that fits: pipeline stages (`fxmem.dist.pipeline`) with `num_stages`, device placement
(`fxmem.dist.placement`) with `devices`, otherwise one device's step (`fxmem.run.engine`). Writes nothing but
a progress line on stderr while planning on a terminal (`fxmem.progress.planning`).
"""
from __future__ import annotations

import contextlib
import logging

from dataclasses import replace
from typing import Any, Sequence

import torch

from fxmem.price.accumulation import accumulating_state
from fxmem.budget import budget_bytes, per_device_budgets
from fxmem.trace.call_check import check_model, check_solver
from fxmem.trace.capture import example_args
from fxmem.price.cost import DeviceSpec, preset_for
from fxmem.run.eager_step import eager_peak_within, eager_plan
from fxmem.run.engine import ANY_BUDGET, OptimizedModule, plan_step, signature_of
from fxmem.error_boundary import public
from fxmem.run.inductor.step import check_inner, default_inner, replays_random
from fxmem.trace.step import planned_step
from fxmem.trace.meta_device import planned_on, refuse_meta_model
from fxmem.price.host_update import host_update_bytes_per_s
from fxmem.price.optimizer_state import kind_of, model_state_bytes, per_parameter
from fxmem.run.host_optimizer import SUPPORTED, HostOptimizer, supports
from fxmem.dist.pipeline import PipelineRequest, plan_pipeline
from fxmem.dist.placement import PlacedModule, check_devices
from fxmem.planner.options import Loss, Pipeline, Solver, spelled_out
from fxmem.planner.plan import Plan
from fxmem.planner.planner import PlanRequest
from fxmem.planner.policies import Policy, PolicyError, parse_policy
from fxmem.progress import planning
from fxmem.planner.report import short_signature
from fxmem.trace.step_module import LossStep
from fxmem.trace.wrapper import presented
from fxmem.run.step_timer import measured_overheads

POOL_MODES = (False, True, "all")
log = logging.getLogger("fxmem")


def check_pool(pool: Any) -> bool | str:
    """`pool` must be False, True or "all"."""
    if not isinstance(pool, (bool, str)) or pool not in POOL_MODES:
        raise ValueError(f"pool must be False, True (pool what keeps each graph's peak) or \"all\", got {pool!r}")
    return pool


def check_time_limit(time_limit_s: Any) -> float:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0 \
            or time_limit_s == float("inf"):
        raise ValueError(f"time_limit_s must be a positive, finite number of seconds, got {time_limit_s!r}")
    return float(time_limit_s)


def device_spec(device: DeviceSpec | str | None, offload: bool = False,
                model: torch.nn.Module | None = None) -> DeviceSpec:
    """The device to plan for: a `DeviceSpec`, a preset name, or the preset of the device the
    model's parameters live on (a GPU by its name; the CPU preset otherwise)."""
    if isinstance(device, str):
        spec = DeviceSpec.from_name(device)
    else:
        spec = device or preset_for(model_device(model))
    if offload and spec.host_link is None:
        raise ValueError(f"offload=True needs a host link on device {spec.name}; "
                         "use DeviceSpec.with_link('pcie4' | 'pcie5' | 'nvlink-c2c')")
    return spec


def check_policy(policy: Policy | None, *, offload: bool = False, num_stages: int | None = None,
                 devices: Sequence[str] | None = None, plan: Plan | None = None) -> Policy | None:
    """A policy plans one device's keep/recompute decision: refused (one line) beside options that plan otherwise."""
    if policy is None:
        return None
    given = [name for name, value in (("plan=", plan), ("offload=True", offload or None), ("num_stages=", num_stages),
                                      ("devices=", devices)) if value is not None]
    if given:
        raise PolicyError(f"policy={policy.name!r} decides what one device keeps and recomputes; it does not combine "
                          f"with {given[0]} (pass budget_gb= for that, or the policy alone)")
    return policy


def model_device(model: torch.nn.Module | None) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu")) if model is not None \
        else torch.device("cpu")


def inner_for(model: torch.nn.Module, inner: str | None, plan: Plan | None, passes: bool) -> str:
    """What runs the planned graphs: `inner` if given, else what `plan` was made for (its graph is that
    compiler's), else `default_inner` for the model's device; a plan made for the other one is refused."""
    made_for = getattr(plan, "inner", "") or ("aot_eager" if plan is not None else "")
    if inner is None:
        inner = made_for or default_inner(model_device(model), passes)
    check_inner(inner)
    if made_for and inner != made_for:
        raise ValueError(f"plan= was made for inner={made_for!r}, whose graph differs from inner={inner!r}'s; "
                         f"pass inner={made_for!r}, or make a new plan with inner={inner!r}")
    return inner


def make_request(model: torch.nn.Module, args: tuple, kwargs: dict, *, budget: int | None, device: DeviceSpec,
                 solver: str, time_limit_s: float, offload: bool = False, pool: bool | str = False,
                 plan: Plan | None = None, calibrate: bool | None = None, optimizer: Any = None,
                 policy: Policy | None = None, inner: str = "aot_eager", cache: bool = True) -> PlanRequest:
    """What to plan for one input signature of `model` (budget in bytes, None: keep everything).
    `calibrate` None: time the kernels when the model is on a GPU (the device it will train on)."""
    where = model_device(model)
    if calibrate is None:
        calibrate = where.type == "cuda"
    if calibrate and where.type == "cpu" and not device.gpu:  # a step's fixed costs, as this CPU runs them
        # (on a GPU the host's work runs ahead of the kernels, so it adds to the step only where launch-bound)
        device = measured_overheads(device, where)
    name = getattr(model, "display_name", type(model).__qualname__)
    check_solver(solver)
    host = offload and optimizer is not None and plan is None and budget is not None and supports(optimizer)
    if offload and optimizer is not None and not isinstance(optimizer, (int, float)) and not supports(optimizer):
        log.warning("fxmem: %s's state stays on the device (host state: %s)", kind_of(optimizer)
                    if not isinstance(optimizer, str) else optimizer, ", ".join(SUPPORTED))
    return PlanRequest(budget_bytes=plan.budget_bytes if plan is not None else budget, plan=plan, device=device,
                       solver=solver, time_limit_s=time_limit_s, model=name,
                       signature=signature_of(model, args, kwargs), offload=bool(offload), pool=pool,
                       calibrate=bool(calibrate), resident_bytes=model_state_bytes(optimizer, model), chunk_loss=True,
                       policy=policy, inner=inner, replay_random=replays_random(inner),
                       replay_ops="torch" if inner == "inductor" else "functions", cache=bool(cache),
                       host_state=per_parameter(optimizer, model) if host else (),
                       host_update_bytes_per_s=host_update_bytes_per_s(_fused(optimizer)) if host else 0.0)


def _fused(optimizer: Any) -> bool:
    """Whether the optimizer runs torch's fused kernel (its host update then does too)."""
    return bool(getattr(optimizer, "param_groups", [{}])[0].get("fused"))


# the keywords `plan` and `optimize` take besides their own, with their defaults: a group's spellings, and
# `device` (the same as `target`) and `every_n` (the N of policy "every-N-layers")
PLAN_SPELLINGS = {"device": None, "every_n": None, "solver": "auto", "time_limit_s": 10.0, "calibrate": None,
                  "loss_fn": None, "example_target": None, "keep_outputs": None, "model_loss": True,
                  "num_stages": None, "schedule": "1f1b", "n_microbatches": None}
OPTIMIZE_SPELLINGS = {k: v for k, v in PLAN_SPELLINGS.items()
                      if k not in ("example_target", "num_stages", "schedule", "n_microbatches")}


def _options(function: str, given: dict[str, Any], known: dict[str, Any], **groups: Any) -> dict[str, Any]:
    """Every keyword `known` names, from `given` (an unknown one refused as Python refuses it), each group
    spelled out over them (`fxmem.planner.options`); `solver` may be a solver's name alone."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    options, solver = {**known, **given}, groups.pop("solver")
    if isinstance(solver, str):
        options["solver"] = solver
    else:
        options = spelled_out(solver, options, known, "solver")
    for name, group in groups.items():
        options = spelled_out(group, options, known, name)
    return options


@public
def plan(model: torch.nn.Module, example_inputs: Sequence[Any] = (), budget_gb: float | None = None, *,
         example_kwargs: dict[str, Any] | None = None, target: DeviceSpec | str | None = None,
         optimizer: str | float | None = None, loss: Loss | None = None, pipeline: Pipeline | None = None,
         solver: Solver | str = "auto", offload: bool = False, pool: bool | str = False,
         policy: str | None = None, accumulating: bool = False, eager_meter: bool = False, cache: bool = True,
         **spellings: Any) -> Plan:
    """Plan a training step of `model` on `example_inputs` under `budget_gb` without running it
    (fake tensors only). Without a budget the plan keeps everything (the eager step).
    `target` (same as `device`): the device to plan for, which need not be present; with
    `offload=True` saved values may also be copied to host memory over its host link. With `pool`, the
    plan also reports what pooling the forward and backward graphs into one arena each would give
    (`pool=True`: the intermediates whose pooling does not raise the graph's peak; `pool="all"`: all).
    With `num_stages`, `example_inputs` is one microbatch and `budget_gb` is per pipeline stage:
    see `fxmem.dist.pipeline` (`schedule` "1f1b" or "gpipe", `n_microbatches`, `optimizer` state).
    `calibrate`: price each kernel by timing it on the device here, and on a CPU a step's fixed costs (per
    step, parameter and view op: `fxmem.run.step_timer`) by timing small steps (default: when the model is on a
    GPU); otherwise, and for kernels it cannot time, the target's roofline prices them.
    `optimizer` (an optimizer, a name such as "adamw", or state bytes per parameter byte): its state is
    on the device for the whole step, so it is counted in the budget (so `budget_gb` can be the
    GPU's memory); with `num_stages`, per stage. With `offload=True` and Adam/AdamW, the planner decides which
    parameters' state lives on the host instead (`fxmem.planner.host_state`, docs/hostmem.md).
    `eager_meter`: also measure PyTorch eager's peak for the step (MemTracker on fake tensors, no
    real compute; `Plan.eager_peak_bytes`, a row of the table).
    `loss_fn`: plan the step `loss_fn(model(*example_inputs), example_target)` as a whole (see
    `fxmem.trace.step_module`); the model's outputs are held after the loss only with `keep_outputs`.
    Without `loss_fn`, a model whose output has a scalar `loss` with a gradient (transformers' `labels=`)
    is planned with that loss as the step's and its other outputs returned detached, counted until backward
    ends (`keep_outputs=False`: not returned; `model_loss=False`: every output keeps its gradient); a model with no scalar loss warns that its loss is outside the plan
    (`fxmem.trace.loss`). At a budget that covers PyTorch eager's peak where fxmem's keep-all step would
    hold more, the plan runs eagerly (`fxmem.run.eager_step`). `accumulating`: plan a micro-batch that
    accumulates into existing gradients (every trainable parameter's `.grad` resident from the start,
    `fxmem.price.accumulation`), as the second and later micro-batches of gradient accumulation run.
    `policy`: a named policy decides instead of a budget ("speed", "memory", "every-layer",
    "every-N-layers" or `every_n=N`, "sqrt": `fxmem.planner.policies`, docs/policies.md); with `budget_gb` too, the
    policy's plan where it fits the budget, else a `PolicyError` naming its peak.
    Related options come grouped (`fxmem.planner.options`): `loss=fxmem.Loss(fn, target, keep_outputs,
    from_model)` for `loss_fn=`, `example_target=`, `keep_outputs=`, `model_loss=`; `pipeline=fxmem.Pipeline(
    num_stages, schedule, n_microbatches)`; `solver=fxmem.Solver(name, time_limit_s, calibrate)` for `solver=`,
    `time_limit_s=`, `calibrate=`. Those keywords, and `device=` (the same as `target=`), work as before.
    `cache`: read a plan made before for the same graph and request from disk, and keep this one there
    (`fxmem.planner.plan_cache`: `FXMEM_CACHE_DIR`, `FXMEM_CACHE=0`)."""
    o = _options("plan", spellings, PLAN_SPELLINGS, loss=loss, pipeline=pipeline, solver=solver)
    device, every_n, solver, time_limit_s, calibrate = o["device"], o["every_n"], o["solver"], o["time_limit_s"], \
        o["calibrate"]
    loss_fn, example_target, keep_outputs, model_loss = o["loss_fn"], o["example_target"], o["keep_outputs"], \
        o["model_loss"]
    num_stages, schedule, n_microbatches = o["num_stages"], o["schedule"], o["n_microbatches"]
    check_model(model)
    policy = check_policy(parse_policy(policy, every_n), offload=offload, num_stages=num_stages)
    args, kwargs = example_args(example_inputs), dict(example_kwargs or {})
    if loss_fn is not None:
        model, kwargs = LossStep(model, loss_fn, bool(keep_outputs)), {**kwargs, "target": example_target}
    elif example_target is not None:
        raise ValueError("example_target= goes with loss_fn=")
    spec = device_spec(target or device, offload, model)
    if num_stages is None:  # eager's peak is measured with the outputs' reading where a budget or the table needs it
        with planned_on(model, spec):  # a meta model's outputs are read on the device it is planned for
            stepped = planned_step(model, args, kwargs, model_loss, keep_outputs is not False, measure=(
                budget_gb is not None or eager_meter or (policy is not None and policy.name == "speed")))
        model, loss, held_outputs = stepped.module, stepped.loss, stepped.naming_held_outputs()
    else:
        loss, held_outputs = "", contextlib.nullcontext()
    budget = budget_bytes(budget_gb)
    check_pool(pool)
    request = make_request(model, args, kwargs, budget=budget, device=spec,
                           solver=solver, time_limit_s=check_time_limit(time_limit_s), offload=offload, pool=pool,
                           calibrate=calibrate, optimizer=None if num_stages is not None else optimizer,
                           policy=policy, cache=cache)
    grads = accumulating_state(model) if accumulating and num_stages is None else None
    request = replace(request, loss=loss, resident_gradient_bytes=grads.bytes if grads else 0,
                      resident_gradients=grads.description if grads else "")
    resident = request.resident_bytes + request.resident_gradient_bytes
    if num_stages is not None and accumulating:
        raise ValueError("accumulating=True plans one device's accumulating micro-batch; pipeline stages "
                         "(num_stages=) accumulate over their microbatches already")
    if num_stages is not None and (offload or pool):
        raise ValueError("num_stages= plans pipeline stages; offload= and pool= apply to one device's step, "
                         "not yet to pipeline stages")
    with planning(f"planning {request.model} {short_signature(request.signature)}", request.time_limit_s), \
            planned_on(model, request.device), held_outputs:  # a meta model: its fakes on the device it is planned for
        if num_stages is not None:
            return plan_pipeline(model, args, kwargs, request,
                                 PipelineRequest(num_stages, schedule, n_microbatches, optimizer))
        made = plan_step(model, args, kwargs, request)
        eager = eager_peak_within(model, args, kwargs, budget if policy is None else
                                  ANY_BUDGET if policy.name == "speed" else None, resident, stepped.eager_peak)
        made = (eager_plan(made, eager) if eager is not None else None) or made
        if eager_meter and not made.runs_eagerly:
            measured = stepped.eager_peak()
            made = replace(made, eager_peak_bytes=None if measured is None else measured + resident)
        return made


@public
def optimize(model: torch.nn.Module, *, budget_gb: float | None = None, plan: Plan | None = None,
             target: DeviceSpec | str | None = None, optimizer: Any = None, loss: Loss | None = None,
             solver: Solver | str = "auto", inner: str | None = None, offload: bool = False,
             devices: Sequence[str] | None = None, pool: bool | str = False, policy: str | None = None,
             cache: bool = True, **spellings: Any) -> OptimizedModule | PlacedModule:
    """A module that trains like `model` with its step planned under `budget_gb` (planned lazily at the
    first call, from the real inputs; re-planned per input signature), or running a given `plan`.
    `offload=True` lets the planner copy saved values to host memory (see `plan`); `devices` places
    contiguous regions of the model on several devices, `budget_gb` per device. With `pool`, each
    forward and backward graph allocates one arena for its intermediates (passes/pool.py):
    `pool=True` those whose pooling does not raise the graph's peak, `pool="all"` every one; the
    plans in `.plans` then carry the pool's stats. `calibrate`: see `plan`. With `loss_fn`, the module
    is called as `loss = opt(*inputs, target=y)`, which is `loss_fn(model(*inputs), y)` planned as one
    step (with `keep_outputs`, `(loss, outputs)`). `optimizer`: its state counts in the budget (see `plan`); with
    `offload=True` (or a `plan` keeping state on the host) and Adam/AdamW, step `module.fxmem_optimizer` instead
    (`fxmem.run.host_optimizer.HostOptimizer`: the host part's update runs where its state is).
    Without `loss_fn`, a model called with `labels=` (an output with a scalar `loss`) trains as
    `model(...).loss.backward()` does, planned from its loss, other outputs returned detached until a call is
    seen dropping its output before backward, then not returned (`fxmem.trace.loop`; `keep_outputs=True`: always
    returned, `keep_outputs=False`: the loss alone); `model_loss=False` keeps a gradient on every output (see
    `plan`). The optimized module's `.plan` is
    the plan of the input signature it saw last, `.plans` all of them. `policy`, `every_n`: a named policy
    instead of (or checked against) `budget_gb`, see `plan`. `inner="inductor"`: Inductor compiles the planned
    step (fused kernels; fxmem's planner decides what backward keeps and recomputes: `fxmem.run.inductor.step`);
    "aot_eager" runs it with eager kernels and trains bit for bit as eager does. Default: "inductor" for a
    model on a GPU, else "aot_eager" (`fxmem.run.inductor.step.default_inner` says why). Frameworks read the
    module as the model (`fxmem.trace.wrapper.presented`): its forward signature (with `loss_fn`, plus
    `target`), `config`, `save_pretrained` and whatever else the model has (a transformers model's class too)."""
    if loss is not None and loss.target is not None:
        raise ValueError("fxmem.optimize takes the loss's target at each call (module(*inputs, target=y)); "
                         "leave Loss(target=) out")
    o = _options("optimize", spellings, OPTIMIZE_SPELLINGS, loss=loss, solver=solver)
    device, every_n, solver, time_limit_s, calibrate = o["device"], o["every_n"], o["solver"], o["time_limit_s"], \
        o["calibrate"]
    loss_fn, keep_outputs, model_loss = o["loss_fn"], o["keep_outputs"], o["model_loss"]
    check_model(model)
    if inner == "inductor" and (pool or offload or devices is not None):
        raise ValueError("inner='inductor' runs one planned step on one device, without offload or pool; "
                         "drop pool=, offload= and devices=, or use inner='aot_eager'")
    check_pool(pool)
    check_solver(solver)
    policy = check_policy(parse_policy(policy, every_n), offload=offload, devices=devices, plan=plan)
    refuse_meta_model(model)
    if loss_fn is not None:
        model = LossStep(model, loss_fn, bool(keep_outputs))
    time_limit_s = check_time_limit(time_limit_s)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be an fxmem.Plan (see fxmem.Plan.load), got {type(plan).__name__}")
    inner = inner_for(model, inner, plan, passes=bool(pool or offload or devices is not None))
    if devices is not None:
        if pool:
            raise ValueError("pool=True is not supported together with devices=[...]")
        devices = check_devices([str(d) for d in devices])
        if plan is not None and not plan.devices:
            raise ValueError("plan= has no device placement; make one with fxmem.optimize(model, budget_gb=..., "
                             "devices=[...]) and reuse its .plan")
        budgets = per_device_budgets(budget_gb, len(devices))
        if budgets is None:
            budgets = [e.budget_bytes for e in plan.devices] if plan is not None else [None] * len(devices)
        given = target or device  # else each region is priced as the device it runs on
        return presented(PlacedModule(model, devices, budgets, plan, device_spec(given) if given is not None else None,
                                      solver, time_limit_s))
    if (budget_gb is None) == (plan is None) and policy is None:
        raise ValueError("pass exactly one of budget_gb= (plan at the first call) or plan= (a Plan made earlier)")
    budget = budget_bytes(budget_gb)
    spec = device_spec(target or device, offload, model)

    def request_for(module: torch.nn.Module, args: tuple, kwargs: dict) -> PlanRequest:
        return make_request(module, args, kwargs, budget=budget, device=spec, solver=solver,
                            time_limit_s=time_limit_s, offload=offload, pool=pool, plan=plan, calibrate=calibrate,
                            optimizer=optimizer, policy=policy, inner=inner, cache=cache)

    measure = plan is None and (policy is None or policy.name == "speed")  # eager's peak is compared with the budget
    if plan is not None and plan.host_parameters and not supports(optimizer or ""):
        raise ValueError(f"plan= keeps the optimizer state of {len(plan.host_parameters)} parameters on the host: pass "
                         f"optimizer= (one of {', '.join(SUPPORTED)}), and step the module's fxmem_optimizer")
    hosted = host_optimizer(optimizer, offload or bool(plan is not None and plan.host_parameters))
    if hosted is not None:
        optimizer = hosted
    if keep_outputs is None and plan is not None:  # a given plan is for the outputs held, unless it says otherwise
        keep_outputs = True
    return presented(OptimizedModule(model, request_for, (model_loss, keep_outputs, measure), optimizer=hosted))


def host_optimizer(optimizer: Any, offload: bool) -> HostOptimizer | None:
    """With offload, the optimizer the user steps (`OptimizedModule.fxmem_optimizer`): `optimizer`'s training
    with the state of the parameters the plan names on the host. None without offload or an optimizer; an
    optimizer whose state cannot live on the host (`fxmem.run.host_optimizer.SUPPORTED`) is planned on the
    device, with one line saying so."""
    if not offload or optimizer is None or isinstance(optimizer, (str, int, float)):
        return None
    if isinstance(optimizer, HostOptimizer):
        return optimizer
    if not supports(optimizer):  # its state stays on the device (make_request says so)
        return None
    return HostOptimizer(optimizer)
