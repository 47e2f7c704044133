"""Naive attention (`softmax(scale(q @ kt) [masked]) @ v`) computed in chunks of query rows, so that the
batch x heads x queries x keys scores are never all alive at once.

Forward makes each chunk's scores, applies the scale and masks, takes the softmax, multiplies by v and
frees them; it saves only q, kt, v and the masks (which eager saves too: no per-row statistics are
needed: backward takes the softmax of the recomputed scores again, so its probabilities are forward's
bit for bit, and differentiates it with eager's softmax backward). Backward makes each chunk's scores again (the q @ kt matmul once more), turns them into
their gradients and frees them. Every row is computed with eager's own ops (`matmul`, `masked_fill`,
`where`, `add`, `softmax`); the gradients of kt, v and an additive mask are sums over chunks, in
another order than eager's single matmul: equal to eager's to float reassociation. Reads and writes
nothing else.

The score ops are a tuple applied in order to the scores, each one of:
  ("mul", c) / ("div", c)        scores * c, scores / c (c a Python number)
  ("fill", i, value)             scores.masked_fill(masks[i], value)
  ("where", i, value, keep_if)   torch.where(masks[i], scores, value) if keep_if else where(masks[i], value, scores)
  ("add", i)                     scores + masks[i] (an additive mask, broadcast to the scores; may need grad)
Masks broadcast to the scores' shape; those with one row per query are cut into the same chunks.
"""
from __future__ import annotations

import torch

from fxmem.ops.chunked_cross_entropy import chunk_bounds

OPS = ("mul", "div", "fill", "where", "add")


def _rows(mask: torch.Tensor, queries: int, start: int, stop: int) -> torch.Tensor:
    """The rows of `mask` for queries start:stop (all of it where it broadcasts over the queries)."""
    if mask.dim() >= 2 and mask.shape[-2] == queries and queries > 1:
        return mask[..., start:stop, :]
    return mask


def _scores(q: torch.Tensor, kt: torch.Tensor, masks: tuple, ops: tuple, start: int, stop: int) -> torch.Tensor:
    """The chunk's scores before the softmax, as eager's ops make them."""
    queries = q.shape[-2]
    scores = torch.matmul(q[..., start:stop, :], kt)
    for op in ops:
        if op[0] == "mul":
            scores = scores * op[1]
        elif op[0] == "div":
            scores = scores / op[1]
        elif op[0] == "fill":
            scores = scores.masked_fill(_rows(masks[op[1]], queries, start, stop), op[2])
        elif op[0] == "where":
            mask = _rows(masks[op[1]], queries, start, stop)
            scores = torch.where(mask, scores, op[2]) if op[3] else torch.where(mask, op[2], scores)
        else:
            scores = scores + _rows(masks[op[1]], queries, start, stop)
    return scores


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kt, v, chunks, ops, *masks):
        parts = []
        for start, stop in chunk_bounds(q.shape[-2], chunks):
            probs = torch.softmax(_scores(q, kt, masks, ops, start, stop), dim=-1)
            parts.append(torch.matmul(probs, v))
        ctx.save_for_backward(q, kt, v, *masks)
        ctx.options = (chunks, ops)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        q, kt, v, *masks = ctx.saved_tensors
        chunks, ops = ctx.options
        want_q, want_kt, want_v = ctx.needs_input_grad[:3]
        want_mask = ctx.needs_input_grad[5:]
        queries = q.shape[-2]
        grad_q, grad_kt, grad_v = [], None, None
        grad_masks: list = [[] for _ in masks]
        for start, stop in chunk_bounds(queries, chunks):
            scores = _scores(q, kt, masks, ops, start, stop)
            probs = torch.softmax(scores, dim=-1)
            grad_c = grad_out[..., start:stop, :]
            if want_v:
                part = torch.matmul(probs.transpose(-2, -1), grad_c)
                grad_v = part if grad_v is None else grad_v + part
            grad = torch.ops.aten._softmax_backward_data(torch.matmul(grad_c, v.transpose(-2, -1)), probs, -1,
                                                         scores.dtype)  # eager's softmax backward
            del probs, scores
            for op in reversed(ops):
                if op[0] in ("mul", "div"):
                    grad = grad * op[1] if op[0] == "mul" else grad / op[1]
                elif op[0] == "fill":
                    grad = grad.masked_fill(_rows(masks[op[1]], queries, start, stop), 0.0)
                elif op[0] == "where":
                    mask = _rows(masks[op[1]], queries, start, stop)
                    grad = torch.where(mask, grad, 0.0) if op[3] else torch.where(mask, 0.0, grad)
                elif want_mask[op[1]]:
                    grad_masks[op[1]].append(grad.sum_to_size(_rows(masks[op[1]], queries, start, stop).shape))
            if want_q:
                grad_q.append(torch.matmul(grad, kt.transpose(-2, -1)))
            if want_kt:
                part = torch.matmul(q[..., start:stop, :].transpose(-2, -1), grad)
                grad_kt = part if grad_kt is None else grad_kt + part
        return (torch.cat(grad_q, dim=-2).sum_to_size(q.shape) if want_q else None,
                grad_kt.sum_to_size(kt.shape) if want_kt else None,
                grad_v.sum_to_size(v.shape) if want_v else None, None, None,
                *(_mask_grad(parts, mask, queries) if parts else None for parts, mask in zip(grad_masks, masks)))


def _mask_grad(parts: list[torch.Tensor], mask: torch.Tensor, queries: int) -> torch.Tensor:
    """An additive mask's gradient from its chunks' parts: joined where it was cut into rows, else summed."""
    if mask.dim() >= 2 and mask.shape[-2] == queries and queries > 1:
        return torch.cat(parts, dim=-2)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def chunked_attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, chunks: int, ops: tuple = (),
                      *masks: torch.Tensor) -> torch.Tensor:
    """`softmax(ops(q @ kt), dim=-1) @ v`, made `chunks` chunks of query rows at a time (see the module
    docstring for `ops` and `masks`)."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    for op in ops:
        if op[0] not in OPS or op[0] in ("fill", "where", "add") and not 0 <= op[1] < len(masks):
            raise ValueError(f"unknown score op {op!r}: ops are {OPS}, masks indexed by position")
    return _ChunkedAttention.apply(q, kt, v, chunks, tuple(ops), *masks)
