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

import copy
import dataclasses
import os
import shutil
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.run.inductor.planning import FusedPlanning, compile_with_partitioner, partition_only


INNERS = ("aot_eager", "inductor")


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
    """Runs a captured step (`fxmem.run.engine.CompiledStep`) through Inductor with the step's planner as
    partitioner, in place of AOTAutograd with eager kernels. Called on fake tensors (planning), it
    compiles and answers with fake outputs; on real ones it runs Inductor's code."""

    def __init__(self, step: Any):
        self.step = step
        self.inductor: Callable[..., Any] | None = None
        self.tensor_leaves: list[bool] = []  # which leaves of the captured graph's output are tensors
        self.state: tuple[int, ...] = ()  # the parameters and buffers Inductor's code was made with
        self.fused = FusedPlanning(step.planner)

    def __call__(self, state: dict[str, torch.Tensor], *flat: Any) -> list[torch.Tensor]:
        step, values = self.step, list(flat)
        fake = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        if fake is not None:  # planning: Inductor's joint graph partitioned by the planner, no code made
            with fake:
                outputs = step._flat_forward(state, *flat)
            self.tensor_leaves = [c is None for c in step.out_consts]
            if getattr(step.planner, "request", None) is None:  # a partitioner that only reads the joint graph
                partition_only(flat_graph(step.gm), values, step.planner)
            elif step.planner.plan is None:
                self.fused.plan(flat_graph(step.gm), values)
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

    def _compile(self, gm: torch.fx.GraphModule, fakes: list[Any]) -> Callable[..., Any]:
        """Inductor's code for `gm`, partitioned by the planner: by the plan made while planning (applied
        to the same joint graph, no second solve), else planned now, on fakes first (the fused estimate)."""
        planner = self.step.planner
        asked = planner.request
        if planner.plan is None and asked.plan is None:
            self.fused.plan(gm, fakes)
        if planner.plan is not None and asked.plan is None:
            planner.request = dataclasses.replace(asked, plan=planner.plan)
        try:
            return compile_with_partitioner(gm, fakes, planner)
        finally:
            planner.request = asked
