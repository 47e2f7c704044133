#!/usr/bin/env python
"""One FSDP2 rank of the Llama-3-8B shape (transformers `LlamaConfig`, bf16 weights, built on the meta
device), simulated on fake tensors under torch's fake process group: the rank's peak with eager blocks,
with torch's checkpoint on every block (torchtitan's full activation checkpointing), and the least
`fxmem.fsdp.plan_fsdp` finds with fxmem's block and root plans; AdamW state per shard; wall and CPU time and
peak host memory (RSS). Nothing runs: no weights exist.

examples:
  python scripts/bench_fsdp_meta.py --seq 8192 --world-size 8     # 32 layers, batch 1, target h100
  python scripts/bench_fsdp_meta.py --seq 8192 --world-size 8 --least-only --rounds 1   # the least alone
  python scripts/bench_fsdp_meta.py --layers 2 --seq 512           # a quick look
"""
from __future__ import annotations

import argparse
import time

import torch

from bench_meta import add_shape_arguments, build, peak_rss_bytes

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="batch size per rank (default 1)")
    p.add_argument("--world-size", type=int, default=8, help="FSDP2 ranks (default 8)")
    add_shape_arguments(p)
    p.add_argument("--target", default="h100", help="device preset the block plans are priced for (default h100)")
    p.add_argument("--time-limit", type=float, default=10.0, help="block and root planners' solver effort, seconds (default 10, as plan_fsdp)")
    p.add_argument("--rounds", type=int, default=5, help="block budgets tried for the least (default 5)")
    p.add_argument("--least-only", action="store_true", help="only the least: no eager or full-checkpointing rank")
    args = p.parse_args()

    from fxmem import InfeasibleBudgetError
    from fxmem.fsdp import full_checkpoint_peak, plan_fsdp

    started = time.perf_counter()
    model = build(args)
    params = sum(t.numel() for t in model.parameters())
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids, "labels": ids}
    common = dict(world_size=args.world_size, optimizer="adamw", target=args.target)
    print(f"Llama shape: {args.layers} layers, hidden {args.hidden}, {params / 1e9:.2f} B parameters (bf16), "
          f"batch {args.batch}, seq {args.seq}, {args.world_size} ranks, AdamW, target {args.target}, on meta")
    if not args.least_only:
        eager = plan_fsdp(model, (), None, example_kwargs=kwargs, **common)
        eager_s = time.perf_counter() - started
        print(eager.table())
        print(f"FSDP2 eager blocks, per rank:           {eager.predicted_peak_bytes / GIB:8.2f} GiB ({eager_s:.0f} s)")
        full = full_checkpoint_peak(model, (), kwargs=kwargs, **common)
        print(f"FSDP2 + full checkpointing, per rank:   {full / GIB:8.2f} GiB "
              f"({time.perf_counter() - started - eager_s:.0f} s)")
    at, cpu = time.perf_counter(), time.process_time()
    try:  # a budget no plan meets: the refusal names the least found
        plan_fsdp(model, (), 1e-6, example_kwargs=kwargs, time_limit_s=args.time_limit, rounds=args.rounds, **common)
    except InfeasibleBudgetError as exc:
        print(exc.breakdown)
        ratio = "" if args.least_only else f", {exc.min_budget_bytes / full:.2f}x full checkpointing's"
        print(f"least found (fxmem's block and root plans, else torch's checkpoint): {exc.min_budget_bytes / GIB:8.2f} GiB "
              f"= {exc.min_budget_bytes / 2**20:.1f} MiB{ratio} (planned in {time.perf_counter() - at:.0f} s wall, "
              f"{time.process_time() - cpu:.0f} CPU s; {args.rounds} rounds, {args.time_limit:g} s per block plan)")
    print(f"whole script {time.perf_counter() - started:.0f} s wall; peak host memory (RSS) {peak_rss_bytes() / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
