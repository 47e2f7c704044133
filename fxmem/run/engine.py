"""The engine: a captured model's training step, compiled by AOTAutograd with fxmem's planner as its
partitioner. The step, pipeline and device planners all plan through `plan_step`; `OptimizedModule`
runs planned steps.

Reads the model's parameters and buffers at every call (training the result trains the model);
BatchNorm running statistics are written back once per step by AOTAutograd's input-mutation
epilogue. The joint graphs traced for planning are kept in the process (`fxmem.run.joint_cache`): a step
planned again is planned on a copy, and traced again only where its step runs. Compiled steps are
cached per input signature (shapes, dtypes, mode, autocast, and the autocast backward last ran under:
fxmem.trace.autocast). Writes nothing to disk; a progress line on stderr while the first call of a
signature plans on a terminal.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from functorch.compile import aot_function
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.eval_frame import _set_in_optimized_module
from torch._functorch.partitioners import default_partition
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from fxmem.trace import autocast as bwa
from fxmem.price.accumulation import GradientState, gradient_state, warn_unplanned_gradients
from fxmem.planner.attention_chunks import plan_with_rewrites, rewrites_planned
from fxmem.trace.capture import capture, data_dependent_error, describe_input, flat_graph_inputs, structure_outputs
from fxmem.run.eager_step import EagerStep, eager_peak_within, eager_plan
from fxmem.run.inductor.step import InductorRunner
from fxmem.run.joint_cache import Uncompiled, joint_of, kept, key_of, partitioning
from fxmem.run.planners import KeepingPlanner
from fxmem.error_boundary import public, warn_at_caller
from fxmem.errors import InfeasibleBudgetError, TraceError, fmt_bytes
from fxmem.trace.loop import DROPPED, HELD, LoopWatch, loop_row
from fxmem.trace.loss import OwnLossStep
from fxmem.trace.step import Step, planned_step
from fxmem.trace.meta_device import planned_on
from fxmem.passes.dropout_backward import eager_dropout_backward
from fxmem.planner.plan import Plan, graph_fingerprint
from fxmem.run.host_optimizer import HostOptimizer, place_for_plan
from fxmem.planner import shape_reuse
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.planner.policies import PolicyError
from fxmem.progress import planning
from fxmem.planner.report import short_signature
from fxmem.trace.wrapper import ModelWrapper
from fxmem.meta_keys import CAPTURE, tag
from fxmem.stage_times import stage

log = logging.getLogger("fxmem")
ANY_BUDGET = 1 << 62  # the "speed" policy runs PyTorch's eager step wherever it holds less than fxmem's keep-all


class _GraphRunner(torch.nn.Module):
    """Runs a captured graph node by node, so AOTAutograd copies each node's meta (module paths)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.graph_module = gm

    def forward(self, *flat_inputs: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            raw = torch.fx.Interpreter(self.graph_module).run(*flat_inputs, enable_io_processing=False)
        return structure_outputs(self.graph_module, raw)


class CompiledStep:
    """One captured graph compiled by AOTAutograd with fxmem's planner as partitioner."""

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule, planner: Planner,
                 compiler: Callable[..., Any] = boxed_nop, inner: str = "aot_eager"):
        self.gm, self.planner = gm, planner
        self.runner = _GraphRunner(gm)
        self.state_names = graph_state_names(model, gm)
        model_names = {n for n, _ in model_state(model)}
        self.constants = {n: b for n, b in gm.named_buffers() if n not in model_names}
        self.out_spec: pytree.TreeSpec | None = None
        self.out_consts: list[Any] = []
        # autocast of forward, and where backward was traced (fxmem.trace.autocast); whether backward
        # gives eager's gradients under other autocast states, once checked
        self.forward_autocast: tuple = ()
        self.traced_backward: tuple = ()
        self.backward_agrees: dict[tuple, bool] = {}
        self.inner = inner
        if inner == "inductor":
            self.compiled = InductorRunner(self)
        else:
            self.compiled = aot_function(self._flat_forward, fw_compiler=compiler, bw_compiler=compiler,
                                         partition_fn=planner,
                                         num_params_buffers=len(self.state_names) + len(self.constants))

    def _flat_forward(self, state: dict[str, torch.Tensor], *flat_inputs: Any) -> list[torch.Tensor]:
        # Runs while AOTAutograd traces: module hooks see traced stand-ins for the parameters, so meters
        # built on ModTracker (MemTracker) step aside, as they do for torch.compile's modules.
        with _set_in_optimized_module():
            out = torch.func.functional_call(self.runner, {f"graph_module.{k}": v for k, v in state.items()},
                                             flat_inputs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_consts = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    @property
    def plans(self) -> list[Plan]:
        return [self.planner.plan] if self.planner.plan is not None else []

    def __call__(self, state: dict[str, torch.Tensor], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        flat = flat_graph_inputs(self.gm, args, kwargs)
        graph_state = {n: state[n] for n in self.state_names} | {n: state.get(n, c) for n, c in self.constants.items()}
        try:
            tensors = iter(self.compiled(graph_state, *flat))
        except (DynamicOutputShapeException, DataDependentOutputException) as exc:
            raise data_dependent_error(exc, self.gm) from None
        leaves = [next(tensors) if c is None else c for c in self.out_consts]
        return pytree.tree_unflatten(leaves, self.out_spec)


def model_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers by name, as the compiled step receives them."""
    return list(model.named_parameters()) + list(model.named_buffers())


def graph_state_names(model: torch.nn.Module, gm: torch.fx.GraphModule) -> list[str]:
    """The model's parameters and buffers the captured graph reads, in the order its joint graph takes them."""
    own = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    return [n for n, _ in model_state(model) if n in own]


def trace_on_fakes(step: CompiledStep, model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run `step`'s forward once on fake tensors: AOTAutograd traces the joint graph and calls the
    planner; nothing real is computed or allocated."""
    with stage("trace joint"), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {k: fake(v) for k, v in model_state(model)}
        return step(state, pytree.tree_map(fake, tuple(args)), pytree.tree_map(fake, dict(kwargs)))


def plan_step(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], request: PlanRequest) -> Plan:
    """Plan (or, with `request.plan`, check) a training step of `model` on fake tensors: nothing runs.
    The joint graphs traced are kept for the next plan of the same step (`fxmem.run.joint_cache`)."""
    return planned_graph(model, args, kwargs, request, compile_step=False)[0]


def planned_graph(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], request: PlanRequest,
                  compile_step: bool = True) -> tuple[Plan, Any]:
    """`plan_step`'s plan and the step it compiled (`_planned`); without `compile_step`, the plan alone."""
    if not any(p.requires_grad for _, p in model.named_parameters()) and not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves((tuple(args), kwargs))):
        raise ValueError("no parameter requires grad: there is no training step to plan")
    with planned_on(model, request.device):  # a meta model: traced as on the device it is planned for
        gm = capture(model, args, kwargs)
        return plan_with_rewrites(gm, request, lambda graph, req: _planned(model, graph, args, kwargs, req,
                                                                           compile_step))


def _planned(model: torch.nn.Module, gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any],
             request: PlanRequest, compile_step: bool = True) -> tuple[Plan, Any]:
    """The plan for the captured graph `gm` and its step: compiled on fake tensors where the step's joint graph
    is traced for the first time (and kept: `fxmem.run.joint_cache`), else planned on the joint kept and compiled
    at its first call, which applies the plan. Without `compile_step`, the plan alone, traced without
    compiling (the step in its place only carries the planner)."""
    if request.inner != "aot_eager":  # Inductor traces its own joint graph
        step = CompiledStep(model, gm, Planner(captured_as(request, gm, model)), inner=request.inner)
        trace_on_fakes(step, model, args, kwargs)
        return step.planner.plan, step
    planner = KeepingPlanner(captured_as(request, gm, model))
    key = key_of(model, gm, args, kwargs)
    found = kept(key)
    if found is None and compile_step:
        planner.key = key
        step = CompiledStep(model, gm, planner)
        trace_on_fakes(step, model, args, kwargs)
        return planner.plan, step
    joint, num_fwd_outputs = found or traced_joint(model, gm, args, kwargs, key)
    with partitioning(joint):
        if compile_step or request.pool or request.plan is not None:  # the passes run: the step, its pool, a plan applied
            planner(joint, None, num_fwd_outputs=num_fwd_outputs)
        else:  # the plan alone: nothing rewritten
            planner.plan = planner.plan_only(joint, num_fwd_outputs)
    return planner.plan, CompiledStep(model, gm, planner) if compile_step else Uncompiled(planner)


def traced_joint(model: torch.nn.Module, gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any],
                 key: tuple | None = None) -> tuple[torch.fx.GraphModule, int]:
    """A copy of the joint graph AOTAutograd traces for `gm`'s step on fake tensors, and its number of
    forward outputs: traced once per step (`fxmem.run.joint_cache`; `key`: its key, where known)."""
    return joint_of(key or key_of(model, gm, args, kwargs), lambda partitioner: trace_on_fakes(
        CompiledStep(model, gm, partitioner), model, args, kwargs))


