"""Runtime: `fxmem.plan` and `fxmem.optimize` — capture, AOTAutograd with the planner, run.

Reads the model's parameters and buffers at every call (training the result trains the model);
BatchNorm running statistics are written back once per step by AOTAutograd's input-mutation
epilogue. Compiled steps are cached per input signature (shapes, dtypes, mode). Writes nothing to disk.
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
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.capture import capture, flat_graph_inputs, structure_outputs
from fxmem.cost import DEVICE_PRESETS, DeviceSpec
from fxmem.errors import GIB
from fxmem.plan import Plan
from fxmem.planner import Planner, PlanRequest

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

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule, planner: Planner):
        self.gm, self.planner = gm, planner
        self.runner = _GraphRunner(gm)
        own = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        own |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
        self.state_names = [n for n, _ in _state(model) if n in own]
        model_names = {n for n, _ in _state(model)}
        self.constants = {n: b for n, b in gm.named_buffers() if n not in model_names}
        self.out_spec: pytree.TreeSpec | None = None
        self.out_consts: list[Any] = []
        self.compiled = aot_function(self._flat_forward, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=planner,
                                     num_params_buffers=len(self.state_names) + len(self.constants))

    def _flat_forward(self, state: dict[str, torch.Tensor], *flat_inputs: Any) -> list[torch.Tensor]:
        out = torch.func.functional_call(self.runner, {f"graph_module.{k}": v for k, v in state.items()},
                                         flat_inputs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_consts = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def __call__(self, state: dict[str, torch.Tensor], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        flat = flat_graph_inputs(self.gm, args, kwargs)
        graph_state = {n: state[n] for n in self.state_names} | {n: state.get(n, c) for n, c in self.constants.items()}
        tensors = iter(self.compiled(graph_state, *flat))
        leaves = [next(tensors) if c is None else c for c in self.out_consts]
        return pytree.tree_unflatten(leaves, self.out_spec)


def _state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def describe_input(x: Any) -> str:
    """`float32[8,32]+grad` for a tensor, repr otherwise."""
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).replace("torch.", "")
        return f"{dtype}[{','.join(map(str, x.shape))}]" + ("+grad" if x.requires_grad else "")
    return repr(x)


def signature_of(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Readable input signature: shapes and dtypes of tensor inputs, other values, mode."""
    parts = [describe_input(a) for a in args] + [f"{k}={describe_input(v)}" for k, v in sorted(kwargs.items())]
    return f"({', '.join(parts)}){'' if model.training else ' eval'}"


def budget_bytes(budget_gb: float | None) -> int | None:
    """GiB -> bytes, refusing anything but a positive number."""
    if budget_gb is None:
        return None
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or budget_gb != budget_gb \
            or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GiB (2**30 bytes), got {budget_gb!r}")
    return int(budget_gb * GIB)


def _request(model, args, kwargs, budget_gb, plan, device, solver, time_limit_s) -> PlanRequest:
    if isinstance(device, str):
        device = DeviceSpec.from_name(device)
    return PlanRequest(budget_bytes=budget_bytes(budget_gb), plan=plan, device=device or DEVICE_PRESETS["cpu"],
                       solver=solver, time_limit_s=time_limit_s, model=type(model).__qualname__,
                       signature=signature_of(model, args, kwargs))


def plan(model: torch.nn.Module, example_inputs: Sequence[Any] = (), budget_gb: float | None = None, *,
         example_kwargs: dict[str, Any] | None = None, device: DeviceSpec | str | None = None,
         solver: str = "cpsat", time_limit_s: float = 10.0, num_stages: int | None = None,
         schedule: str = "1f1b", n_microbatches: int | None = None, optimizer: str | float | None = None) -> Plan:
    """Plan a training step of `model` on `example_inputs` under `budget_gb` without running it
    (fake tensors only). Without a budget the plan keeps everything (the eager step).
    With `num_stages`, `example_inputs` is one microbatch and `budget_gb` is per pipeline stage:
    see `fxmem.pipeline` (`schedule` "1f1b" or "gpipe", `n_microbatches`, `optimizer` state)."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    request = _request(model, args, kwargs, budget_gb, None, device, solver, time_limit_s)
    if num_stages is not None:
        from fxmem.pipeline import PipelineRequest, plan_pipeline

        return plan_pipeline(model, args, kwargs, request,
                             PipelineRequest(num_stages, schedule, n_microbatches, optimizer))
    if request.budget_bytes is None:
        request.budget_bytes = 2**62
    if not any(p.requires_grad for _, p in _state(model)):
        raise ValueError("no parameter requires grad: there is no training step to plan")
    planner = Planner(request)
    step = CompiledStep(model, capture(model, args, kwargs), planner)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {k: fake(v) for k, v in _state(model)}
        step(state, pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs))
    assert planner.plan is not None
    if budget_gb is None:  # report the eager step's own peak as its budget
        return dataclasses.replace(planner.plan, budget_bytes=planner.plan.baseline_peak_bytes)
    return planner.plan


class OptimizedModule(torch.nn.Module):
    """The original model's parameters, buffers and submodules, with a planned training step.

    It shares `_parameters`, `_buffers` and `_modules` with the model, so `state_dict` keys are
    unchanged and an optimizer over either module's parameters trains both."""

    def __init__(self, model: torch.nn.Module, make_request: Callable[[tuple, dict], PlanRequest]):
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "fxmem_model", model)
        object.__setattr__(self, "_make_request", make_request)
        object.__setattr__(self, "_steps", {})

    @property
    def plans(self) -> list[Plan]:
        """The plans made or applied so far, one per input signature seen."""
        return [s.planner.plan for s in self._steps.values() if s.planner.plan is not None]

    def train(self, mode: bool = True) -> "OptimizedModule":
        self.fxmem_model.train(mode)
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.fxmem_model
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        key = _cache_key(model, args, kwargs)
        step = self._steps.get(key)
        if step is None:
            request = self._make_request(args, kwargs)
            log.info("fxmem: planning %s %s", request.model, request.signature)
            step = CompiledStep(model, capture(model, args, kwargs), Planner(request))
            self._steps[key] = step
        return step(dict(_state(model)), args, kwargs)


def _cache_key(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    desc = tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
                 for x in leaves)
    modes = tuple(m.training for m in model.modules())
    return (str(spec), desc, modes)


def optimize(model: torch.nn.Module, *, budget_gb: float | None = None, plan: Plan | None = None,
             device: DeviceSpec | str | None = None, solver: str = "cpsat",
             time_limit_s: float = 10.0) -> OptimizedModule:
    """A module that trains like `model` with its step planned under `budget_gb` (planned lazily at the
    first call, from the real inputs; re-planned per input signature), or running a given `plan`."""
    if (budget_gb is None) == (plan is None):
        raise ValueError("pass exactly one of budget_gb= (plan at the first call) or plan= (a Plan made earlier)")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be an fxmem.Plan (see fxmem.Plan.load), got {type(plan).__name__}")
    budget_bytes(budget_gb)

    def make_request(args: tuple, kwargs: dict) -> PlanRequest:
        request = _request(model, args, kwargs, budget_gb, plan, device, solver, time_limit_s)
        if plan is not None:
            request.budget_bytes = plan.budget_bytes
        return request

    return OptimizedModule(model, make_request)
