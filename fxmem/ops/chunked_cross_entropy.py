"""Cross-entropy of a linear layer's logits, computed in chunks of tokens so that all the logits are
never alive at once (the approach of torchtitan's chunked cross-entropy and Liger's fused linear
cross-entropy).

Forward makes each chunk's logits, reduces them to a log-sum-exp and the chunk's loss, and frees
them; it saves the hidden states (which eager saves too), the log-sum-exp per token and the targets.
Backward makes each chunk's logits again (the lm head's matmul once more), turns them into their
gradient and frees them. The sums are the same as `torch.nn.functional.cross_entropy`'s (mean over
the tokens that are not `ignore_index` across all chunks, label smoothing as torch defines it), in
another order: results equal eager's to float reassociation. Reads and writes nothing else.
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
    def forward(ctx, hidden, weight, bias, target, chunks, reduction, ignore_index, smoothing, dtype):
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
        ctx.save_for_backward(hidden, weight, bias, target, torch.cat(lse_parts), count)
        ctx.options = (chunks, reduction, ignore_index, smoothing, dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        chunks, reduction, ignore_index, smoothing, dtype = ctx.options
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        vocab, mm_dtype = weight.shape[0], ctx.logits_dtype
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # sums over chunks: at least fp32
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
            if smoothing:
                grad = grad - smoothing / vocab
            picked = torch.full((stop - start, 1), smoothing - 1.0, dtype=dtype, device=hidden.device)
            grad = torch.scatter_add(grad, 1, safe[start:stop], picked)
            grad = (grad * row_scale[start:stop].unsqueeze(1)).to(mm_dtype)
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
                None, None, None, None, None, None)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 target: torch.Tensor, chunks: int, reduction: str = "mean",
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).to(dtype).flatten(0, -2), target.flatten(),
    reduction=..., ignore_index=..., label_smoothing=...)` made `chunks` tokens-chunks at a time."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked cross-entropy reduces by 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1)
    if flat_target.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"{flat_hidden.shape[0]} tokens of hidden states but {flat_target.shape[0]} targets")
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_target, chunks, reduction,
                                            int(ignore_index), float(label_smoothing), dtype)
