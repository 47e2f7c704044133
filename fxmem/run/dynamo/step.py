"""The step of a model that torch.export cannot capture whole, planned through Dynamo instead.

Reads the user's model and the request the whole-graph capture failed on; writes nothing. Where
forward has data-dependent control flow (a label check such as `if labels.max() >= n`, LayerDrop's
random `if`), an op of data-dependent shape, or code torch.export refuses, `fxmem.optimize` falls back
to `torch.compile(model, backend="fxmem")` with the same budget: Dynamo splits forward at the breaks,
runs the Python between the graphs eagerly, and the compile backend (`fxmem.backend`) plans every
graph of the step under the one budget; a first forward without autograd (`fxmem.run.dynamo.ledger.survey_step`)
tells the ledger which graph uses which parameters, so each graph's plan counts the gradients
later graphs produce before its backward, and a second (`probe_step`) what each
graph needs at least, so a budget below what the graphs need together is refused before any runs
and each graph keeps no more for backward than leaves the later graphs room. A graph a loop calls once
per layer counts once per layer of its `ModuleList` (`fxmem.run.dynamo.layer_loops`), the layers the first step
skipped (LayerDrop) included. The graphs run with AOTAutograd's eager kernels
(`inner="aot_eager"`), so training matches eager as the whole-graph path does.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import Any, Sequence

import torch

from fxmem.error_boundary import for_dynamo
from fxmem.run.dynamo.compile import CompileSettings, compile_graph, ledger_for, ledger_of, open_ledger, \
    plans_for, reset
from fxmem.trace.capture import untouched
from fxmem.errors import FxmemError, InfeasibleBudgetError, TraceError
from fxmem.run.dynamo.eager_held import EagerHeld
from fxmem.run.dynamo.shared_budget import shares_for
from fxmem.run.planners import ProbePlanner, recording_planner
from fxmem.run.dynamo.layer_loops import every_layer
from fxmem.run.dynamo.ledger import Ledger, survey_step
from fxmem.planner.plan import Plan
from fxmem.planner.planner import PlanRequest
from fxmem.planner.resident import refusal_with_resident, resident_parts, with_resident

log = logging.getLogger("fxmem")
RECOMPILE_LIMIT = 64


def probe_step(model: torch.nn.Module, args: Sequence[Any], kwargs: dict, settings: CompileSettings, survey: list,
               model_name: str) -> tuple[list[ProbePlanner], EagerHeld, int]:
    """Run one forward through Dynamo with the fxmem backend's requests, keep-all plans only: the
    planner of each graph, in the order the step runs them; what the eager code between the graphs keeps for
    its backward (`fxmem.run.dynamo.eager_held`) and the bytes the eager code after the last graph adds at
    backward's start."""
    ledger = Ledger(0, model=model, survey=survey, model_name=model_name)
    planners: list[ProbePlanner] = []
    held = EagerHeld()
    held.exclude(list(model.parameters()) + list(model.buffers()))
    cut: list[weakref.ref] = []  # the graphs' outputs as the eager code gets them, not kept alive

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        def planner_for(request, record):
            planners.append(ProbePlanner(dataclasses.replace(request, budget_bytes=None), ledger, record))
            return planners[-1]
        compiled = compile_graph(gm, example_inputs, settings, ledger, planner_for, count_saved=False)
        return _cut(compiled, planners[-1].record.index, held, cut)

    with untouched(model):
        out = torch.compile(model, backend=backend)(*args, **kwargs)
        tail = _tail(out, held, cut)
    del out
    return [p for p in planners if p.plan is not None], held, tail  # graphs without a backward are not planned


def _tail(out: Any, held: EagerHeld, cut: list[weakref.ref]) -> int:
    """`EagerHeld.tail` of the probe's loss (0 where the step returns none: the caller computes it)."""
    from fxmem.trace.loss import classify, loss_of

    if classify(out).kind == "outside":
        return 0
    loss = loss_of(out)
    if loss.grad_fn is None:
        return 0
    return held.tail(loss, [t for t in (ref() for ref in cut) if t is not None])


