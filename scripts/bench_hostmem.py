#!/usr/bin/env python
"""Optimizer state in host memory, planned: the Llama-3-8B shape (transformers `LlamaConfig`, fp32
parameters under bf16 autocast, AdamW) built on the meta device, planned for a GPU (default h100) at
several budgets with `fxmem.plan(..., optimizer="adamw", offload=True)`. Per budget, the mixes the planner
considered (fxmem.planner.host_state): the state on the device (refused, with its least budget, where it
does not fit), all of it on the host, all of it and the gradients on the host (each gradient moved out inside
backward, passes/host_gradients.py), and the planner's choice, each with its predicted peak and step time
(the host update and the copies' exposed time included). Also the least budget with the state on the
device (`optimizer=2.0`: AdamW's state bytes, pinned to the device). Nothing runs: no weights exist.

The host update's rate is this machine's CPU (fxmem.price.host_update) unless --host-gbps names one.

examples:
  python scripts/bench_hostmem.py                           # 8B, 1x2048, h100, budgets 80 60 40 GiB
  python scripts/bench_hostmem.py --budgets 80 40 35 --host-gbps 1.2   # down to the gradients on the host
  python scripts/bench_hostmem.py --layers 2 --budgets 20 12  # a quick look
  python scripts/bench_hostmem.py --host-gbps 20 --fused    # a server CPU's fused AdamW, as you measured it
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_meta import add_shape_arguments  # noqa: E402 - the Llama shape's flags, as bench_meta reads them

GIB = 2**30


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(8192, args.seq), rope_theta=500000.0, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)  # fp32 parameters; autocast runs the matmuls in bf16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("examples:")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=float, nargs="+", default=[80.0, 60.0, 40.0], help="GiB (default 80 60 40)")
    p.add_argument("--target", default="h100")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    add_shape_arguments(p)
    p.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per plan (default 10)")
    p.add_argument("--host-gbps", type=float, help="the host update's rate in GB/s of parameters (default: measured)")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True): torch's fused CPU kernel on the host")
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.host_gbps:
        os.environ["FXMEM_HOST_UPDATE_GBPS"] = str(args.host_gbps)
    import fxmem
    from fxmem.price.host_update import host_update_bytes_per_s

    model = build(args)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    optimizer = "adamw"
    if args.fused:  # a real optimizer over the meta parameters says fused=True; no state is made
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    print(f"Llama shape: {args.layers} layers, hidden {args.hidden}, {args.batch}x{args.seq} tokens, fp32 parameters "
          f"under bf16 autocast, AdamW; target {args.target}; host update "
          f"{host_update_bytes_per_s(args.fused) / 1e9:.2f} GB/s of parameters")

    def plan(budget: float, state: object):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fxmem.plan(model, (), budget, example_kwargs={"input_ids": ids, "labels": ids}, target=args.target,
                              optimizer=state, offload=True, time_limit_s=args.time_limit)

    least_on_device = None
    for budget in args.budgets:
        started = time.perf_counter()
        if least_on_device is None:
            try:
                plan(budget, 2.0)  # AdamW's 2 state bytes per parameter byte, on the device
            except fxmem.InfeasibleBudgetError as exc:
                least_on_device = exc.min_budget_bytes
                print(f"state on the device at {budget:g} GiB: refused, least {least_on_device / GIB:.2f} GiB "
                      f"({time.perf_counter() - started:.0f} s)")
        try:
            made = plan(budget, optimizer)
        except fxmem.InfeasibleBudgetError as exc:
            print(f"{budget:g} GiB: refused with the state on the host too: least {exc.min_budget_bytes / GIB:.2f} GiB")
            continue
        print(f"\n{budget:g} GiB (planned in {time.perf_counter() - started:.0f} s): {made.host_state_bytes / GIB:.2f} "
              f"GiB of state on the host ({len(made.host_parameters)} parameters; {made.host_gradient_bytes / GIB:.2f} "
              f"GiB of gradients with it), "
              f"{made.optimizer_state_bytes / GIB:.2f} GiB on the device; peak {made.predicted_peak_bytes / GIB:.2f} "
              f"GiB, step {made.predicted_step_s:.3f} s (host update {made.host_update_s:.3f} s, exposed transfers "
              f"{made.exposed_transfer_s:.3f} s, recompute {len(made.recompute)} ops, {len(made.offload)} offloaded)")
        print(f"  {'mix':68s} {'state on device':>16s} {'grads on host':>14s} {'peak':>10s} {'step':>10s}")
        for row in made.host_options:
            if row["step_s"] is None:
                what = "least" if row.get("least") == "found" else "needs at least"
                figures = f"{'refused':>10s} ({what} {row['least_bytes'] / GIB:.2f} GiB)"
            else:
                figures = f"{row['peak_bytes'] / GIB:8.2f} G {row['step_s']:9.3f}s"
            mark = "* " if row["chosen"] else "  "
            print(f"{mark}{row['mix']:68s} {row['device_state_bytes'] / GIB:14.2f} G "
                  f"{row.get('host_gradient_bytes', 0) / GIB:12.2f} G {figures}")


if __name__ == "__main__":
    main()
