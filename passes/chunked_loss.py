"""Chunked loss pass: `linear (lm head) -> [upcast] -> [flatten] -> cross_entropy` in a captured graph,
run in chunks of tokens (`fxmem.ops.chunked_cross_entropy`), so the logits are never all alive at once.

Reads a captured (torch-level) GraphModule, as symbolic_trace (`nn.Linear` modules, `F.linear`,
`F.cross_entropy`) or torch.export (`aten.linear`, `aten.cross_entropy_loss`) make it, and the chunk
count the plan chose (`Plan.loss_chunks`). `loss_sites` finds the pattern; `chunk_loss` replaces it by
one `chunked_linear_cross_entropy` node per site (1 chunk: nothing changes). Sites are matched where
the logits have no other reader (a model that returns its logits keeps them whole), the reduction is
mean or sum, there are no class weights and the targets are class indices. Writes
`meta["fxmem"]["loss_chunks"]` on each new node.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.ops.chunked_cross_entropy import chunk_bounds, chunked_linear_cross_entropy
from fxmem.meta_keys import LOSS_CHUNKS, NAMESPACE

aten = torch.ops.aten
REDUCTION_CODES = {1: "mean", 2: "sum"}  # aten's reduction enum (0 is none)
_SHAPE_METHODS = {"view", "reshape", "flatten", "contiguous"}
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten._unsafe_view.default,
              aten.contiguous.default, aten.alias.default}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_CE_ATEN_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")


@dataclass(frozen=True)
class LossSite:
    """One lm head -> cross-entropy in a captured graph. `removed`: the nodes the chunked node replaces
    (linear, upcast, reshapes, their metadata asserts, cross-entropy); sizes for pricing and the table."""

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

    def lm_head_flops(self) -> int:
        """FLOPs of the lm head's matmul over all tokens: what chunking computes once more in backward."""
        return 2 * self.tokens * self.hidden_size * self.vocab

    def region_bytes(self) -> int:
        """About what chunking can free at most: the logits, their upcast and their gradient, whole."""
        return 3 * self.tokens * self.vocab * 4

    def chunk_tokens(self, chunks: int) -> int:
        return chunk_bounds(self.tokens, chunks)[0][1]


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


def _match(gm: torch.fx.GraphModule, ce: torch.fx.Node):
    """(LossSite, linear node, (hidden, weight, bias), target node, nodes replaced) for a cross-entropy
    node fed by an lm head, or None."""
    options = _cross_entropy_options(ce)
    if options is None or options["weight"] is not None or options["reduction"] not in ("mean", "sum"):
        return None
    logits, target = options["input"], options["target"]
    logits_val, target_val = _val(logits), _val(target)
    if logits_val is None or target_val is None or logits_val.dim() != 2 or target_val.is_floating_point():
        return None
    chain, node = [], logits
    while isinstance(node, torch.fx.Node) and (_is_reshape(node) or _is_upcast(node)):
        if len(_readers(node)) != 1 or _val(node) is None or _val(node).shape[-1] != logits_val.shape[-1]:
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or len(_readers(node)) != 1:
        return None
    parts = _linear_parts(gm, node)
    out = _val(node)
    if parts is None or out is None or not isinstance(parts[0], torch.fx.Node) or _val(parts[0]) is None:
        return None
    hidden = _val(parts[0])
    tokens, vocab = logits_val.shape
    if out.shape[-1] != vocab or out.numel() != tokens * vocab or hidden.numel() != tokens * hidden.shape[-1] \
            or target_val.numel() != tokens:
        return None
    removed = [ce, *chain, node]
    removed += [user for n in (node, *chain) for user in n.users if _is_assert(user)]
    site = LossSite(ce.name, node.name, tokens, hidden.shape[-1], vocab, out.numel() * out.element_size(),
                    options["reduction"], int(options["ignore_index"]), float(options["label_smoothing"]),
                    logits_val.dtype)
    return site, node, parts, target, removed


def loss_sites(gm: torch.fx.GraphModule) -> list[LossSite]:
    """The lm head -> cross-entropy patterns in `gm` that `chunk_loss` can chunk."""
    found = (_match(gm, node) for node in gm.graph.nodes)
    return [match[0] for match in found if match is not None]


def chunk_loss(gm: torch.fx.GraphModule, chunks: int) -> torch.fx.GraphModule:
    """`gm` with each loss site computed in `chunks` chunks of tokens (in place; 1: unchanged)."""
    if chunks <= 1:
        return gm
    graph = gm.graph
    for ce in list(graph.nodes):
        match = _match(gm, ce)
        if match is None:
            continue
        site, linear, (hidden, weight, bias), target, removed = match
        with graph.inserting_before(ce):
            if isinstance(weight, str):
                weight = graph.get_attr(weight)
                bias = graph.get_attr(bias) if bias is not None else None
            chunked = graph.call_function(chunked_linear_cross_entropy, (hidden, weight, bias, target, chunks),
                                          {"reduction": site.reduction, "ignore_index": site.ignore_index,
                                           "label_smoothing": site.label_smoothing, "dtype": site.dtype})
        chunked.meta.update({k: v for k, v in ce.meta.items() if k != NAMESPACE})
        chunked.meta.setdefault("nn_module_stack", linear.meta.get("nn_module_stack", {}))
        chunked.meta[NAMESPACE] = {LOSS_CHUNKS: len(chunk_bounds(site.tokens, chunks))}
        ce.replace_all_uses_with(chunked)
        for node in sorted(removed, key=_position(graph), reverse=True):  # readers before producers
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _position(graph: torch.fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return lambda node: order[node]
