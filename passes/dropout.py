"""Dropout whose output backward may recompute: the mask is random, the product is not.

`expose_dropout` reads the joint graph's training-mode `aten.native_dropout` nodes and writes,
for each, `mul(mul(input, mask), 1/(1-p))` — bit-identical to the kernel's output — pointing the
output's users at it. The planner can then keep the 1-byte mask and recompute the product in
backward instead of keeping the float output (a random op itself is never recomputed). Nodes it
adds carry meta["fxmem"]["dropout_of"] = the kernel node's name.

`fuse_forward_dropout` reads an extracted forward graph and maps those products back onto the
kernel's own output, so forward does no extra work; only a backward recompute evaluates them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten


def _copy_meta(node: torch.fx.Node, like: torch.fx.Node, val, kernel: torch.fx.Node) -> None:
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", "fxmem")})
    node.meta["val"] = val
    node.meta["fxmem"] = {"dropout_of": kernel.name}


def _part(graph: torch.fx.Graph, kernel: torch.fx.Node, index: int) -> torch.fx.Node | None:
    return next((u for u in kernel.users if u.target is operator.getitem and u.args[1] == index), None)


def expose_dropout(gm: torch.fx.GraphModule) -> int:
    """Rewrite each training-mode dropout's output as input * mask * scale; returns how many."""
    graph, count = gm.graph, 0
    for kernel in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        x, p, train = kernel.args[0], float(kernel.args[1]), kernel.args[2] if len(kernel.args) > 2 else True
        out = _part(graph, kernel, 0)
        if not train or not 0.0 < p < 1.0 or out is None or not out.users:
            continue
        mask = _part(graph, kernel, 1)
        if mask is None:
            with graph.inserting_after(out):
                mask = graph.call_function(operator.getitem, (kernel, 1))
            mask.meta.update({k: v for k, v in out.meta.items() if k not in ("val", "tensor_meta")})
            mask.meta["val"] = kernel.meta["val"][1]
        anchor = max(out, mask, key=lambda n: list(graph.nodes).index(n))
        scale = 1.0 / (1.0 - p)
        with graph.inserting_after(anchor):
            masked = graph.call_function(aten.mul.Tensor, (x, mask))
        with graph.inserting_after(masked):
            product = graph.call_function(aten.mul.Tensor, (masked, scale))
        _copy_meta(masked, out, aten.mul.Tensor(x.meta["val"], mask.meta["val"]), kernel)
        _copy_meta(product, out, aten.mul.Tensor(masked.meta["val"], scale), kernel)
        out.replace_all_uses_with(product)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def fuse_forward_dropout(fw: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """In a forward graph, read each dropout product off its kernel's output instead (the node
    keeps its name)."""
    graph, changed = fw.graph, False
    kernels = {n.name: n for n in graph.find_nodes(op="call_function", target=aten.native_dropout.default)}
    for node in list(graph.nodes):
        source = node.meta.get("fxmem", {}).get("dropout_of") if node.op == "call_function" else None
        if source not in kernels or node.target is not aten.mul.Tensor or not isinstance(node.args[1], float):
            continue
        kernel = kernels[source]
        # The product becomes the kernel's output, keeping its name (plans and later passes refer
        # to it) and its storage (the one backward receives).
        kernel.meta["val"] = (node.meta["val"], *kernel.meta["val"][1:])
        node.target, node.args, node.kwargs = operator.getitem, (kernel, 0), {}
        old = next((u for u in kernel.users if u is not node and u.target is operator.getitem and u.args[1] == 0),
                   None)
        if old is not None:
            old.replace_all_uses_with(node)
            graph.erase_node(old)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
        fw.recompile()
    return fw
