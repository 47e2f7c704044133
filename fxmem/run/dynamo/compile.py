"""Compiling the graphs of one step Dynamo captured, each planned under the step's one budget: what the
`torch.compile` backend (`fxmem.backend`) and the engine's Dynamo path (`fxmem.run.dynamo.step`) share.

A compile call's settings are checked and its budget turned into bytes once (`settings_of`); one ledger per
call (`fxmem.run.dynamo.ledger`) records each graph's plan and what the rest of the step holds while it runs.
Reads nothing from disk; writes each graph's plan to `plan_out` (`<stem>.<k>.json`) when asked, and on a terminal
the progress line `fxmem.plan` shows while a graph is planned and compiled (`fxmem.progress.planning`).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.budget import budget_bytes
from fxmem.trace.capture import describe_input
from fxmem.price.cost import DeviceSpec, preset_for
from fxmem.errors import TraceError
from fxmem.run.inductor.planning import FusedPlanning, compile_with_partitioner
from fxmem.run.inductor.step import INNERS, has_cxx_compiler, replays_random
from fxmem.run.dynamo.ledger import GraphRecord, Ledger
from fxmem.planner.plan import Plan
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.planner.report import short_signature
from fxmem.progress import planning

log = logging.getLogger("fxmem")

OPTIONS = ("budget_gb", "inner", "time_limit_s", "plan_out", "verbose", "device", "solver")


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """A compile call's options, checked, with the budget in bytes (the one conversion from GiB)."""

    budget_bytes: int
    inner: str | None = None
    time_limit_s: float = 10.0
    plan_out: str | os.PathLike | None = None
    verbose: bool = False
    device: Any = None
    solver: str = "auto"


_LEDGERS: dict[int, tuple[Any, Ledger]] = {}
_LOCK = threading.Lock()


def settings_of(options: dict | None) -> CompileSettings:
    """`torch.compile(..., options=)` checked, with one clear error per mistake, and its budget in bytes."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"fxmem backend: options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"fxmem backend: unknown options {unknown}; known options are {list(OPTIONS)}")
    budget = options.get("budget_gb")
    if budget is None:
        raise ValueError("fxmem backend needs a memory budget: torch.compile(model, backend='fxmem', "
                         "options={'budget_gb': <GiB per training step>})")
    inner = options.get("inner")
    if inner is not None and inner not in INNERS:
        raise ValueError(f"fxmem backend: inner must be one of {INNERS}, got {inner!r}")
    return CompileSettings(budget_bytes(budget), inner, float(options.get("time_limit_s", 10.0)),
                           options.get("plan_out"), bool(options.get("verbose")), options.get("device"),
                           options.get("solver", "auto"))


def open_ledger(key: Any, settings: CompileSettings, model: torch.nn.Module | None = None,
                survey: list | None = None, model_name: str = "", shares: list | None = None,
                runs: dict[int, int] | None = None, eager: dict[int, int] | None = None,
                tail: tuple[int | None, int] = (None, 0)) -> Ledger:
    """A new ledger for the compile call known by `key` (its options dict), told the model and the step's
    survey (`fxmem.run.dynamo.ledger.survey_step`), so other graphs' parameters and later graphs' gradients
    are known."""
    with _LOCK:
        ledger = Ledger(settings.budget_bytes, model=model, survey=survey, model_name=model_name, shares=shares,
                        runs=dict(runs or {}), eager=dict(eager or {}), tail=tail)
        _LEDGERS.pop(id(key), None)  # the newest ledger last (plans_for by value finds it first)
        _LEDGERS[id(key)] = (key, ledger)
    return ledger


def ledger_of(key: Any, settings: CompileSettings) -> Ledger:
    """The ledger of the compile call known by `key`, opened at its first graph."""
    with _LOCK:
        entry = _LEDGERS.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1]
    return open_ledger(key, settings)


def ledger_for(key: Any) -> Ledger | None:
    """The ledger of the torch.compile call made with this `options` dict (None before its first graph)."""
    entry = _LEDGERS.get(id(key))
    return entry[1] if entry is not None and entry[0] is key else None


def plans_for(options: Any) -> list[Plan]:
    """The plans made so far for the torch.compile call made with `options`, in order: that very dict, or
    else an equal one (`{"budget_gb": 2.0}` written again); of several calls with equal options, the last."""
    ledger = ledger_for(options)
    if ledger is None:
        with _LOCK:
            ledger = next((led for made, led in reversed(list(_LEDGERS.values())) if made == options), None)
    return ledger.plans if ledger is not None else []


def reset() -> None:
    """Forget every ledger (torch._dynamo.reset() also calls this through the backend's `reset`)."""
    with _LOCK:
        _LEDGERS.clear()


def _frame_id() -> Any:
    cid = torch._guards.CompileContext.current_compile_id()
    return getattr(cid, "frame_id", None) if cid is not None else None


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: CompileSettings, ledger: Ledger,
                  planner_for: Callable[[PlanRequest, GraphRecord], Planner], count_saved: bool = True
                  ) -> Callable[..., Any]:
    """Graph `gm` of the step `ledger` keeps, compiled with the planner `planner_for(request, record)`
    makes; `count_saved` False leaves earlier graphs' saved values out of what the rest holds."""
    _refuse_dynamic_shapes(example_inputs)
    budget = ledger.budget_bytes
    inner = settings.inner or ("inductor" if has_cxx_compiler() else "aot_eager")
    frame = _frame_id()
    index = len(ledger.records)
    record = GraphRecord.of(index, frame, budget, example_inputs, _sources(gm))
    record.breaks = bool(getattr(getattr(gm, "compile_subgraph_reason", None), "graph_break", False))
    record.held = ledger.held_for(record, count_saved)
    device = settings.device or _input_device(example_inputs)
    request = PlanRequest(budget_bytes=budget, held_bytes=record.held, replay_random=replays_random(inner),
                          replay_ops="torch" if inner == "inductor" else "functions", inner=inner,
                          device=device if isinstance(device, DeviceSpec) else DeviceSpec.from_name(device),
                          solver=settings.solver, time_limit_s=settings.time_limit_s,
                          model=ledger.model_name or f"dynamo graph {index}", capture=_where(gm, index, ledger),
                          signature=f"({', '.join(map(describe_input, example_inputs))})")
    planner = planner_for(request, record)
    where = request.capture.split(", ended by")[0]  # 'Dynamo graph k of n'
    title = f"planning {ledger.model_name + ', ' if ledger.model_name else ''}{where} {short_signature(request.signature)}"
    with planning(title, request.time_limit_s):  # the progress line fxmem.plan shows (inside fxmem.optimize: silent)
        if inner == "inductor":
            try:
                return _counted(_compile_inductor(gm, example_inputs, planner), record)
            except ImportError as exc:  # pragma: no cover - inductor missing from this build
                warnings.warn(f"fxmem backend: Inductor unavailable ({exc}); running the planned graphs with "
                              "aot_eager instead (the budget still applies)", stacklevel=2)
        return _counted(_compile_aot_eager(gm, example_inputs, planner), record)


