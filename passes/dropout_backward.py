"""Dropout's backward as eager computes it on CPU in half precision.

Reads and rewrites an AOTAutograd joint graph in place, before it is planned. Tracing turns
`dropout` into `native_dropout`, whose backward `native_dropout_backward(grad, mask, scale)`
multiplies by the scale in float. Eager PyTorch on CPU runs dropout as `noise = bernoulli(1 - p)`,
`noise.div_(1 - p)` in the input's dtype, `input * noise`, so its backward multiplies by the
bf16/fp16-rounded scale (1.109375 for p = 0.1 in bf16, not 1.1111). Under autocast that made
gradients differ from eager in their last bits. This pass rewrites each CPU bf16/fp16
`native_dropout_backward` into `grad * (mask.to(dtype) / (1 - p))`, eager's arithmetic, keeping the
one-byte mask as what backward reads. fp32 (and CUDA, where eager uses `native_dropout` itself)
already match and are left alone.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)


def eager_dropout_backward(joint: torch.fx.GraphModule) -> int:
    """Rewrite the joint graph's CPU half-precision dropout backwards; returns how many were rewritten."""
    rewritten = 0
    for node in list(joint.graph.find_nodes(op="call_function", target=aten.native_dropout_backward.default)):
        grad, mask, scale = node.args[:3]
        val = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or val.dtype not in HALF:
            continue
        with joint.graph.inserting_before(node):
            noise = _with_meta(joint.graph.call_function(aten._to_copy.default, (mask,), {"dtype": val.dtype}),
                               val, node)
            noise = _with_meta(joint.graph.call_function(aten.div.Scalar, (noise, 1.0 / scale)), val, node)
            product = _with_meta(joint.graph.call_function(aten.mul.Tensor, (grad, noise)), val, node)
        node.replace_all_uses_with(product)
        joint.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        joint.graph.lint()
        joint.recompile()
    return rewritten


def _with_meta(new: torch.fx.Node, val: torch.Tensor, old: torch.fx.Node) -> torch.fx.Node:
    new.meta["val"] = val.new_empty(val.shape)
    for key in ("partitioner_tag", "stack_trace", "nn_module_stack", "seq_nr"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    return new