def _cut(compiled: Any, index: int, held: EagerHeld, cut: list[weakref.ref]) -> Any:
    """`compiled` (graph `index`), its outputs cut from autograd (requiring gradients as they did): what it keeps
    for a backward the probe never runs is freed as it returns, so the probe holds one graph's activations at a
    time (and the tensors passed between graphs twice), not the whole forward's: the first call of a step holds
    no more than the calls after it. What its inputs' eager history saved is counted in `held` first."""
    def run(*args: Any) -> Any:
        held.graph_called(index, args)
        out = compiled(*args)
        outs = type(out)(o.detach().requires_grad_().clone() if isinstance(o, torch.Tensor) and o.requires_grad
                         else o for o in out)  # not a leaf: code between the graphs may write into it
        held.exclude(outs)
        cut.extend(weakref.ref(o) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
        return outs

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run


def _backend(settings: CompileSettings) -> Any:
    """The `torch.compile` backend of one step: each graph planned under `settings`, its plan recorded in
    the step's ledger (known by `settings`), errors as the `fxmem` backend raises them."""
    @for_dynamo
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        ledger = ledger_of(settings, settings)
        return compile_graph(gm, example_inputs, settings, ledger, recording_planner(ledger, settings))

    backend.reset = reset  # type: ignore[attr-defined]  # called by torch._dynamo.reset()
    return backend


def eager_random():
    """Dynamo, by default, draws `np.random` from torch's generator (other numbers than eager's, and
    torch's generator left elsewhere); NumPy's own stream, as eager draws it (transformers' SpecAugment
    masks), runs the draws eagerly between the graphs."""
    return torch._dynamo.config.patch(use_numpy_random_stream=True)


class DynamoStep:
    """A compiled `model` whose graphs, split where Dynamo breaks, share `request`'s budget."""

    def __init__(self, model: torch.nn.Module, request: PlanRequest, reason: TraceError):
        if request.plan is not None or request.offload or request.pool or request.resident_bytes:
            raise TraceError(reason.construct, reason.fix + "; plan=, offload=, pool= and optimizer= need the "
                             "model captured as one graph (without them fxmem.optimize plans it through Dynamo)")
        # gradients resident from the start (accumulation): the graphs share the budget less them
        self.resident = resident_parts(0, request.resident_gradient_bytes, request.resident_gradients)
        self.budget, self.gradients = request.budget_bytes, request.resident_gradients
        if self.resident and self.budget <= sum(self.resident.values()):
            raise InfeasibleBudgetError(self.budget, sum(self.resident.values()) + 1, self.resident)
        self.options = CompileSettings(self.budget - sum(self.resident.values()), request.inner,
                                       request.time_limit_s, device=request.device, solver=request.solver)
        self.reason, self.warned, self.model, self.name = reason, False, model, request.model
        self.compiled = torch.compile(model, backend=_backend(self.options))
        log.info("fxmem: %s could not be captured as one graph (%s); planning its graphs through Dynamo",
                 request.model, reason.construct)

    @property
    def plans(self) -> list[Plan]:
        """One plan per graph Dynamo captured, in order (with resident gradients, stated for the whole budget)."""
        plans = plans_for(self.options)
        if not self.resident:
            return plans
        return [dataclasses.replace(with_resident(p, self.resident, self.budget), resident_gradients=self.gradients)
                for p in plans]

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        # a frame whose guards fail is compiled (and planned) again; past Dynamo's recompile limit it would run
        # eagerly, unplanned (a memory meter's global module hooks, new each step, fail a guard every step)
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with eager_random(), torch._dynamo.config.patch(recompile_limit=limit):
            return self._step(args, kwargs)

    def _step(self, args: tuple, kwargs: dict) -> Any:
        ledger = ledger_for(self.options)
        if ledger is None and torch.is_grad_enabled():  # the first step: learn which graphs use which parameters
            survey = survey_step(self.model, args, kwargs)  # and what each graph needs at least
            survey, added = every_layer(self.model, survey)  # with every layer of a LayerDrop loop running
            probes, held, tail = probe_step(self.model, args, kwargs, self.options, survey, self.name)
            for probe in probes:
                probe.runs = probe.record.calls + added.get(frozenset(probe.record.grads), 0)
            try:
                shares = shares_for(probes, self.options.budget_bytes, held.at_graph, (held.last, tail))
            except InfeasibleBudgetError as exc:
                if not self.resident:
                    raise
                raise refusal_with_resident(exc, self.resident, self.budget) from None
            ledger = open_ledger(self.options, self.options, self.model, survey, self.name, shares,
                                 {p.record.index: p.runs for p in probes if p.runs > 1}, held.at_graph,
                                 (held.last, tail))
        before = [r.calls for r in ledger.records] if ledger is not None else []
        try:
            out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # fxmem's own refusal, as the one-graph path says it
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, InfeasibleBudgetError) and self.resident:
                raise refusal_with_resident(inner, self.resident, self.budget) from None
            if isinstance(inner, FxmemError):
                raise inner from None
            raise
        self._check_repeats(before)
        return out

    def _check_repeats(self, before: list[int]) -> None:
        """Warn once when a graph ran more often in this step than the budget counts (once, or once per
        layer of the loop that calls it): each run keeps its own activations for backward."""
        ledger = ledger_for(self.options)
        if self.warned or ledger is None:
            return
        before = before + [0] * (len(ledger.records) - len(before))
        runs = [ledger.runs.get(ledger.position(r), 1) for r in ledger.records]  # a recompiled frame: its first's
        repeated = [(r.index, r.calls - b, most) for r, b, most in zip(ledger.records, before, runs)
                    if r.calls - b > most]
        if repeated:
            self.warned = True
            runs = ", ".join(f"graph {i} {n} times (budgeted for {most})" for i, n, most in repeated)
            message = (f"fxmem: one step ran {runs}: a loop with a graph break whose runs fxmem did not count (not "
                       "one graph per layer of a ModuleList, or layers the first step skipped all of); each run keeps "
                       "its activations for backward, so the step may use more than budget_gb. Capture the loop as "
                       "one graph (decide the skips outside forward) to plan it exactly")
            warnings.warn(message, stacklevel=3)
