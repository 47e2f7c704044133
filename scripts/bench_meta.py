#!/usr/bin/env python
"""Plan the Llama-3-8B shape (transformers `LlamaConfig`, bf16) built on the meta device, for an H100:
wall time, this process's peak host memory (RSS), the least budget fxmem finds, and, for comparison,
eager's and full activation checkpointing's peaks (MemTracker on fake tensors, as `fxmem.trace.eager_meter`
measures eager; per decoder layer, `gradient_checkpointing_enable`), and the loss region's peak (the lm
head on the last hidden states -> fp32 upcast -> cross-entropy, forward and backward, MemTracker on fake
tensors) whole and in the chunk count the least was found with (`fxmem.ops.chunked_cross_entropy`).
Nothing runs: no weights exist.

examples:
  python scripts/bench_meta.py --seq 2048                  # 32 layers, batch 1, target h100
  python scripts/bench_meta.py --seq 8192 --time-limit 60
  python scripts/bench_meta.py --layers 2 --seq 512        # a quick look
  python scripts/bench_meta.py --hidden 8192 --intermediate 28672 --layers 80 --heads 64 --least-only  # 70B
"""
from __future__ import annotations

import argparse
import resource
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

GIB, MIB = 2**30, 2**20


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next token, the last one ignored: transformers shifts the labels, not the logits."""
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def cross_entropy(out, labels):
    """The causal LM loss as transformers computes it: logits upcast to float32, labels shifted."""
    return F.cross_entropy(out.logits.flatten(0, 1).float(), next_tokens(labels).flatten())


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(8192, args.seq), rope_theta=500000.0, use_cache=False,
        attn_implementation=getattr(args, "attention", "sdpa"))
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The Llama shape `build` reads (defaults: Llama-3-8B)."""
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, Llama-3-8B)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)


def full_ac_peak(model: torch.nn.Module, ids: torch.Tensor, target: str) -> int | None:
    """Full activation checkpointing's peak (every decoder layer recomputed in backward), MemTracker on fakes."""
    from fxmem.price.cost import DeviceSpec
    from fxmem.trace.eager_meter import eager_peak_bytes
    from fxmem.trace.meta_device import planned_on
    from fxmem.trace.step_module import LossStep

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        step = LossStep(model, cross_entropy)
        with planned_on(model, DeviceSpec.from_name(target)):
            return eager_peak_bytes(step, (ids,), {"target": ids})
    finally:
        model.gradient_checkpointing_disable()


class LossRegion(torch.nn.Module):
    """The step's loss region alone: `model`'s lm head on hidden states (a parameter here, so that its
    gradient is made) -> upcast -> cross-entropy as `cross_entropy` computes it, whole (`chunks` 1) or
    in `chunks` chunks of tokens as fxmem's rewrite computes it."""

    def __init__(self, model: torch.nn.Module, batch: int, seq: int, chunks: int):
        super().__init__()
        self.lm_head, self.chunks = model.lm_head, chunks
        weight = model.lm_head.weight
        self.hidden = torch.nn.Parameter(torch.empty(batch, seq, weight.shape[1], dtype=weight.dtype,
                                                     device=weight.device))

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        from fxmem.ops.chunked_cross_entropy import chunked_linear_cross_entropy

        if self.chunks == 1:
            return cross_entropy(SimpleNamespace(logits=self.lm_head(self.hidden)), labels)
        return chunked_linear_cross_entropy(self.hidden, self.lm_head.weight, self.lm_head.bias,
                                            next_tokens(labels), self.chunks)


def loss_region_bytes(model: torch.nn.Module, ids: torch.Tensor, target: str, chunks: int) -> int | None:
    """The loss region's peak above its inputs (the lm head's weight and the hidden states), their
    gradients included, MemTracker on fakes."""
    from fxmem.price.cost import DeviceSpec
    from fxmem.trace.eager_meter import eager_peak_bytes
    from fxmem.trace.meta_device import planned_on

    region = LossRegion(model, *ids.shape, chunks)
    inputs = sum(p.numel() * p.element_size() for p in region.parameters())
    with planned_on(region, DeviceSpec.from_name(target)):
        peak = eager_peak_bytes(region, (ids,), {})
    return None if peak is None else peak - inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    add_shape_arguments(p)
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help="attention (default sdpa)")
    p.add_argument("--target", default="h100", help="device preset to plan for (default h100)")
    p.add_argument("--time-limit", type=float, default=30.0, help="planner time limit, seconds (default 30)")
    p.add_argument("--least-only", action="store_true", help="only the least budget: no eager plan, no "
                   "full-checkpointing meter")
    args = p.parse_args()

    import fxmem

    started, rss_at_start = time.perf_counter(), peak_rss_bytes()
    model = build(args)
    params = sum(t.numel() for t in model.parameters())
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    try:
        fxmem.plan(model, (ids,), budget_gb=1e-6, target=args.target, loss_fn=cross_entropy, example_target=ids,
                   time_limit_s=args.time_limit, eager_meter=True)
        raise SystemExit("a budget of 1 KiB fit: nothing to compare")
    except fxmem.InfeasibleBudgetError as exc:
        least = exc
    planned_s = time.perf_counter() - started
    eager = full_ac = None
    if not args.least_only:
        eager = fxmem.plan(model, (ids,), target=args.target, loss_fn=cross_entropy, example_target=ids,
                           time_limit_s=args.time_limit, eager_meter=True)
        full_ac = full_ac_peak(model, ids, args.target)
    print(f"Llama shape: {args.layers} layers, hidden {args.hidden}, {params / 1e9:.2f} B parameters (bf16), "
          f"batch {args.batch}, seq {args.seq}, {args.attention} attention, target {args.target}, on meta")
    print(f"least budget found:        {least.min_budget_bytes / GIB:8.2f} GiB"
          f" ({'proven' if least.proven else f'proven >= {least.lower_bound_bytes / GIB:.2f} GiB'};"
          f" time limit {args.time_limit:g} s; the loss in {getattr(least, 'loss_chunks', 1)} chunk(s) of tokens)")
    if eager is not None:
        print(f"fxmem eager step (no recompute): {eager.baseline_peak_bytes / GIB:8.2f} GiB")
    if eager is not None and eager.eager_peak_bytes:
        print(f"PyTorch eager, MemTracker:  {eager.eager_peak_bytes / GIB:8.2f} GiB")
    chunks = getattr(least, "loss_chunks", 1)
    for label, count in (("whole", 1), (f"in {chunks} chunks", chunks)) if chunks > 1 else (("whole", 1),):
        region = loss_region_bytes(model, ids, args.target, count)
        if region is not None:
            print(f"loss region's peak, {label}: {region / GIB:8.2f} GiB (above the lm head's weight and the "
                  "hidden states; their gradients included)")
    if full_ac is not None:
        print(f"full activation checkpointing, MemTracker: {full_ac / GIB:8.2f} GiB "
              "(tensors only: no allocator rounding, no BLAS workspaces)")
    print(f"planning the least (capture, trace, solve): {planned_s:.0f} s wall; whole script "
          f"{time.perf_counter() - started:.0f} s")
    print(f"peak host memory (RSS): {peak_rss_bytes() / GIB:.2f} GiB (after imports {rss_at_start / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()
