"""The engine: a captured model's training step, compiled by AOTAutograd with fxmem's planner as its
partitioner. The step, pipeline and device planners all plan through `plan_step`; `OptimizedModule`
runs planned steps.

Reads the model's parameters and buffers at every call (training the result trains the model);
BatchNorm running statistics are written back once per step by AOTAutograd's input-mutation
epilogue. Compiled steps are cached per input signature (shapes, dtypes, mode). Writes nothing to disk;
a progress line on stderr while the first call of a signature plans on a terminal.
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
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from fxmem.capture import capture, data_dependent_error, describe_input, flat_graph_inputs, structure_outputs
from fxmem.errors import TraceError
from fxmem.meta_device import planned_on
from fxmem.plan import Plan
from fxmem.planner import Planner, PlanRequest
from fxmem.progress import planning
from fxmem.report import short_signature
from fxmem.wrapper import ModelWrapper

log = logging.getLogger("fxmem")


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
                 compiler: Callable[..., Any] = boxed_nop):
        self.gm, self.planner = gm, planner
        self.runner = _GraphRunner(gm)
        own = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        own |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
        self.state_names = [n for n, _ in model_state(model) if n in own]
        model_names = {n for n, _ in model_state(model)}
        self.constants = {n: b for n, b in gm.named_buffers() if n not in model_names}
        self.out_spec: pytree.TreeSpec | None = None
        self.out_consts: list[Any] = []
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


def trace_on_fakes(step: CompiledStep, model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run `step`'s forward once on fake tensors: AOTAutograd traces the joint graph and calls the
    planner; nothing real is computed or allocated."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {k: fake(v) for k, v in model_state(model)}
        return step(state, pytree.tree_map(fake, tuple(args)), pytree.tree_map(fake, dict(kwargs)))


def plan_step(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], request: PlanRequest) -> Plan:
    """Plan (or, with `request.plan`, check) a training step of `model` on fake tensors: nothing runs."""
    if not any(p.requires_grad for _, p in model.named_parameters()):
        raise ValueError("no parameter requires grad: there is no training step to plan")
    with planned_on(model, request.device):  # a meta model: traced as on the device it is planned for
        gm = capture(model, args, kwargs)
        planner = Planner(captured_as(request, gm))
        trace_on_fakes(CompiledStep(model, gm, planner), model, args, kwargs)
    assert planner.plan is not None
    return planner.plan


def captured_as(request: PlanRequest, gm: torch.fx.GraphModule) -> PlanRequest:
    """`request`, saying the step was captured as one graph and by which tracer."""
    tracer = gm.meta.get("fxmem", {}).get("capture", "")
    return dataclasses.replace(request, capture=f"one graph ({tracer})" if tracer else "one graph")


def signature_of(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Readable input signature: shapes and dtypes of tensor inputs, other values, mode."""
    parts = [describe_input(a) for a in args] + [f"{k}={describe_input(v)}" for k, v in sorted(kwargs.items())]
    return f"({', '.join(parts)}){'' if model.training else ' eval'}{autocast_state()}"


def autocast_state() -> str:
    """' autocast(cpu:bfloat16)' inside `torch.autocast`, '' outside: a plan made under autocast
    has other dtypes (and graph) than one made without, so it is part of the input signature."""
    on = [f"{d}:{str(torch.get_autocast_dtype(d)).replace('torch.', '')}" for d in ("cpu", "cuda")
          if torch.is_autocast_enabled(d)]
    return f" autocast({', '.join(on)})" if on else ""


class OptimizedModule(ModelWrapper):
    """The original model's parameters, buffers and submodules, with a planned training step.

    It shares `_parameters`, `_buffers` and `_modules` with the model, so `state_dict` keys are
    unchanged and an optimizer over either module's parameters trains both. `make_request(args,
    kwargs)` says what to plan for an input signature seen for the first time."""

    def __init__(self, model: torch.nn.Module, make_request: Callable[[tuple, dict], PlanRequest]):
        super().__init__(model, _make_request=make_request, _steps={})

    @property
    def plans(self) -> list[Plan]:
        """The plans made or applied so far, one per input signature seen."""
        return [plan for step in self._steps.values() for plan in step.plans]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.fxmem_model
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        key = _cache_key(model, args, kwargs)
        step = self._steps.get(key)
        if step is None:
            request = self._make_request(args, kwargs)
            log.info("fxmem: planning %s %s", request.model, request.signature)
            with planning(f"planning {request.model} {short_signature(request.signature)}", request.time_limit_s):
                try:
                    gm = capture(model, args, kwargs)
                    step = CompiledStep(model, gm, Planner(captured_as(request, gm)))
                    out = step(dict(model_state(model)), args, kwargs)  # the first call traces and plans
                except TraceError as exc:  # not one graph: Dynamo's graphs, under the same budget
                    from fxmem.dynamo_step import DynamoStep

                    step = DynamoStep(model, request, exc)
                    out = step(args, kwargs)
            self._steps[key] = step
            return out
        if isinstance(step, CompiledStep):
            return step(dict(model_state(model)), args, kwargs)
        return step(args, kwargs)


def _cache_key(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    desc = tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
                 for x in leaves)
    modes = tuple(m.training for m in model.modules())
    return (str(spec), desc, modes, autocast_state())
