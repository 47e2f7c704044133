"""Inductor runs fxmem's plan: a captured step compiled by Inductor's own pipeline (`compile_fx`:
decompositions, joint-graph passes, fusion and code generation for the forward and backward graphs)
with fxmem's planner as its partitioner, so what backward keeps and what it recomputes is fxmem's
choice and Inductor fuses the rest. `fxmem.optimize(..., inner="inductor")` and the torch.compile
backend both compile this way.

Reads the captured graph (`fxmem.capture`), whose parameters and buffers are the model's own tensors:
Inductor's code holds them (as a torch.compile'd module does), and is made again if the model's
tensors are replaced. Random ops: unless
`torch._inductor.config.fallback_random`, Inductor's joint-graph passes (run before the planner sees the
graph) replace each random op by `inductor_random(shape, seed)`, a pure function of a seed drawn once per
graph (`inductor_seeds`, tagged random): the planner keeps the seeds and may recompute the draws and the
masks made from them, which are then forward's (`replays_random`). Writes Inductor's usual cache of
generated code (its own folder); nothing else.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.joint_cache import copy_joint


INNERS = ("aot_eager", "inductor")
FUSED_TRIES = 4  # plans made (each lowered by Inductor) to fit the fused step to a budget


def has_cxx_compiler() -> bool:
    """Whether Inductor can build CPU kernels here (it needs a C++ compiler)."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


def check_inner(inner: str) -> str:
    """`inner` if it names a way to run planned graphs, else a one-line error."""
    if inner not in INNERS:
        raise ValueError(f"inner must be one of {INNERS}, got {inner!r}")
    if inner == "inductor" and not has_cxx_compiler():
        raise ValueError("inner='inductor' needs a C++ compiler for Inductor's CPU kernels (g++, clang++ or $CXX), "
                         "and none was found; install one, or use inner='aot_eager'")
    return inner


def default_inner(device: torch.device, passes: bool = False) -> str:
    """How `fxmem.optimize` runs a planned step unless told: Inductor for a model on a GPU, where fused
    kernels make the step faster and its peak lower (GPT-2 124M, 8x1024, H200: 7037.8 MiB measured at the
    budget of full checkpointing's peak, BENCHMARKS.md); eager kernels on a CPU, where Inductor compiles
    each graph for tens of seconds and the step then trains bit for bit as eager does. `passes`:
    offload, pool or several devices are asked for, which run on eager kernels only."""
    return "inductor" if device.type == "cuda" and not passes and has_cxx_compiler() else "aot_eager"


def replays_random(inner: str) -> bool:
    """Whether random ops (torch's `nondeterministic_seeded` tag) may be recomputed, replayed from the
    generator state they drew from (passes/rng.py): with eager kernels, and with Inductor under
    `torch._inductor.config.fallback_random`, where random ops are eager's own kernels on torch's
    generator. With Inductor's own random numbers (the default) the only such op left is the per-graph
    seed draw, which is kept; the draws made from it are pure functions of the seed and may be
    recomputed (docs/compile-random.md)."""
    if inner != "inductor":
        return True
    from torch._inductor import config as inductor_config

    return bool(inductor_config.fallback_random)


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
                             partitioner: Callable[..., Any], inner_compile: Callable[..., Any] | None = None
                             ) -> Callable[..., Any]:
    """Inductor's compile_fx pipeline for `gm`, with `partitioner` (fxmem's planner) splitting the joint
    graph into forward and backward; caches off, since a plan depends on the budget, not only the graph."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class FxmemPartitioner(_InductorPartitioner, CustomPartitionerFn):
        pass

    with torch._functorch.config.patch(enable_autograd_cache=False), \
            inductor_config.patch(custom_partitioner_fn=FxmemPartitioner(partitioner), fx_graph_cache=False):
        if inner_compile is None:
            return compile_fx(gm, list(example_inputs))
        return compile_fx(gm, list(example_inputs), inner_compile=inner_compile)


def flat_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` called with its placeholders' values in order and returning one flat tuple of its output's
    leaves; its parameters and buffers (the model's own tensors, `fxmem.capture`) are shared, not copied."""
    graph = copy.deepcopy(gm.graph)
    graph._codegen = torch.fx.graph.CodeGen()  # flat inputs and outputs, not the captured pytree
    output = graph.find_nodes(op="output")[0]
    output.args = (tuple(pytree.tree_leaves(output.args[0])),)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


