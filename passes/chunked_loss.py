"""Chunked loss pass: an lm head's logits read by one `cross_entropy` (and any z-loss `logsumexp`) in a
captured graph, run in chunks of tokens (`fxmem.ops.chunked_cross_entropy`), so the logits are never
all alive at once.

Reads a captured (torch-level) GraphModule, as symbolic_trace (`nn.Linear` modules, `F.linear`,
`F.cross_entropy`) or torch.export (`aten.linear`, `aten.cross_entropy_loss`) make it, and the chunk
count the plan chose (`Plan.loss_chunks`). `loss_sites` finds the pattern; `chunk_loss` replaces it by
one `chunked_linear_cross_entropy` node per site (1 chunk: nothing changes).

A site is a `linear` whose every reader is, through any of: upcasts (`.float()`, `.to(dtype)`),
reshapes (`view`, `reshape`, `flatten`, `contiguous`) and slices of the rows (`logits[:, :-1]`,
`aten.slice`; before any reshape, the vocabulary whole), one of: the input of the one cross-entropy,
a `logsumexp` over the vocabulary in the cross-entropy's dtype (a z-loss term: the chunked node
gives it the log-sum-exp of its rows), or the logits' `size`/`shape` (made from the hidden states and
the weight). A model that returns its logits, or reads them any other way, keeps them whole. The
reduction is mean or sum (a sum divided by a token count afterwards, as transformers'
`num_items_in_batch` divides it, is read as it is), there are no class weights and the targets are
class indices. Rows a slice drops are made and ignored. Writes `meta["fxmem"]["loss_chunks"]` on each
new node.
"""
from __future__ import annotations

import builtins
import inspect
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.ops.chunked_cross_entropy import chunk_bounds, chunked_linear_cross_entropy, linear_logits_size
from fxmem.meta_keys import LOSS_CHUNKS, NAMESPACE

aten = torch.ops.aten
REDUCTION_CODES = {1: "mean", 2: "sum"}  # aten's reduction enum (0 is none)
_SHAPE_METHODS = {"view", "reshape", "flatten", "contiguous"}
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten._unsafe_view.default,
              aten.contiguous.default, aten.alias.default}
_LOGSUMEXP = {torch.logsumexp, aten.logsumexp.default}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_CE_ATEN_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")


@dataclass(frozen=True)
class LossSite:
    """One lm head -> cross-entropy in a captured graph; sizes for pricing and the table. `tokens`: the
    cross-entropy's; `rows`: the hidden states' the chunks make logits for (more where a slice drops
    some); `kept`: a (start, stop, step) per leading dimension where a slice drops rows, else None;
    `logsumexps`: the z-loss `logsumexp` reads of the logits the chunked node answers."""

    loss: str
    linear: str
    tokens: int
    hidden_size: int
    vocab: int
    logits_bytes: int
    reduction: str
    ignore_index: int
    label_smoothing: float
    dtype: torch.dtype
    rows: int
    kept: tuple | None
    logsumexps: int

    def lm_head_flops(self) -> int:
        """FLOPs of the lm head's matmul over all rows: what chunking computes once more in backward."""
        return 2 * self.rows * self.hidden_size * self.vocab

    def region_bytes(self) -> int:
        """About what chunking can free at most: the logits, their upcast and their gradient, whole."""
        return 3 * self.tokens * self.vocab * 4

    def chunk_tokens(self, chunks: int) -> int:
        return chunk_bounds(self.rows, chunks)[0][1]


@dataclass
class _Match:
    """A site and the graph nodes it rewrites: `removed` (the linear, every node between it and the
    cross-entropy and logsumexps, their metadata asserts, the shape reads), `logsumexps` (node, the
    slices its input takes of the rows or None, whether its shape is other than those rows'),
    `shape_reads` (size/shape reads of the linear)."""

    site: LossSite
    linear: torch.fx.Node
    parts: tuple
    target: torch.fx.Node
    removed: list
    logsumexps: list
    shape_reads: list