def captured_as(request: PlanRequest, gm: torch.fx.GraphModule, model: torch.nn.Module) -> PlanRequest:
    """`request`, saying the step was captured as one graph and by which tracer, with its inputs' names."""
    tracer = tag(gm, CAPTURE, "")
    return dataclasses.replace(request, capture=f"one graph ({tracer})" if tracer else "one graph",
                               primal_names=tuple(graph_state_names(model, gm)))


def signature_of(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Readable input signature: shapes and dtypes of tensor inputs, other values, mode, autocast
    (and where backward is traced, when not under forward's autocast: fxmem.trace.autocast)."""
    parts = [describe_input(a) for a in args] + [f"{k}={describe_input(v)}" for k, v in sorted(kwargs.items())]
    forward = bwa.live_state()
    return (f"({', '.join(parts)}){'' if model.training else ' eval'}{bwa.describe(forward)}"
            f"{bwa.signature_suffix(bwa.traced_state(forward), forward)}")


def autocast_state() -> str:
    """' autocast(cpu:bfloat16)' inside `torch.autocast`, '' outside: a plan made under autocast
    has other dtypes (and graph) than one made without, so it is part of the input signature."""
    return bwa.describe(bwa.live_state())


class OptimizedModule(ModelWrapper):
    """The original model's parameters, buffers and submodules, with a planned training step.

    It shares `_parameters`, `_buffers` and `_modules` with the model, so `state_dict` keys are
    unchanged and an optimizer over either module's parameters trains both. `make_request(module, args,
    kwargs)` says what to plan for an input signature seen for the first time; `module` is the model, or
    the model with its own `loss` output as the step's loss (`fxmem.trace.step.planned_step`, whose
    `model_loss`, `keep_outputs` and `measure` are `loss_options`; None: the model's outputs as they are;
    `keep_outputs` None: planned for the loop seen, `fxmem.trace.loop`).
    A step is planned per input signature and per gradients resident at its start (accumulating
    micro-batches), except with a `fixed_plan` (pipeline stages and device regions, whose plans count the
    microbatches' gradients already): one compiled step runs whatever gradients exist."""

    def __init__(self, model: torch.nn.Module, make_request: Callable[[torch.nn.Module, tuple, dict], PlanRequest],
                 loss_options: tuple[bool, bool | None, bool] | None = (True, True, True), fixed_plan: bool = False,
                 optimizer: HostOptimizer | None = None):
        learning = loss_options is not None and loss_options[0] and loss_options[1] is None
        if loss_options is not None and loss_options[1] is None:
            loss_options = (loss_options[0], True, loss_options[2])
        super().__init__(model, _make_request=make_request, _steps={}, _backward_ran={}, _loss_options=loss_options,
                         _fixed_plan=fixed_plan, _last=None, _loop=LoopWatch() if learning else None,
                         fxmem_optimizer=optimizer, _decision=frozenset())  # the last plan's recomputed nodes

    @property
    def plans(self) -> list[Plan]:
        """The plans made or applied so far, one per input signature seen."""
        steps = {id(step): step for step in self._steps.values()}  # a step serves every backward it agrees with
        return [plan for step in steps.values() for plan in step.plans]

    @property
    def plan(self) -> Plan | None:
        """The plan of the input signature seen last (None before the first training call)."""
        step = self._steps.get(self._last)
        return step.plans[-1] if step is not None and step.plans else None

    @public
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.fxmem_model
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        grads = gradient_state(model)  # accumulating micro-batches are planned with their gradients resident
        loop = self._loop.loop if self._loop is not None else None  # the loop the user was seen running
        key = (*_cache_key(model, args, kwargs), None if self._fixed_plan else grads.key, loop)
        ran = self._backward_ran.get(key[:-1])  # where this signature's backward ran last, whatever the loop
        object.__setattr__(self, "_last", (key, ran))
        step = self._steps.get((key, ran))
        if step is None:
            forward = bwa.live_state()
            backward = bwa.expected_state(forward) if ran is None else ran
            with torch._functorch.config.patch(backward_pass_autocast=bwa.config_for(backward, forward)):
                step, out = self._plan_for_loop(model, args, kwargs, grads, key, loop)
            self._steps[(key, ran)] = step
            if isinstance(step, CompiledStep):
                step.forward_autocast, step.traced_backward = forward, backward
                step.backward_agrees[backward] = True
        elif isinstance(step, CompiledStep):
            out = step(dict(model_state(model)), args, kwargs)
        else:
            out = step(args, kwargs)
        if isinstance(step, CompiledStep):  # the inputs are let go at the first backward through the step, so
            held = [args, kwargs]  # a block's input (FSDP2, fxmem.fsdp) is not kept until the loss is dropped
            bwa.watch_backward(out, lambda state: self._saw_backward(key, step, state, held))
        if self._loop is not None:
            self._loop.watch(out)
        return out

    def _plan_for_loop(self, model: torch.nn.Module, args: tuple, kwargs: dict, grads: GradientState, key: tuple,
                       loop: str | None) -> tuple[Any, Any]:
        """`_plan`'s step for the loop seen (`fxmem.trace.loop`). Where the outputs cannot be held within the
        budget, the step that drops them, whatever the loop (said once in a warning), kept for the held loop too."""
        try:  # held: refused at a lower bound of its peak, where that proves it; the least is searched only to name it
            return self._plan(model, args, kwargs, grads, loop, refuse_at_bound=loop == HELD)
        except InfeasibleBudgetError as exc:
            if loop != HELD or not getattr(exc, "names_held_outputs", False):  # no outputs held beside a loss
                raise self._searched_refusal(exc, model, args, kwargs, grads, loop) from None
            held, held_least = exc, exc.min_budget_bytes
        try:
            step, out = self._plan(model, args, kwargs, grads, DROPPED, held_least)
        except InfeasibleBudgetError as exc:
            if exc.min_budget_bytes >= held_least:  # the held step's least, where it was a bound, searched
                held = self._searched_refusal(held, model, args, kwargs, grads, loop)
                held_least = held.min_budget_bytes
            if exc.min_budget_bytes >= held_least:  # dropping the outputs does not lower it (Dynamo's graphs)
                raise held from None
            exc.args = (f"{exc.args[0]}; at that least the outputs beside the loss are not returned (held through "
                        f"backward, they need at least {fmt_bytes(held_least or 0)})",)
            raise
        self._steps.setdefault((key[:-1] + (DROPPED,), None), step)
        warn_at_caller(f"fxmem: {type(self.fxmem_model).__qualname__}'s outputs beside its loss are not returned "
                       f"(None): the budget is below what holding them needs (at least {fmt_bytes(held_least or 0)}); "
                       "keep_outputs=False asks for this")
        return step, out

    def _searched_refusal(self, refusal: InfeasibleBudgetError, *plan_args: Any) -> InfeasibleBudgetError:
        """`refusal` where it names a least searched for, else the refusal of `_plan(*plan_args)` searched in full."""
        if not getattr(refusal, "bound_only", False):
            return refusal
        try:
            self._plan(*plan_args)
        except InfeasibleBudgetError as searched:
            return searched
        raise AssertionError("a budget under its proven lower bound was met")

    def _plan(self, model: torch.nn.Module, args: tuple, kwargs: dict, grads: GradientState, loop: str | None = None,
              held_least: int | None = None, refuse_at_bound: bool = False) -> tuple[Any, Any]:
        """A new step for this input signature, the gradients resident at its start and the loop seen (None:
        `keep_outputs` as given), and the output of its first call (which traces and plans); `refuse_at_bound`:
        a budget under the step's lower bound is refused naming that bound (`PlanRequest.refuse_at_bound`)."""
        options = self._loss_options
        if options and loop is not None:
            options = (options[0], loop == HELD, options[2])
        stepped = planned_step(model, args, kwargs, *options) if options else Step(model, "", args, kwargs)
        module, loss = stepped.module, stepped.loss
        if loop is not None and isinstance(module, OwnLossStep):
            loss = loop_row(loss, loop, held_least)
        request = dataclasses.replace(self._make_request(module, args, kwargs), loss=loss,
                                      resident_gradient_bytes=grads.bytes, resident_gradients=grads.description,
                                      refuse_at_bound=refuse_at_bound)
        warn_unplanned_gradients(request.plan, grads)
        log.info("fxmem: planning %s %s", request.model, request.signature)
        with planning(f"planning {request.model} {short_signature(request.signature)}", request.time_limit_s), \
                stepped.naming_held_outputs(), shape_reuse.seeded_by(self._decision):  # from the last plan's decision
            step = _eager_or_planned(module, args, kwargs, request, stepped.eager_peak)
            if isinstance(step, EagerStep):
                return step, step(args, kwargs)
            try:
                if step is None:
                    gm = capture(module, args, kwargs)
                    if rewrites_planned(gm, request):
                        with planned_on(module, request.device):  # loss/attention chunks: planned on fake tensors
                            step = plan_with_rewrites(gm, request, lambda graph, req: _planned(
                                module, graph, args, kwargs, req))[1]
                    else:
                        step = CompiledStep(module, gm, Planner(captured_as(request, gm, module)), inner=request.inner)
                out = step(dict(model_state(module)), args, kwargs)  # the first call traces and plans
                object.__setattr__(self, "_decision", frozenset(step.plans[-1].recompute if step.plans else ()))
                place_for_plan(self.fxmem_optimizer, module, step)
                return step, out
            except TraceError as exc:  # not one graph: Dynamo's graphs, under the same budget
                from fxmem.run.dynamo.step import DynamoStep

                if request.policy is not None:
                    raise PolicyError(f"policy={request.policy.name!r} plans a step captured as one graph; "
                                      f"{exc.construct}: pass budget_gb= instead") from None

                step = DynamoStep(module, dataclasses.replace(request, refuse_at_bound=False), exc)
                return step, step(args, kwargs)

    def _saw_backward(self, key: tuple, step: CompiledStep, state: bwa.State, held: list) -> None:
        """Backward of `step` ran under `state`: if its graph is not eager's backward there, warn (once) and
        plan again at the next call. `held`: [args, kwargs] of the call, emptied here (a second backward
        through the same call, with retain_graph, is not checked again)."""
        self._backward_ran[key[:-1]] = state  # the same for the loop's other plan
        args, kwargs = held if held else (None, None)
        held.clear()
        if state not in step.backward_agrees and args is not None:
            step.backward_agrees[state] = _same_joint(step, self.fxmem_model, args, kwargs, state)
            if not step.backward_agrees[state]:
                plan = step.planner.plan
                warn_at_caller(bwa.mismatch_warning(plan.model if plan else type(self.fxmem_model).__qualname__,
                                                    step.traced_backward, state, step.forward_autocast))
        if step.backward_agrees.get(state):
            self._steps.setdefault((key, state), step)


def _same_joint(step: CompiledStep, model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                backward: bwa.State) -> bool:
    """Whether tracing `step` with backward under `backward` gives the joint graph it was planned for
    (traced again on fake tensors, from within backward: grad mode on, forward's autocast)."""
    plan = step.planner.plan
    if plan is None:
        return False
    fingerprint = JointFingerprint()
    with torch.enable_grad(), bwa.autocast_as(step.forward_autocast), \
            torch._functorch.config.patch(backward_pass_autocast=bwa.config_for(backward, step.forward_autocast)):
        trace_on_fakes(CompiledStep(model, step.gm, fingerprint, inner=step.inner), model, args, kwargs)
    return fingerprint.fingerprint == plan.fingerprint


class JointFingerprint:
    """A partitioner that records the joint graph's fingerprint as the planner computes it, and splits it
    as AOTAutograd's default partitioner does."""

    plan = None
    fingerprint = ""

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        eager_dropout_backward(joint)
        self.fingerprint = graph_fingerprint(joint)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)


def _eager_or_planned(module: torch.nn.Module, args: tuple, kwargs: dict, request: PlanRequest,
                      eager_peak: Callable[[], int | None] | None = None) -> EagerStep | CompiledStep | None:
    """PyTorch's eager step where the budget covers its peak and fxmem's keep-all step would hold more
    (`fxmem.run.eager_step`); the step planned and compiled on fake tensors to compare, where it was;
    otherwise None (the first real call plans)."""
    if request.plan is not None:
        return EagerStep(module, request.plan) if request.plan.runs_eagerly else None
    if request.inner == "inductor":  # Inductor's step, fused, whatever eager's peak
        return None
    if request.policy is not None and request.policy.name != "speed":  # the policy decides, whatever eager's peak
        return None
    budget = request.budget_bytes if request.policy is None else ANY_BUDGET  # "speed": eager's where it holds less
    eager = eager_peak_within(module, args, kwargs, budget, request.resident_bytes + request.resident_gradient_bytes,
                              eager_peak)
    if eager is None:
        return None
    try:
        made, step = planned_graph(module, args, kwargs, request)
    except TraceError:  # planned through Dynamo's graphs instead
        return None
    as_eager = eager_plan(made, eager)
    if as_eager is not None:
        log.info("fxmem: %s runs eagerly: PyTorch's step peaks at %d bytes, below fxmem's keep-all step's %d",
                 request.model, eager, made.baseline_peak_bytes)
        return EagerStep(module, as_eager)
    return step


def _cache_key(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    desc = tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
                 for x in leaves)
    modes = tuple(m.training for m in model.modules())
    return (str(spec), desc, modes, autocast_state())