class InductorRunner:
    """Runs a captured step (`fxmem.engine.CompiledStep`) through Inductor with the step's planner as
    partitioner, in place of AOTAutograd with eager kernels. Called on fake tensors (planning), it
    compiles and answers with fake outputs; on real ones it runs Inductor's code."""

    def __init__(self, step: Any):
        self.step = step
        self.inductor: Callable[..., Any] | None = None
        self.tensor_leaves: list[bool] = []  # which leaves of the captured graph's output are tensors
        self.state: tuple[int, ...] = ()  # the parameters and buffers Inductor's code was made with
        self.timer: Any = None  # a KernelTimer for the aten kernels Inductor calls, where the planner calibrates

    def __call__(self, state: dict[str, torch.Tensor], *flat: Any) -> list[torch.Tensor]:
        step, values = self.step, list(flat)
        fake = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        if fake is not None:  # planning: Inductor's joint graph partitioned by the planner, no code made
            with fake:
                outputs = step._flat_forward(state, *flat)
            self.tensor_leaves = [c is None for c in step.out_consts]
            if step.planner.plan is None:
                self._plan_fused(flat_graph(step.gm), values)
            return outputs
        tensors = tuple(id(t) for t in state.values())
        if self.inductor is None or tensors != self.state:  # Inductor's code holds the tensors it was made with
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
            with mode:  # what the step returns, and where its tensors are among the graph's outputs
                step._flat_forward({n: mode.from_tensor(t) for n, t in state.items()}, *fakes)
            self.tensor_leaves = [c is None for c in step.out_consts]
            self.inductor, self.state = self._compile(flat_graph(step.gm), fakes), tensors
        leaves = self.inductor(*values)
        return [x for x, tensor in zip(leaves, self.tensor_leaves) if tensor]

    def _plan_at(self, gm: torch.fx.GraphModule, fakes: list[Any], request: Any) -> tuple[Any, Any]:
        """The planner's plan for Inductor's joint graph of `gm` under `request` (Inductor makes no code), with
        the step as Inductor runs it: its peak and timeline (`timelines["inductor"]`, `fxmem.inductor_memory`)
        and its time (`fxmem.inductor_time`) as the plan's predictions; the unfused graph's peak stays in
        `timelines["plan"]`, and the step's time with nothing recomputed moves with the fused one."""
        from fxmem.inductor_memory import simulate_fused
        from fxmem.inductor_time import step_seconds
        from fxmem.plan_facts import trained_parameters

        planner = self.step.planner
        planner.request, planner.plan = request, None
        graphs: list[Any] = []

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = planner(joint, joint_inputs, **kwargs)
            graphs[:] = [copy_joint(fw), copy_joint(bw), trained_parameters(joint, planner.num_fwd_outputs)]
            raise _Planned

        try:
            compile_with_partitioner(gm, fakes, partition)
        except _Planned:
            pass
        fw, bw, num_parameters = graphs
        fused_fw = schedule(fw, False)
        fused_bw = schedule(bw, True, donated_inputs(fw, bw, planner.num_fwd_outputs))
        fused = simulate_fused(fw, bw, fused_fw, fused_bw, planner.num_fwd_outputs, planner.allocator)
        plan = planner.plan
        if request.calibrate and self.timer is None:
            from fxmem.kernel_timer import KernelTimer

            self.timer = KernelTimer(next(t.device for t in fakes if isinstance(t, torch.Tensor)))
        seconds = step_seconds(fused_fw, fused_bw, request.device, num_parameters, self.timer)
        plan = dataclasses.replace(plan, predicted_peak_bytes=fused.peak, timelines={**plan.timelines, "inductor": fused},
                                   predicted_step_s=seconds,
                                   baseline_step_s=max(0.0, seconds - (plan.predicted_step_s - plan.baseline_step_s)))
        return plan, fused

    def _plan_fused(self, gm: torch.fx.GraphModule, fakes: list[Any]) -> None:
        """The plan whose step, as Inductor fuses it, fits the budget (`_fit_fused`), with the fused step's
        peak and time as its predictions (`_plan_at`). Without a budget, or under a policy, the fused step
        is only simulated."""
        planner = self.step.planner
        asked = planner.request
        budget = asked.budget_bytes
        try:
            if budget is None or asked.policy is not None:
                plan, fused = self._plan_at(gm, fakes, asked)
            else:
                plan, fused = self._fit_fused(gm, fakes, asked, budget - planner.margin.bytes_for(budget))
        finally:
            planner.request = asked
        planner.plan = dataclasses.replace(plan, budget_bytes=plan.budget_bytes if budget is None else budget)

    def _fit_fused(self, gm, fakes, asked, limit: int) -> tuple[Any, Any]:
        """A plan whose fused step is within `limit` (the budget less the planning margin), and that step.
        The planner fits the unfused graph to a target (first the budget), the fused step is simulated, and
        the target moves by what it left over or overshot, for the plan that fits in the least time (at
        most `FUSED_TRIES` plans, each lowered by Inductor). Below the unfused graph's least, that least is
        planned; refused, naming the least budget of the fused step there, where nothing fits."""
        from fxmem.errors import InfeasibleBudgetError

        least = self.step.planner.margin.least_budget
        target, fits = asked.budget_bytes, []
        for attempt in range(FUSED_TRIES):
            if attempt == FUSED_TRIES - 1 and not fits:
                target = 1  # the last try: the unfused graph's least
            try:
                plan, fused = self._plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=target))
            except InfeasibleBudgetError as refusal:
                if target >= refusal.min_budget_bytes:
                    raise
                plan, fused = self._plan_at(gm, fakes, dataclasses.replace(asked, budget_bytes=refusal.min_budget_bytes))
                if fused.peak <= limit:
                    fits.append((plan, fused))
                elif not fits:
                    raise InfeasibleBudgetError(asked.budget_bytes, least(fused.peak), refusal.breakdown) from None
                break
            if fused.peak <= limit:
                fits.append((plan, fused))
                if not plan.recompute or fused.peak * 1.02 > limit:
                    break  # nothing recomputed, or the fused step within 2% under the budget
            target += limit - fused.peak
        return min(fits, key=lambda fit: fit[0].predicted_step_s)

    def _compile(self, gm: torch.fx.GraphModule, fakes: list[Any]) -> Callable[..., Any]:
        """Inductor's code for `gm`, partitioned by the planner: by the plan made while planning (applied
        to the same joint graph, no second solve), else planned now, on fakes first (the fused estimate)."""
        planner = self.step.planner
        asked = planner.request
        if planner.plan is None and asked.plan is None:
            self._plan_fused(gm, fakes)
        if planner.plan is not None and asked.plan is None:
            planner.request = dataclasses.replace(asked, plan=planner.plan)
        try:
            return compile_with_partitioner(gm, fakes, planner)
        finally:
            planner.request = asked


