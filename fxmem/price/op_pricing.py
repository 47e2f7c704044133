"""Op pricing beyond torch's FLOP formulas: attention kernels of every backend, the attention kernel
a GPU runs for an attention node traced on the CPU, and the ops priced by memory traffic for want of
a FLOP formula.

Reads fx nodes (their target and `meta["val"]` fake tensors); writes nothing. `fxmem.price.cost` uses it.
FLOPs of attention are PyTorch's own formulas (`torch.utils.flop_counter.sdpa_flop_count` and
`sdpa_backward_flop_count`: the two matmuls of softmax(q kᵀ) v, and the five of its backward, counted
in full even where the mask is causal), given to `FlopCounterMode` as its custom mapping for every
attention op. Under grouped-query attention (fewer key/value heads than query heads) they are given
the key and value shapes with each head repeated over its group, as the kernel computes it: torch
2.13's formulas count exactly that, torch 2.11's refuse heads that differ.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# Fused attention kernels. Forward ops take (query, key, value, ...); backward ops (grad_out, query,
# key, value, ...): the argument order PyTorch's sdpa formulas read.
ATTENTION_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_fused_attention_overrideable")
ATTENTION_BACKWARD = tuple(f"{name}_backward" for name in ATTENTION_FORWARD)


def _packets(names: tuple[str, ...]) -> list[Any]:
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


def _with_heads(shape: torch.Size, heads: int) -> tuple[int, ...]:
    """A key or value shape (batch, heads, sequence, head size) with each head repeated over its group
    of `heads` query heads (grouped-query attention); as it is where the heads are equal or do not divide."""
    if len(shape) == 4 and shape[1] != heads and shape[1] > 0 and heads % shape[1] == 0:
        return (shape[0], heads, *shape[2:])
    return tuple(shape)


def attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a fused attention forward: torch's `sdpa_flop_count`, key/value heads repeated to the query's."""
    heads = query_shape[1]
    return sdpa_flop_count(query_shape, _with_heads(key_shape, heads), _with_heads(value_shape, heads))


def attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    """FLOPs of a fused attention backward: torch's `sdpa_backward_flop_count`, key/value heads repeated."""
    heads = query_shape[1]
    return sdpa_backward_flop_count(grad_out_shape, query_shape, _with_heads(key_shape, heads),
                                    _with_heads(value_shape, heads))


# Formulas for every attention op (torch's registry lacks the CPU kernel's, and torch 2.11's refuses
# grouped-query shapes); FlopCounterMode wraps them to read shapes, so they are given unwrapped.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **{p: attention_flops for p in _packets(ATTENTION_FORWARD)},
    **{p: attention_backward_flops for p in _packets(ATTENTION_BACKWARD)},
}

# Ops whose work is a few operations per byte they move: the roofline's memory-traffic term is their
# price by design (normalisations, softmax, losses, embeddings, copies, indexing, pooling, factories).
# Ops with the pointwise or reduction tag are counted with them.
MEMORY_BOUND = frozenset({
    "_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "batch_norm_backward",
    "_fused_rms_norm", "_fused_rms_norm_backward", "embedding", "embedding_dense_backward",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
    "mse_loss_backward", "l1_loss", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss",
    "huber_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
    "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "soft_margin_loss_backward", "native_dropout",
    "cat", "stack", "clone", "_to_copy", "copy", "constant_pad_nd", "slice_backward", "select_backward",
    "index", "_unsafe_index", "index_put", "_unsafe_index_put", "index_select", "index_add", "gather",
    "scatter", "scatter_add", "scatter_reduce", "cumsum", "repeat", "roll", "flip", "tril", "triu",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "upsample_nearest2d",
    "upsample_nearest2d_backward", "upsample_bilinear2d", "upsample_bilinear2d_backward",
    "arange", "full", "zeros", "ones", "empty", "scalar_tensor", "new_ones", "new_zeros", "new_empty",
    "new_full", "full_like", "zeros_like", "ones_like", "empty_like", "rand", "randn", "rand_like",
    "randn_like", "bernoulli", "fill", "_assert_tensor_metadata", "lift_fresh_copy", "expand_copy",
})
MEMORY_BOUND_TAGS = (torch.Tag.pointwise, torch.Tag.reduction)


def needs_fallback(node: torch.fx.Node) -> bool:
    """True for an op torch has no FLOP formula for (nor `FLOP_FORMULAS`) that is not memory-bound by
    nature: its work is unknown, and the memory traffic it causes is all that prices it."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return False
    packet = getattr(target, "overloadpacket", None)
    if packet is None:  # a Python function or higher-order op in the graph
        return True
    if packet in flop_registry or packet in FLOP_FORMULAS:
        return False
    if any(tag in MEMORY_BOUND_TAGS for tag in getattr(target, "tags", ())):
        return False
    return packet.__name__.split(".")[-1].rstrip("_") not in MEMORY_BOUND


@dataclass(frozen=True)
class AttentionKernel:
    """The kernel a GPU runs for an attention call: its aten op (or "math" for the unfused path,
    which writes the scores out) and the extra bytes it moves beyond its inputs and outputs."""

    name: str
    extra_bytes: int = 0


# The unfused (math) path writes the b·h·s_q·s_k scores out: forward, the q·kᵀ matmul writes them,
# softmax reads and writes them, the second matmul reads them (4 passes); backward, grad·vᵀ writes
# the score gradients, probsᵀ·grad reads the probabilities, softmax backward reads both and writes
# one, the two matmuls for dq and dk read it (7 passes).
MATH_SCORE_PASSES = {"forward": 4, "backward": 7}


def is_attention(node: torch.fx.Node) -> str | None:
    """"forward" or "backward" for a fused attention node, None otherwise."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "").split(".")[-1]
    return "forward" if name in ATTENTION_FORWARD else "backward" if name in ATTENTION_BACKWARD else None


def gpu_attention_kernel(node: torch.fx.Node) -> AttentionKernel | None:
    """For an attention node traced on the CPU: the kernel CUDA's scaled_dot_product_attention picks
    for the same call on a current GPU (sm80 and newer), in its default order: flash attention
    (16-bit, no mask tensor, equal q/k/v head sizes up to 256), memory-efficient attention (16- or
    32-bit, masks allowed, key and query heads equal), the math path otherwise. None for other nodes."""
    direction = is_attention(node)
    if direction is None:
        return None
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    offset = 1 if direction == "backward" else 0
    query, key, value = args[offset:offset + 3]
    mask = any(_argument(node, name) is not None for name in ("attn_mask", "attn_bias"))
    head = query.shape[-1]
    same_heads = query.shape[1] == key.shape[1]
    if query.dtype in (torch.float16, torch.bfloat16) and not mask and head == key.shape[-1] == value.shape[-1] \
            and head <= 256:
        op = "_scaled_dot_product_flash_attention"
    elif query.dtype in (torch.float16, torch.bfloat16, torch.float32) and same_heads:
        op = "_scaled_dot_product_efficient_attention"
    else:
        b, h, s_q, s_k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        return AttentionKernel("math", MATH_SCORE_PASSES[direction] * b * h * s_q * s_k * query.element_size())
    return AttentionKernel(op + ("_backward" if direction == "backward" else ""))


def _argument(node: torch.fx.Node, name: str) -> Any:
    """The argument `name` of an aten node's call, by its op's schema (None where not given)."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if argument.kwarg_only or index >= len(node.args):
                return node.kwargs.get(name)
            return node.args[index]
    return None