def _refuse_dynamic_shapes(example_inputs: Sequence[Any]) -> None:
    """A plan is for one shape (its peak is bytes, not a formula): a graph traced with symbolic sizes,
    as torch.compile makes after a second input shape or with dynamic=True, gets a clear error."""
    for k, value in enumerate(example_inputs):
        sizes = tuple(value.shape) if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in sizes):
            raise TraceError(
                f"graph input {k} has dynamic sizes {sizes}, from torch.compile's dynamic shapes (dynamic=True, or "
                "the second input shape it sees), and a plan is for one shape",
                "compile with dynamic=False, e.g. torch.compile(model, backend='fxmem', dynamic=False, "
                "options=...), to plan each shape separately, or use fxmem.optimize, which does")


def _counted(compiled: Callable[..., Any], record: GraphRecord) -> Callable[..., Any]:
    """`compiled`, counting its calls in `record` (`fxmem.run.dynamo.step` checks for graphs run twice a step)."""
    def run(*args: Any) -> Any:
        if record.calls == 0:
            _free_compile_garbage()
        record.calls += 1
        out = compiled(*args)
        if record.calls == 1:  # what it returns may stay alive while later graphs run (fxmem.run.dynamo.ledger)
            for value in torch.utils._pytree.tree_leaves(out):
                record.see(value)
        return out

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run


def _free_compile_garbage() -> None:
    """Collect the reference cycles Dynamo's compile of this frame left behind. Its tracer's frames hold the
    frame's locals, real tensors (the step's activations) among them, until the garbage collector runs: on
    the call that compiles, often the first, they would stay alive beside the graphs' own activations, above
    the plan (7% on a Wav2Vec2-CTC step). The compile has returned when its graph first runs."""
    gc.collect()


def _where(gm: torch.fx.GraphModule, index: int, ledger: Ledger) -> str:
    """'Dynamo graph k of n', and the graph break that ended this graph (reason, file:line)."""
    count = f" of {len(ledger.survey)}" if ledger.survey else ""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return f"Dynamo graph {index + 1}{count}"
    frames = getattr(reason, "user_stack", None) or []
    at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = " ".join(str(reason.reason).split())
    if text.startswith("generic_jump"):
        text = "a Python branch on a tensor's value"
    return f"Dynamo graph {index + 1}{count}, ended by a graph break{at}: {text[:160]}"


def _sources(gm: torch.fx.GraphModule) -> list[Any]:
    """Where Dynamo found each graph input (a module's parameter or buffer, a local variable)."""
    return [getattr(n.meta.get("grapharg"), "source", None) for n in gm.graph.find_nodes(op="placeholder")]


def _input_device(example_inputs: Sequence[Any]) -> DeviceSpec:
    """The preset of the first tensor input's device (CPU when the graph has no tensor input)."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return preset_for(value.device)
    return preset_for("cpu")


def _compile_aot_eager(gm, example_inputs, planner: Planner):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=planner,
                            keep_inference_input_mutations=True)(gm, example_inputs)


def _compile_inductor(gm, example_inputs, planner: Planner):
    """Inductor's own compile_fx pipeline (decompositions, joint-graph passes, compile_fx_inner for the
    forward and backward graphs) with fxmem's planner as its partitioner. The plan is first fitted, on
    fake tensors, to the step as Inductor runs it (`fxmem.run.inductor.planning.FusedPlanning`: the fused step's
    peak within the budget, and its peak and time the plan's predictions), then applied as it is compiled
    (recorded once)."""
    asked = planner.request
    if asked.plan is None:
        fakes = list(example_inputs)
        if detect_fake_mode([x for x in fakes if isinstance(x, torch.Tensor)]) is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in fakes]
        FusedPlanning(planner, call=functools.partial(Planner.__call__, planner)).plan(gm, fakes)
        planner.request = dataclasses.replace(asked, plan=planner.plan)
    try:
        return compile_with_partitioner(gm, example_inputs, planner)
    finally:
        planner.request = asked