class _Planned(Exception):
    """Raised by a plan-only partitioner once the plan is made: stops Inductor before code generation."""


def schedule(graph: torch.fx.GraphModule, is_backward: bool, donated: Sequence[int] = ()) -> Any:
    """`graph` (a planned forward or backward graph) as Inductor lowers and fuses it: its
    `fxmem.inductor_memory.ScheduledGraph`; no code is made. `donated`: backward's inputs AOTAutograd
    hands over to it (`donated_inputs`), whose storage Inductor may write a result into."""
    from unittest import mock

    from fxmem.inductor_memory import schedule_only

    inputs = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
    found: list[Any] = []
    mode = detect_fake_mode([x for x in inputs if isinstance(x, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext(), \
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

    from fxmem.memory import graph_outputs

    def val(node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else None

    outputs = graph_outputs(fw)
    saved = [n for n in outputs[num_user_outputs:] if isinstance(val(n), torch.Tensor)]
    found = collect_fw_donated_buffer_idxs([val(n) for n in fw.graph.find_nodes(op="placeholder")],
                                           [val(n) for n in outputs[:num_user_outputs]],
                                           [val(n) for n in graph_outputs(bw)], [val(n) for n in saved])
    names = {saved[i].name for i in found}
    return [i for i, node in enumerate(bw.graph.find_nodes(op="placeholder")) if node.name in names]
