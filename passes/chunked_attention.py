"""Chunked attention pass: naive attention in a captured graph, `q @ kt -> [scale] -> [masks] -> softmax ->
[dropout of p=0 or not training] -> @ v`, run in chunks of query rows (`fxmem.ops.chunked_attention`), so
the batch x heads x queries x keys scores are never all alive at once.

Reads a captured (torch-level) GraphModule, as symbolic_trace (`@`/`torch.matmul`, `*`/`/` by a number,
`masked_fill`, `torch.where`, `+` a mask, `F.softmax`/`.softmax`, `nn.Dropout`/`F.dropout`) or
torch.export (their aten ops) make it, and the chunk count the plan chose (`Plan.attention_chunks`).
`attention_sites` finds the pattern; `chunk_attention` replaces each one by one `chunked_attention`
node (1 chunk: nothing changes). Sites are matched where every value between the two matmuls has no
other reader (a model that returns its attention probabilities keeps them whole), the softmax is over
the last dimension in the scores' dtype, masks do not need gradients except an additive one, and
dropout on the probabilities draws nothing (p=0, or not training): dropout with p>0 is left as
traced, since a chunked form cannot use eager's batch x heads x queries x keys masks without making
them. Writes `meta["fxmem"]["attention_chunks"]` on each new node.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.ops.chunked_attention import chunked_attention
from fxmem.ops.chunked_cross_entropy import chunk_bounds
from fxmem.meta_keys import ATTENTION_CHUNKS, NAMESPACE

aten = torch.ops.aten
_MATMUL = {operator.matmul, torch.matmul, torch.bmm, aten.matmul.default, aten.bmm.default}
_MUL = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}
_DIV = {operator.truediv, torch.div, torch.true_divide, aten.div.Tensor, aten.div.Scalar}
_ADD = {operator.add, torch.add, aten.add.Tensor}
_FILL = {torch.masked_fill, aten.masked_fill.Scalar}
_WHERE = {torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf}
_SOFTMAX = {F.softmax, torch.softmax, aten.softmax.int, aten._softmax.default}
_DROPOUT = {F.dropout, torch.dropout, aten.dropout.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default}


@dataclass(frozen=True)
class AttentionSite:
    """One naive attention in a captured graph; sizes for pricing and the table."""

    output: str
    scores: str
    batch: int  # batch x heads (every dimension before the queries)
    queries: int
    keys: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype

    def score_flops(self) -> int:
        """FLOPs of q @ kt: what chunking computes once more in backward."""
        return 2 * self.batch * self.queries * self.keys * self.head_dim

    def region_bytes(self) -> int:
        """About what chunking can free at most: the scores, their softmax and gradients, whole."""
        return 3 * self.batch * self.queries * self.keys * torch.finfo(self.dtype).bits // 8

    def chunk_rows(self, chunks: int) -> int:
        return chunk_bounds(self.queries, chunks)[0][1]


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [user for user in node.users
            if not (user.op == "call_function" and user.target is aten._assert_tensor_metadata.default)]


def _is(node, targets: set, methods: tuple = ()) -> bool:
    return isinstance(node, torch.fx.Node) and (
        node.op == "call_function" and node.target in targets or node.op == "call_method" and node.target in methods)


def _number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _scalar(x) -> bool:
    """A Python number, or a node that computes one (a scale from the input's shape, `math.sqrt(C // h)`)."""
    return _number(x) or isinstance(x, torch.fx.Node) and x.op == "call_function" \
        and not isinstance(x.meta.get("val"), (torch.Tensor, tuple, list))


def _bool_mask(node) -> bool:
    val = _val(node)
    return val is not None and val.dtype == torch.bool


def _score_op(node: torch.fx.Node, scores: torch.fx.Node, masks: list) -> tuple | None:
    """The score op `node` applies to `scores` (see fxmem.ops.chunked_attention), adding its tensor to `masks`."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if _is(node, _MUL, ("mul",)) and len(args) == 2 and not kwargs:
        other = args[1] if args[0] is scores else args[0]
        return ("mul", other) if _scalar(other) else None
    if _is(node, _DIV, ("div",)) and len(args) == 2 and not kwargs and args[0] is scores and _scalar(args[1]):
        return ("div", args[1])
    if _is(node, _FILL, ("masked_fill",)) and len(args) == 3 and not kwargs and args[0] is scores \
            and _number(args[2]) and _bool_mask(args[1]):
        masks.append(args[1])
        return ("fill", len(masks) - 1, args[2])
    if _is(node, _WHERE) and len(args) == 3 and not kwargs and _bool_mask(args[0]) and scores in args[1:]:
        other = args[2] if args[1] is scores else args[1]
        if not _number(other):
            return None
        masks.append(args[0])
        return ("where", len(masks) - 1, other, args[1] is scores)
    if _is(node, _ADD, ("add",)) and len(args) == 2 and not kwargs and scores in args:
        other = args[1] if args[0] is scores else args[0]
        if not isinstance(_val(other), torch.Tensor) or other is scores:
            return None
        masks.append(other)
        return ("add", len(masks) - 1)
    return None


def _scores_arg(node: torch.fx.Node, shape: torch.Size) -> torch.fx.Node | None:
    """The argument of a score op that carries the scores: of their shape, read by `node` alone (the
    one made by a matmul or a score op, where a full-size mask is also an argument)."""
    found = [a for a in node.args if isinstance(a, torch.fx.Node) and _val(a) is not None
             and _val(a).shape == shape and _readers(a) == [node]]
    if len(found) > 1:
        found = [a for a in found if a.op in ("call_function", "call_method")]
    return found[0] if found else None


def _softmax_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The scores a last-dimension softmax in their own dtype takes, or None."""
    if not _is(node, _SOFTMAX, ("softmax",)):
        return None
    args = list(node.args) + [None] * 3
    dim = node.kwargs.get("dim", args[1])
    if node.target is aten._softmax.default:
        dtype = None if not args[2] else torch.float32
    else:
        dtype = node.kwargs.get("dtype", args[2] if node.target is not F.softmax else args[3])
    val = _val(node)
    if not isinstance(dim, int) or val is None or dim not in (-1, val.dim() - 1) or dtype not in (None, val.dtype):
        return None
    return args[0]


def _same_dtype_cast(node: torch.fx.Node) -> bool:
    """Whether `node` is a `.to`/`.type`/`.float` that leaves its input's dtype, shape and device (transformers'
    `attn_weights.type(value.dtype)`)."""
    if not (_is(node, _CASTS, ("to", "type", "float", "type_as")) and node.args):
        return False
    val, source = _val(node), _val(node.args[0])
    return val is not None and source is not None and (val.dtype, val.shape, val.device) == (
        source.dtype, source.shape, source.device)


def _identity_dropout(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether `node` is a dropout that draws nothing (p=0, or not training)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, torch.nn.Dropout) and (module.p == 0 or not module.training)
    if _is(node, _DROPOUT):
        args = list(node.args) + [None] * 3
        p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
        training = node.kwargs.get("training", node.kwargs.get("train", args[2] if args[2] is not None else True))
        return _number(p) and (p == 0 or training is False)
    return False


def _match(gm: torch.fx.GraphModule, out: torch.fx.Node):
    """(AttentionSite, q, kt, v, ops, masks, nodes replaced) for the attention's second matmul, or None."""
    if not _is(out, _MATMUL, ("matmul",)) or len(out.args) != 2 or out.kwargs:
        return None
    probs, v = out.args
    removed = [out]
    while isinstance(probs, torch.fx.Node) and (_identity_dropout(gm, probs) or _same_dtype_cast(probs)) \
            and len(_readers(probs)) == 1:
        removed.append(probs)
        probs = probs.args[0]
    if not isinstance(probs, torch.fx.Node) or len(_readers(probs)) != 1 or _val(probs) is None:
        return None
    shape = _val(probs).shape
    node = _softmax_input(probs)
    removed.append(probs)
    chain = []
    while isinstance(node, torch.fx.Node) and not _is(node, _MATMUL, ("matmul",)):
        if len(_readers(node)) != 1 or _val(node) is None or _val(node).shape != shape:
            return None
        chain.append(node)
        node = _scores_arg(node, shape)
    if not isinstance(node, torch.fx.Node) or len(_readers(node)) != 1 or len(node.args) != 2 or node.kwargs:
        return None
    ops, masks, scores = [], [], node
    for step in reversed(chain):  # the ops in graph order, each reading the scores made before it
        if _same_dtype_cast(step) and step.args[0] is scores:
            scores = step
            continue
        op = _score_op(step, scores, masks)
        if op is None:
            return None
        ops.append(op)
        scores = step
    q, kt = node.args
    qv, ktv, vv, outv = _val(q), _val(kt), _val(v), _val(out)
    if any(x is None or x.dim() < 2 for x in (qv, ktv, vv, outv)) or _val(node).shape != shape \
            or not qv.is_floating_point():
        return None
    removed += [node, *chain]
    site = AttentionSite(out.name, node.name, shape[:-2].numel(), shape[-2], shape[-1], qv.shape[-1], vv.shape[-1],
                         _val(node).dtype)
    return site, q, kt, v, tuple(ops), masks, removed


def attention_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    """The naive attentions in `gm` that `chunk_attention` can chunk."""
    found = (_match(gm, node) for node in gm.graph.nodes)
    return [match[0] for match in found if match is not None]


def chunk_attention(gm: torch.fx.GraphModule, chunks: int) -> torch.fx.GraphModule:
    """`gm` with each attention site computed in `chunks` chunks of query rows (in place; 1: unchanged)."""
    if chunks <= 1:
        return gm
    graph = gm.graph
    for out in list(graph.nodes):
        match = _match(gm, out)
        if match is None:
            continue
        site, q, kt, v, ops, masks, removed = match
        with graph.inserting_before(out):
            node = graph.call_function(chunked_attention, (q, kt, v, chunks, ops, *masks))
        node.meta.update({k: val for k, val in out.meta.items() if k != NAMESPACE})
        node.meta[NAMESPACE] = {ATTENTION_CHUNKS: len(chunk_bounds(site.queries, chunks))}
        out.replace_all_uses_with(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for dead in sorted(removed, key=order.__getitem__, reverse=True):  # readers before producers
            for user in list(dead.users):
                graph.erase_node(user)  # metadata asserts
            graph.erase_node(dead)
    graph.lint()
    gm.recompile()
    return gm
