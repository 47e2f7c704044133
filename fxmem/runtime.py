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
from fxmem.memory import simulate_step
from fxmem.plan import Plan
from fxmem.wrapper import ModelWrapper
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

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule, planner: Planner,
                 compiler: Callable[..., Any] = boxed_nop, pool: bool | str = False, pool_execute: bool = True):
        self.gm, self.planner = gm, planner
        self.runner = _GraphRunner(gm)
        own = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        own |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
        self.state_names = [n for n, _ in _state(model) if n in own]
        model_names = {n for n, _ in _state(model)}
        self.constants = {n: b for n, b in gm.named_buffers() if n not in model_names}
        self.out_spec: pytree.TreeSpec | None = None
        self.out_consts: list[Any] = []
        fw_compiler, bw_compiler = (_pooling(planner, "forward", pool_execute, pool != "all"),
                                    _pooling(planner, "backward", pool_execute, pool != "all")) if pool \
            else (compiler, compiler)
        self.compiled = aot_function(self._flat_forward, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                     partition_fn=planner,
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


def _pooling(planner: Planner, graph: str, execute: bool = True, keep_peak: bool = True) -> Callable[..., Any]:
    """An AOTAutograd compiler that runs `graph` ("forward"/"backward") with its intermediates in one
    arena (passes/pool.py) and records the pool's stats on the planner's plan. Without `execute`
    (planning on fake tensors) it pools a copy for the stats and runs the graph as it is. With
    `keep_peak`, intermediates whose pooling would raise the graph's peak stay with the allocator."""
    from fxmem.passes.pool import copy_graph, pool_compiler, pool_graph, pool_stats

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # AOTAutograd's backward frees saved values as it goes; its forward's inputs stay with the caller.
        options = {"inputs_freed": graph == "backward", "keep_peak": keep_peak}
        if execute:
            compiled = pool_compiler(gm, example_inputs, **options)
        else:
            pooled = pool_graph(copy_graph(gm), **options)
            compiled, gm = boxed_nop(gm, example_inputs), pooled
        if planner.plan is not None:
            stats = {**(planner.plan.pool or {}), graph: pool_stats(gm).as_dict()}
            pooled = getattr(planner, "pooled_graphs", {}) | {graph: gm}
            planner.pooled_graphs = pooled
            if len(pooled) == 2:  # the arena is held across its graph: simulate the pooled step
                peak = simulate_step(pooled["forward"], pooled["backward"], planner.num_fwd_outputs).peak
                stats["step"] = {"predicted_peak_bytes": peak}
                if peak > planner.plan.budget_bytes:
                    log.warning("fxmem: pooled graphs hold their arenas across the graph; the simulated peak "
                                "%d bytes exceeds the budget %d bytes (unpooled %d)", peak,
                                planner.plan.budget_bytes, planner.plan.predicted_peak_bytes)
            planner.plan = dataclasses.replace(planner.plan, pool=stats)
        return compiled

    return compile_graph


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
    return f"({', '.join(parts)}){'' if model.training else ' eval'}{autocast_state()}"


def autocast_state() -> str:
    """' autocast(cpu:bfloat16)' inside `torch.autocast`, '' outside: a plan made under autocast
    has other dtypes (and graph) than one made without, so it is part of the input signature."""
    on = [f"{d}:{str(torch.get_autocast_dtype(d)).replace('torch.', '')}" for d in ("cpu", "cuda")
          if torch.is_autocast_enabled(d)]
    return f" autocast({', '.join(on)})" if on else ""


def check_pool(pool: Any) -> bool | str:
    """`pool` must be False, True or "all"."""
    if pool not in (False, True, "all") or (not isinstance(pool, (bool, str))):
        raise ValueError(f"pool must be False, True (pool what keeps each graph's peak) or \"all\", got {pool!r}")
    return pool


def budget_bytes(budget_gb: float | None) -> int | None:
    """GiB -> bytes, refusing anything but a positive number."""
    if budget_gb is None:
        return None
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or budget_gb != budget_gb \
            or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GiB (2**30 bytes), got {budget_gb!r}")
    return int(budget_gb * GIB)


def _request(model, args, kwargs, budget_gb, plan, device, solver, time_limit_s, offload=False) -> PlanRequest:
    if isinstance(device, str):
        device = DeviceSpec.from_name(device)
    if offload and device is not None and device.host_link is None:
        raise ValueError(f"offload=True needs a host link on device {device.name}; "
                         "use DeviceSpec.with_link('pcie4' | 'pcie5' | 'nvlink-c2c')")
    return PlanRequest(budget_bytes=budget_bytes(budget_gb), plan=plan, device=device or DEVICE_PRESETS["cpu"],
                       solver=solver, time_limit_s=time_limit_s, model=type(model).__qualname__,
                       signature=signature_of(model, args, kwargs), offload=bool(offload))


def plan(model: torch.nn.Module, example_inputs: Sequence[Any] = (), budget_gb: float | None = None, *,
         example_kwargs: dict[str, Any] | None = None, device: DeviceSpec | str | None = None,
         solver: str = "auto", time_limit_s: float = 10.0, offload: bool = False,
         target: DeviceSpec | str | None = None, pool: bool | str = False, num_stages: int | None = None,
         schedule: str = "1f1b", n_microbatches: int | None = None, optimizer: str | float | None = None) -> Plan:
    """Plan a training step of `model` on `example_inputs` under `budget_gb` without running it
    (fake tensors only). Without a budget the plan keeps everything (the eager step).
    `target` (same as `device`): the device to plan for, which need not be present; with
    `offload=True` saved values may also be copied to host memory over its host link. With `pool`, the
    plan also reports what pooling the forward and backward graphs into one arena each would give
    (`pool=True`: the intermediates whose pooling does not raise the graph's peak; `pool="all"`: all).
    With `num_stages`, `example_inputs` is one microbatch and `budget_gb` is per pipeline stage:
    see `fxmem.pipeline` (`schedule` "1f1b" or "gpipe", `n_microbatches`, `optimizer` state)."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    check_pool(pool)
    request = _request(model, args, kwargs, budget_gb, None, target or device, solver, time_limit_s, offload)
    if num_stages is not None:
        if offload or pool:
            raise ValueError("num_stages= plans pipeline stages; offload= and pool= apply to one device's step, "
                             "not yet to pipeline stages")
        from fxmem.pipeline import PipelineRequest, plan_pipeline

        return plan_pipeline(model, args, kwargs, request,
                             PipelineRequest(num_stages, schedule, n_microbatches, optimizer))
    if request.budget_bytes is None:
        request.budget_bytes = 2**62
    if not any(p.requires_grad for _, p in _state(model)):
        raise ValueError("no parameter requires grad: there is no training step to plan")
    planner = Planner(request)
    step = CompiledStep(model, capture(model, args, kwargs), planner, pool=pool, pool_execute=False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {k: fake(v) for k, v in _state(model)}
        out = step(state, pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs))
        if pool:  # AOTAutograd compiles (so pools, for the stats) the backward graph at the first backward
            from fxmem.measure import loss_of

            loss_of(out).backward()
    assert planner.plan is not None
    if budget_gb is None:  # report the eager step's own peak as its budget
        return dataclasses.replace(planner.plan, budget_bytes=planner.plan.baseline_peak_bytes)
    return planner.plan


class OptimizedModule(ModelWrapper):
    """The original model's parameters, buffers and submodules, with a planned training step.

    It shares `_parameters`, `_buffers` and `_modules` with the model, so `state_dict` keys are
    unchanged and an optimizer over either module's parameters trains both."""

    def __init__(self, model: torch.nn.Module, make_request: Callable[[tuple, dict], PlanRequest],
                 pool: bool | str = False):
        super().__init__(model, _make_request=make_request, _steps={}, _pool=pool)

    @property
    def plans(self) -> list[Plan]:
        """The plans made or applied so far, one per input signature seen."""
        return [s.planner.plan for s in self._steps.values() if s.planner.plan is not None]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.fxmem_model
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        key = _cache_key(model, args, kwargs)
        step = self._steps.get(key)
        if step is None:
            request = self._make_request(args, kwargs)
            log.info("fxmem: planning %s %s", request.model, request.signature)
            step = CompiledStep(model, capture(model, args, kwargs), Planner(request), pool=self._pool)
            self._steps[key] = step
        return step(dict(_state(model)), args, kwargs)


def _cache_key(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    desc = tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
                 for x in leaves)
    modes = tuple(m.training for m in model.modules())
    return (str(spec), desc, modes, autocast_state())


def optimize(model: torch.nn.Module, *, budget_gb: float | None = None, plan: Plan | None = None,
             device: DeviceSpec | str | None = None, solver: str = "auto",
             time_limit_s: float = 10.0, offload: bool = False, target: DeviceSpec | str | None = None,
             devices: Sequence[str] | None = None, pool: bool | str = False) -> OptimizedModule:
    """A module that trains like `model` with its step planned under `budget_gb` (planned lazily at the
    first call, from the real inputs; re-planned per input signature), or running a given `plan`.
    `offload=True` lets the planner copy saved values to host memory (see `plan`); `devices` places
    contiguous regions of the model on several devices, `budget_gb` per device. With `pool`, each
    forward and backward graph allocates one arena for its intermediates (passes/pool.py):
    `pool=True` those whose pooling does not raise the graph's peak, `pool="all"` every one; the
    plans in `.plans` then carry the pool's stats."""
    if devices is not None:
        if pool:
            raise ValueError("pool=True is not supported together with devices=[...]")
        from fxmem.placement import optimize_on_devices

        return optimize_on_devices(model, devices, budget_gb=budget_gb, plan=plan, device=target or device)
    if (budget_gb is None) == (plan is None):
        raise ValueError("pass exactly one of budget_gb= (plan at the first call) or plan= (a Plan made earlier)")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be an fxmem.Plan (see fxmem.Plan.load), got {type(plan).__name__}")
    budget_bytes(budget_gb)
    check_pool(pool)

    def make_request(args: tuple, kwargs: dict) -> PlanRequest:
        request = _request(model, args, kwargs, budget_gb, plan, target or device, solver, time_limit_s, offload)
        if plan is not None:
            request.budget_bytes = plan.budget_bytes
        return request

    return OptimizedModule(model, make_request, pool=pool)
