"""Cross-entropy of a linear layer's logits, computed in chunks of tokens so that all the logits are
never alive at once (the approach of torchtitan's chunked cross-entropy and Liger's fused linear
cross-entropy).

Forward makes each chunk's logits, reduces them to a log-sum-exp and the chunk's loss, and frees
them; it saves the hidden states (which eager saves too), the log-sum-exp per token and the targets.
Backward makes each chunk's logits again (the lm head's matmul once more), turns them into their
gradient and frees them. The sums are the same as `torch.nn.functional.cross_entropy`'s (mean over
the tokens that are not `ignore_index` across all chunks, label smoothing as torch defines it), in
another order: results equal eager's to float reassociation.

Where the targets belong to some of the hidden states' rows only (`rows`: a slice of the logits before
they are flattened, as the shifted causal-LM loss `logits[:, :-1]` takes), the other rows are
computed as ignored tokens: their logits are made (1/seq more of the lm head for a shift) and add
nothing to the loss, the count or the gradients. With `logsumexp`, the log-sum-exp of every row's
logits is returned too, with its gradient (the softmax, which backward makes anyway), as a z-loss
(`logsumexp(logits, -1).pow(2)`) reads it: the same values as `torch.logsumexp` of eager's logits, so
that term needs no logits either. Reads and writes nothing else.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk: `ceil(tokens / chunks)` tokens each, the last one ragged."""
    size = max(1, -(-tokens // max(1, chunks)))
    return [(start, min(start + size, tokens)) for start in range(0, tokens, size)]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunks, reduction, ignore_index, smoothing, dtype, with_lse):
        vocab = weight.shape[0]
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
        lse_parts, loss = [], None
        for start, stop in chunk_bounds(hidden.shape[0], chunks):
            logits = F.linear(hidden[start:stop], weight, bias)
            ctx.logits_dtype = logits.dtype
            logits = logits.to(dtype)
            lse = torch.logsumexp(logits, dim=1)
            per_token = lse - (1.0 - smoothing) * torch.gather(logits, 1, safe[start:stop]).squeeze(1)
            if smoothing:
                per_token = per_token - (smoothing / vocab) * logits.sum(dim=1)
            part = torch.where(valid[start:stop], per_token, torch.zeros_like(per_token)).sum()
            loss = part if loss is None else loss + part
            lse_parts.append(lse)
        count = valid.sum()
        if reduction == "mean":
            loss = loss / count
        lse = torch.cat(lse_parts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, count)
        ctx.options = (chunks, reduction, ignore_index, smoothing, dtype)
        ctx.set_materialize_grads(False)
        return (loss, lse) if with_lse else loss

    @staticmethod
    def backward(ctx, grad_loss, grad_lse=None):
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        chunks, reduction, ignore_index, smoothing, dtype = ctx.options
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        vocab, mm_dtype = weight.shape[0], ctx.logits_dtype
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # sums over chunks: at least fp32
        if grad_loss is None:  # only the log-sum-exp is read
            grad_loss = torch.zeros((), dtype=dtype, device=hidden.device)
        scale = grad_loss / count if reduction == "mean" else grad_loss
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
        row_scale = torch.where(valid, scale.to(dtype), torch.zeros((), dtype=dtype, device=hidden.device))
        w = weight.to(mm_dtype)
        b = None if bias is None else bias.to(mm_dtype)
        grad_hidden, grad_weight, grad_bias = [], None, None
        for start, stop in chunk_bounds(hidden.shape[0], chunks):
            h = hidden[start:stop].to(mm_dtype)
            logits = F.linear(h, w, b).to(dtype)
            grad = torch.exp(logits - lse[start:stop].unsqueeze(1))
            probs = grad if grad_lse is not None else None  # the softmax, held only where the z-loss needs it
            if smoothing:
                grad = grad - smoothing / vocab
            picked = torch.full((stop - start, 1), smoothing - 1.0, dtype=dtype, device=hidden.device)
            grad = torch.scatter_add(grad, 1, safe[start:stop], picked)
            grad = grad * row_scale[start:stop].unsqueeze(1)
            if grad_lse is not None:  # d logsumexp / d logits is the softmax
                grad = grad + probs * grad_lse[start:stop].to(dtype).unsqueeze(1)
            grad = grad.to(mm_dtype)
            if want_hidden:
                grad_hidden.append((grad @ w).to(hidden.dtype))
            # The weight gradient: one weight-sized sum alive besides the one made (addmm where the dtypes
            # allow). 16-bit operands on the CPU are upcast and multiplied into the fp32 sum in place: exact
            # products summed in fp32, as eager's one matmul over every token sums them. On a GPU the 16-bit
            # matmul keeps its speed (tensor cores): its product is rounded to 16 bits chunk by chunk, then
            # added into the fp32 sum in place.
            if want_weight:
                if acc_dtype == mm_dtype:
                    grad_weight = grad.t() @ h if grad_weight is None else torch.addmm(grad_weight, grad.t(), h)
                elif hidden.device.type == "cpu":
                    gt, hh = grad.t().to(acc_dtype), h.to(acc_dtype)
                    grad_weight = gt @ hh if grad_weight is None else grad_weight.addmm_(gt, hh)
                else:
                    part = grad.t() @ h
                    grad_weight = part.to(acc_dtype) if grad_weight is None else grad_weight.add_(part)
            if want_bias:
                part = grad.sum(dim=0, dtype=acc_dtype)  # summed in fp32, not rounded to 16 bits per chunk
                grad_bias = part if grad_bias is None else grad_bias + part
        return (torch.cat(grad_hidden) if want_hidden else None,
                grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if want_bias else None,
                None, None, None, None, None, None, None)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 target: torch.Tensor, chunks: int, reduction: str = "mean",
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 dtype: torch.dtype = torch.float32, rows: tuple | None = None,
                                 logsumexp: bool = False):
    """`F.cross_entropy(F.linear(hidden, weight, bias).to(dtype)[rows].flatten(0, -2), target.flatten(),
    reduction=..., ignore_index=..., label_smoothing=...)` made `chunks` tokens-chunks at a time.
    `rows`: None (every row), or a (start, stop, step) per leading dimension of `hidden` (step > 0): the
    rows the targets belong to, in order. With `logsumexp`, returns (loss, the log-sum-exp of every
    row's logits, shaped `hidden.shape[:-1]`)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked cross-entropy reduces by 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1)
    if rows is not None:
        flat_target = _on_rows(flat_target, hidden.shape[:-1], rows, int(ignore_index))
    if flat_target.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"{flat_hidden.shape[0]} tokens of hidden states but {flat_target.shape[0]} targets")
    out = _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_target, chunks, reduction,
                                           int(ignore_index), float(label_smoothing), dtype, bool(logsumexp))
    if logsumexp:
        loss, lse = out
        return loss, lse.view(hidden.shape[:-1])
    return out


def _on_rows(target: torch.Tensor, lead: torch.Size, rows: tuple, ignore_index: int) -> torch.Tensor:
    """`target` (one per row `rows` selects of a `lead`-shaped grid) placed on every row of the grid, the
    rows not selected `ignore_index`."""
    if len(rows) != len(lead) or any(step < 1 for _, _, step in rows):
        raise ValueError(f"rows must be a (start, stop, step > 0) per leading dimension {tuple(lead)}, got {rows!r}")
    index = torch.arange(lead.numel(), device=target.device).view(lead)[tuple(slice(*r) for r in rows)].reshape(-1)
    if index.shape[0] != target.shape[0]:
        raise ValueError(f"{index.shape[0]} rows selected but {target.shape[0]} targets")
    return target.new_full((lead.numel(),), ignore_index).index_put((index,), target)


def linear_logits_size(hidden: torch.Tensor, weight: torch.Tensor, dim: int | None = None):
    """`F.linear(hidden, weight).size(dim)` without making the logits (a graph reading the size of the
    logits it computes in chunks reads it here)."""
    size = torch.Size((*hidden.shape[:-1], weight.shape[0]))
    return size if dim is None else size[dim]