def _val(node: torch.fx.Node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_assert(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (aten._assert_tensor_metadata.default,)


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [user for user in node.users if not _is_assert(user)]


def _cross_entropy_options(node: torch.fx.Node) -> dict | None:
    """input, target, weight, reduction, ignore_index, label_smoothing of a cross-entropy node."""
    if node.op != "call_function":
        return None
    if node.target is F.cross_entropy:
        try:
            bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        args = dict(bound.arguments)
        if args["size_average"] is not None or args["reduce"] is not None:
            return None
        return args
    if node.target is aten.cross_entropy_loss.default:
        args = dict(zip(_CE_ATEN_ARGS, node.args)) | dict(node.kwargs)
        args.setdefault("weight", None)
        args.setdefault("ignore_index", -100)
        args.setdefault("label_smoothing", 0.0)
        args["reduction"] = REDUCTION_CODES.get(args.get("reduction", 1), "none")
        return args
    return None


def _is_upcast(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "float":
        return True
    if node.op == "call_method" and node.target == "to" or node.op == "call_function" and node.target in (
            aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
        val = _val(node)
        source = _val(node.args[0])
        return val is not None and source is not None and val.device == source.device and val.is_floating_point()
    return False


def _is_reshape(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
        node.op == "call_function" and node.target in _SHAPE_OPS)


def _is_shape_read(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "size") or node.op == "call_function" and (
        node.target is aten.sym_size.int or node.target is builtins.getattr and node.args[1:] == ("shape",))


def _row_slices(node: torch.fx.Node) -> list[slice] | None:
    """The slice per dimension a `getitem` of slices or an `aten.slice` takes, or None where `node` is
    no such slice (an index, a tensor, a new axis, a negative step or a bound not a number)."""
    val, source = _val(node), _val(node.args[0]) if node.args else None
    if node.op != "call_function" or val is None or source is None:
        return None
    ndim = source.dim()
    if node.target is operator.getitem and isinstance(node.args[1], (tuple, slice)):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(isinstance(i, slice) or i is Ellipsis for i in index) or index.count(Ellipsis) > 1:
            return None
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1:]
        slices = list(index) + [slice(None)] * (ndim - len(index))
    elif node.target is aten.slice.Tensor:
        dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
        slices = [slice(None)] * ndim
        if not isinstance(dim, int) or not -ndim <= dim < ndim:
            return None
        slices[dim % ndim] = slice(start, end, step)
    else:
        return None
    if len(slices) != ndim or any(not all(b is None or type(b) is int for b in (s.start, s.stop, s.step))
                                  or (s.step or 1) < 1 for s in slices):
        return None
    return slices


def _logsumexp_dim(node: torch.fx.Node) -> tuple[int, bool] | None:
    """(dim, keepdim) of a logsumexp node, or None."""
    if not (node.op == "call_function" and node.target in _LOGSUMEXP
            or node.op == "call_method" and node.target == "logsumexp"):
        return None
    args = list(node.args[1:]) + [None, False][len(node.args) - 1:]
    dim, keepdim = node.kwargs.get("dim", args[0]), node.kwargs.get("keepdim", args[1])
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return (dim, bool(keepdim)) if isinstance(dim, int) and isinstance(keepdim, bool) else None


def _linear_parts(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple | None:
    """(hidden, weight, bias) of a linear node: nodes, or for an `nn.Linear` module its attribute paths."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) is not torch.nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        return node.args[0], f"{node.target}.weight", (f"{node.target}.bias" if module.bias is not None else None)
    if node.op == "call_function" and node.target in (F.linear, aten.linear.default):
        args = list(node.args) + [None] * (3 - len(node.args))
        bias = node.kwargs.get("bias", args[2])
        return args[0], node.kwargs.get("weight", args[1]), bias
    return None


def _lm_head(gm: torch.fx.GraphModule, logits: torch.fx.Node) -> torch.fx.Node | None:
    """The linear node the cross-entropy's input is made from by upcasts, reshapes and slices, or None."""
    node = logits
    while isinstance(node, torch.fx.Node) and (_is_reshape(node) or _is_upcast(node) or _row_slices(node)):
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and _linear_parts(gm, node) is not None else None


def _walk(linear: torch.fx.Node, ce: torch.fx.Node, logits: torch.fx.Node):
    """Every reader of the linear's logits, followed through upcasts, reshapes and slices: (the cross-entropy's
    input rows as ranges, the logsumexps, the shape reads, the nodes walked), or None where a reader
    is none of those or another cross-entropy reads them."""
    out, vocab = _val(linear), _val(logits).shape[-1]
    start = tuple(range(n) for n in out.shape[:-1])
    stack, walked, logsumexps, shape_reads, ce_rows = [(linear, start, False)], [], [], [], None
    while stack:
        node, rows, reshaped = stack.pop()
        walked.append(node)
        for reader in _readers(node):
            val = _val(reader)
            if reader is ce:
                if logits is not node or ce_rows is not None:
                    return None
                ce_rows = rows
            elif node is linear and _is_shape_read(reader):
                shape_reads.append(reader)
            elif _logsumexp_dim(reader) is not None:
                dim, keepdim = _logsumexp_dim(reader)
                if dim % _val(node).dim() != _val(node).dim() - 1 or _val(node).dtype != _val(logits).dtype:
                    return None
                sliced = None if rows == start else tuple(slice(r.start, r.stop, r.step) for r in rows)
                logsumexps.append((reader, sliced, reshaped or keepdim))
            elif reader.args[:1] != (node,) or not isinstance(val, torch.Tensor) or val.shape[-1:] != (vocab,):
                return None
            elif _is_upcast(reader) or _is_reshape(reader):
                stack.append((reader, rows, reshaped or val.shape[:-1] != _val(node).shape[:-1]))
            elif (slices := _row_slices(reader)) is not None and not reshaped \
                    and range(vocab)[slices[-1]] == range(vocab):
                stack.append((reader, tuple(r[s] for r, s in zip(rows, slices)), False))
            else:
                return None
    return (ce_rows, logsumexps, shape_reads, walked) if ce_rows is not None else None


def _match(gm: torch.fx.GraphModule, ce: torch.fx.Node) -> _Match | None:
    """The site a cross-entropy node fed by an lm head makes, with the nodes it rewrites, or None."""
    options = _cross_entropy_options(ce)
    if options is None or options["weight"] is not None or options["reduction"] not in ("mean", "sum"):
        return None
    logits, target = options["input"], options["target"]
    logits_val, target_val = _val(logits), _val(target)
    if logits_val is None or target_val is None or logits_val.dim() != 2 or target_val.is_floating_point():
        return None
    linear = _lm_head(gm, logits)
    out = _val(linear) if linear is not None else None
    parts = _linear_parts(gm, linear) if linear is not None else (None,) * 3
    hidden = parts[0]
    if out is None or not isinstance(hidden, torch.fx.Node) or _val(hidden) is None:
        return None
    tokens, vocab = logits_val.shape
    walked = _walk(linear, ce, logits)
    if walked is None:
        return None
    ce_rows, logsumexps, shape_reads, tree = walked
    rows = out.numel() // vocab
    if out.shape[-1] != vocab or math.prod(map(len, ce_rows)) != tokens or target_val.numel() != tokens \
            or _val(hidden).numel() != rows * _val(hidden).shape[-1] or _hoisted(ce.graph, [ce, *(n for n, *_ in
                                                                                          logsumexps)], target) is None:
        return None
    kept = None if all(r == range(n) for r, n in zip(ce_rows, out.shape)) else tuple(
        (r.start, r.stop, r.step) for r in ce_rows)
    removed = [ce, *tree, *(n for n, *_ in logsumexps), *shape_reads]
    removed += [user for n in tree for user in n.users if _is_assert(user)]
    site = LossSite(ce.name, linear.name, tokens, _val(hidden).shape[-1], vocab, out.numel() * out.element_size(),
                    options["reduction"], int(options["ignore_index"]), float(options["label_smoothing"]),
                    logits_val.dtype, rows, kept, len(logsumexps))
    return _Match(site, linear, parts, target, removed, logsumexps, shape_reads)


def _hoisted(graph: torch.fx.Graph, leaves: list[torch.fx.Node], target: torch.fx.Node) -> list | None:
    """The nodes the target is made by that come after the first of `leaves` (where the chunked node goes),
    in graph order, to be moved before it; None where one cannot move (an input or an impure op)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(order[leaf] for leaf in leaves)
    found, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in found or order[node] < first:
            continue
        if node.op in ("placeholder", "output") or node.is_impure():
            return None
        found.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(found, key=order.__getitem__)


def loss_sites(gm: torch.fx.GraphModule) -> list[LossSite]:
    """The lm head -> cross-entropy patterns in `gm` that `chunk_loss` can chunk."""
    found = (_match(gm, node) for node in gm.graph.nodes)
    return [match.site for match in found if match is not None]


def chunk_loss(gm: torch.fx.GraphModule, chunks: int) -> torch.fx.GraphModule:
    """`gm` with each loss site computed in `chunks` chunks of tokens (in place; 1: unchanged)."""
    if chunks <= 1:
        return gm
    graph = gm.graph
    for match in [match for match in (_match(gm, node) for node in graph.nodes) if match is not None]:
        _rewrite(graph, match, chunks)
    graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph: torch.fx.Graph, match: _Match, chunks: int) -> None:
    site, ce, (hidden, weight, bias) = match.site, match.removed[0], match.parts
    leaves = [ce, *(n for n, *_ in match.logsumexps)]
    order = _position(graph)
    first = min(leaves, key=order)
    for node in _hoisted(graph, leaves, match.target):
        first.prepend(node)
    if isinstance(weight, str):
        with graph.inserting_before(match.linear):
            weight = graph.get_attr(weight)
            bias = graph.get_attr(bias) if bias is not None else None
    removed = set(match.removed)
    for read in (read for read in match.shape_reads if set(read.users) - removed):  # read by a node kept
        with graph.inserting_before(read):
            dim = () if read.target is builtins.getattr else read.args[1:]
            size = graph.call_function(linear_logits_size, (hidden, weight, *dim), dict(read.kwargs))
        read.replace_all_uses_with(size, delete_user_cb=lambda user: user not in removed)
    with graph.inserting_before(first):
        chunked = graph.call_function(chunked_linear_cross_entropy, (hidden, weight, bias, match.target, chunks),
                                      {"reduction": site.reduction, "ignore_index": site.ignore_index,
                                       "label_smoothing": site.label_smoothing, "dtype": site.dtype,
                                       "rows": site.kept, "logsumexp": bool(match.logsumexps)})
        loss = graph.call_function(operator.getitem, (chunked, 0)) if match.logsumexps else chunked
        lse = graph.call_function(operator.getitem, (chunked, 1)) if match.logsumexps else None
        for node, rows, reshaped in match.logsumexps:
            node.replace_all_uses_with(_logsumexp_of(graph, lse, rows, reshaped, node))
    chunked.meta.setdefault("nn_module_stack", match.linear.meta.get("nn_module_stack", {}))
    loss.meta.update({k: v for k, v in ce.meta.items() if k != NAMESPACE})
    chunked.meta[NAMESPACE] = {LOSS_CHUNKS: len(chunk_bounds(site.rows, chunks))}
    ce.replace_all_uses_with(loss)
    for node in sorted(removed, key=_position(graph), reverse=True):  # readers before producers
        graph.erase_node(node)


def _logsumexp_of(graph: torch.fx.Graph, lse: torch.fx.Node, sliced: tuple | None, reshaped: bool,
                  node: torch.fx.Node) -> torch.fx.Node:
    """Nodes giving what the logsumexp `node` gave, from the chunked node's log-sum-exp of every row
    (`lse`, shaped as the hidden states' leading dimensions): its rows, in its shape."""
    if sliced is not None:
        lse = graph.call_function(operator.getitem, (lse, sliced))
    if reshaped:
        shape = tuple(_val(node).shape)
        lse = graph.call_function(torch.reshape, (lse, (-1,) if len(shape) == 1 else shape))
    lse.meta.update({k: v for k, v in node.meta.items() if k != NAMESPACE})
    return lse


def _position(graph: torch.fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return lambda node: order[node]
