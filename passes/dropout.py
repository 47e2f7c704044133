"""Dropout whose output backward may recompute: the mask is random, the product is not.

`expose_dropout` reads the joint graph's training-mode `aten.native_dropout` nodes and writes,
for each, `mul(mul(input, mask), 1/(1-p))` — bit-identical to the kernel's output — pointing the
output's users at it. The planner can then keep the 1-byte mask and recompute the product in
backward instead of keeping the float output (a random op itself is never recomputed). Nodes it
adds carry meta["fxmem"]["dropout_of"] = the kernel node's name.

Forward evaluates the product too (one pointwise multiply per dropout, counted by the simulator);
reading it off the kernel's output instead would save that multiply at the price of a forward
graph whose values differ from the joint graph the planner simulated.
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
