"""RNG replay: a random op the plan recomputes draws the same numbers in backward as in forward.

Reads and rewrites the forward and backward graphs the recompute pass extracted (called from
`passes/recompute.partition`, so the planner's simulation sees the saved states). For each random
op (`torch.Tag.nondeterministic_seeded`, e.g. `native_dropout`) that backward recomputes, forward
runs it through `run_and_save_rng_state`, which saves the generator's state before the op (CPU:
`torch.get_rng_state()`, 5056 bytes; CUDA: the philox seed and offset, on the host) and then runs
it as eager would, so the generator advances as in eager; the state is one more saved value.
Backward's copy runs through `run_with_rng_state(state, op, ...)`, which sets that state, runs the
op and puts the generator back: the mask is bit-identical and later draws are unaffected. The two
mirror the higher-order ops of AOTAutograd's `functionalize_rng_ops`, as plain functions, so
dispatch modes (MemTracker) see the ops inside them; Inductor cannot compile them, so the compile
backend asks for this only with `inner="aot_eager"`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fxmem.schedule import draws_nothing


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


def replay_random_ops(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Rewrite the random ops backward recomputes; returns how many."""
    forward = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    recomputed = [n for n in bw.graph.nodes if draws(n) and n.name in forward]
    if not recomputed:
        return 0
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    if any(not isinstance(p.meta.get("val"), torch.Tensor) for p in placeholders if p not in tangents):
        raise NotImplementedError("replaying a random op's generator in a graph that saves symbolic sizes")
    fw_output = fw.graph.output_node()
    saved = list(fw_output.args[0])
    for copy in recomputed:
        state = _save_state(fw, forward[copy.name])
        saved.append(state)
        where = bw.graph.inserting_before(tangents[0]) if tangents else bw.graph.inserting_after(placeholders[-1])
        with where:
            state_in = bw.graph.placeholder(state.name)
        placeholders.append(state_in)
        state_in.meta["val"] = state.meta["val"]
        with bw.graph.inserting_before(copy):
            replay = bw.graph.call_function(run_with_rng_state, (state_in, copy.target, *copy.args), dict(copy.kwargs))
        replay.meta = dict(copy.meta)
        copy.replace_all_uses_with(replay)
        bw.graph.erase_node(copy)
    fw_output.args = (tuple(saved),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return len(recomputed)


def _save_state(fw: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """Run forward's `node` through run_and_save_rng_state; returns the node of the saved state."""
    value = node.meta["val"]
    fake = next(v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor))
    if hasattr(fake, "fake_mode"):
        with fake.fake_mode:
            state_val = torch.empty(_state_bytes(fake.device), dtype=torch.uint8)
    else:
        state_val = torch.empty(_state_bytes(fake.device), dtype=torch.uint8)
    with fw.graph.inserting_before(node):
        pair = fw.graph.call_function(run_and_save_rng_state, (node.target, *node.args), dict(node.kwargs))
        state = fw.graph.create_node("call_function", operator.getitem, (pair, 0), name=f"{node.name}_rng_state")
        out = fw.graph.call_function(operator.getitem, (pair, 1))
    pair.meta = {**node.meta, "val": (state_val, value)}
    state.meta = {"val": state_val}
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    fw.graph.erase_node(node)
    return state


def _state_bytes(device: torch.device) -> int:
    """Bytes of the generator state `run_and_save_rng_state` saves on `device` (CUDA's is on the host)."""
    return 16 if device.type == "cuda" else torch.get_rng_state().numel()
