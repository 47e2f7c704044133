"""RNG replay: a random op the plan recomputes draws the same numbers in backward as in forward.

Reads and rewrites the forward and backward graphs the recompute pass extracted (`rng_pass`, in the
planner's `STEP_PASSES` after `recompute_pass`, which both `fxmem.optimize` and the `torch.compile`
backend run; the planner also runs `replay_random_ops` on every candidate it simulates, so the
simulation sees the saved states). Tags first (`meta["fxmem"]["rng"]`: "save" on the forward op,
"replay" on backward's copy), then rewrites. For each random
op (`torch.Tag.nondeterministic_seeded`, e.g. `native_dropout`) that backward recomputes, forward
runs it through `run_and_save_rng_state`, which saves the generator's state before the op (CPU:
`torch.get_rng_state()`, 5056 bytes; CUDA: the philox seed and offset, on the host) and then runs
it as eager would, so the generator advances as in eager; the state is one more saved value.
Backward's copy runs through `run_with_rng_state(state, op, ...)`, which sets that state, runs the
op and puts the generator back: the mask is bit-identical and later draws are unaffected. The two
mirror the higher-order ops `torch._prims.rng_prims` gives AOTAutograd's `functionalize_rng_ops`,
as plain functions: those ops raise NotImplementedError under a dispatch mode without a rule for
them (MemTracker, the eager meter), while these let such modes see the op inside. Inductor cannot
lower a plain function, so graphs bound for Inductor (`StepGraphs.replay_ops == "torch"`) get torch's
higher-order ops instead, which it runs as fallback kernels; the compile backend asks for replay
under Inductor only with `torch._inductor.config.fallback_random` (random ops are eager's kernels on
torch's generator there; with Inductor's own random numbers they are kept: docs/compile-random.md).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._prims import rng_prims

from fxmem.passes.runner import StepGraphs
from fxmem.price.joint_problem import draws_nothing
from fxmem.meta_keys import HOST, NAMESPACE, RNG


def _device(args: tuple) -> torch.device:
    return next((a.device for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)),
                torch.device("cpu"))


def run_and_save_rng_state(op, *args, **kwargs):
    """The generator state of the op's device, then the op's result (it draws as eager does)."""
    device = _device(args)
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return state, op(*args, **kwargs)


def run_with_rng_state(state, op, *args, **kwargs):
    """The op's result drawn from `state`; the generator is put back afterwards."""
    device = _device(args)
    get, put = ((lambda: torch.cuda.get_rng_state(device)), (lambda s: torch.cuda.set_rng_state(s, device))) \
        if device.type == "cuda" else (torch.get_rng_state, torch.set_rng_state)
    current = get()
    put(state)
    try:
        return op(*args, **kwargs)
    finally:
        put(current)


def draws(node: torch.fx.Node) -> bool:
    """Whether a node is a random op that draws numbers."""
    return (node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
            and not draws_nothing(node))


def rng_pass(graphs: StepGraphs, plan: Any) -> StepGraphs:
    """The forward and backward graphs with every recomputed random op replayed from its saved state,
    through torch's rng higher-order ops when the graphs go to Inductor (`graphs.replay_ops == "torch"`)."""
    replay_random_ops(graphs.fw, graphs.bw, torch_ops=graphs.replay_ops == "torch")
    return graphs


def tag_replayed(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Backward's copies of forward's random ops (a random op backward runs under a forward node's
    name is a recomputation); tags both. Returns backward's copies."""
    forward = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    recomputed = [n for n in bw.graph.nodes if draws(n) and n.name in forward]
    for copy in recomputed:
        for node, role in ((forward[copy.name], "save"), (copy, "replay")):  # meta dicts are shallow copies
            node.meta[NAMESPACE] = {**node.meta.get(NAMESPACE, {}), RNG: role}
    return recomputed


def replay_random_ops(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, torch_ops: bool = False,
                      for_gpu: bool = False) -> int:
    """Rewrite the random ops backward recomputes; returns how many. With `torch_ops`, through torch's
    `run_and_save_rng_state` / `run_with_rng_state` higher-order ops (Inductor runs them as fallback
    kernels; a plain function is not an op it can lower), else through this module's functions.
    `for_gpu`: the graphs are simulated for a GPU, so each saved state is CUDA's (on the host) even
    where they were traced on the CPU, whose generator state would be 5056 bytes on the device."""
    save, replay_op = (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state) if torch_ops \
        else (run_and_save_rng_state, run_with_rng_state)
    recomputed = tag_replayed(fw, bw)
    forward = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    if not recomputed:
        return 0
    # AOTAutograd passes backward the saved sizes, then the saved tensors, then the tangents, and
    # forward returns its outputs, the saved tensors, then the saved sizes: each state goes last
    # among the saved tensors on both sides
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    fw_output = fw.graph.output_node()
    outputs = list(fw_output.args[0])
    sizes = 0
    while sizes < len(outputs) and _is_size(outputs[len(outputs) - 1 - sizes]):
        sizes += 1
    saved, saved_sizes = outputs[:len(outputs) - sizes], outputs[len(outputs) - sizes:]
    for copy in recomputed:
        state = _save_state(fw, forward[copy.name], save, for_gpu)
        saved.append(state)
        where = bw.graph.inserting_before(tangents[0]) if tangents else bw.graph.inserting_after(placeholders[-1])
        with where:
            state_in = bw.graph.placeholder(state.name)
        placeholders.append(state_in)
        state_in.meta = dict(state.meta)
        with bw.graph.inserting_before(copy):
            replay = bw.graph.call_function(replay_op, (state_in, copy.target, *copy.args), dict(copy.kwargs))
        replay.meta = dict(copy.meta)
        copy.replace_all_uses_with(replay)
        bw.graph.erase_node(copy)
    fw_output.args = (tuple(saved + saved_sizes),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return len(recomputed)


def _is_size(value: Any) -> bool:
    """A symbolic size forward saves for backward (a node whose value is not a tensor)."""
    return isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), (torch.SymInt, int))


def _save_state(fw: torch.fx.GraphModule, node: torch.fx.Node, save: Any, for_gpu: bool = False) -> torch.fx.Node:
    """Run forward's `node` through `save` (run_and_save_rng_state); returns the node of the saved state
    (with `for_gpu`, CUDA's state wherever the graph was traced)."""
    value = node.meta["val"]
    fake = next(v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor))
    device = torch.device("cuda") if for_gpu else fake.device
    if hasattr(fake, "fake_mode"):
        with fake.fake_mode:
            state_val = torch.empty(_state_bytes(device), dtype=torch.uint8)
    else:
        state_val = torch.empty(_state_bytes(device), dtype=torch.uint8)
    with fw.graph.inserting_before(node):
        pair = fw.graph.call_function(save, (node.target, *node.args), dict(node.kwargs))
        state = fw.graph.create_node("call_function", operator.getitem, (pair, 0), name=f"{node.name}_rng_state")
        out = fw.graph.call_function(operator.getitem, (pair, 1))
    pair.meta = {**node.meta, "val": (state_val, value)}
    state.meta = {"val": state_val}
    if device.type != "cpu":  # CUDA's state is a host tensor: no device bytes
        state.meta[NAMESPACE] = {HOST: True}
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    fw.graph.erase_node(node)
    return state


def _state_bytes(device: torch.device) -> int:
    """Bytes of the generator state `run_and_save_rng_state` saves on `device` (CUDA's is on the host)."""
    return 16 if device.type == "cuda" else torch.get_rng_state().numel()
