#!/usr/bin/env python
"""fxmem planned at full activation checkpointing's measured peak, against full activation
checkpointing itself: both peaks (MemTracker, or `torch.cuda.max_memory_allocated` on CUDA) and
their step times against eager, measured side by side (interleaved medians) in one process.
`--threads` pins torch's CPU threads so that a loaded machine slows every method alike.

examples:
  python scripts/bench_at_full_ac.py                       # gpt-small, batch 8
  python scripts/bench_at_full_ac.py --models gpt-small resnet18 --threads 1 --repeats 9
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import full_ac  # noqa: E402
from bench import _step_seconds, load  # noqa: E402

import fxmem  # noqa: E402
from fxmem.measure import measure_peak_bytes  # noqa: E402

MIB = 2**20
BATCH = {"gpt-small": 8, "resnet18": 8, "unet-small": 4, "mlp-small": 128}


def row(name: str, batch: int, repeats: int, time_limit_s: float) -> dict:
    model, inputs = load(name, batch, "cuda" if torch.cuda.is_available() else "cpu")
    checkpointed = full_ac(model)
    if checkpointed is None:
        return {"model": name, "note": "blocks do not chain: no full-ac"}
    budget = measure_peak_bytes(checkpointed, inputs)
    plan = fxmem.plan(model, inputs, budget_gb=budget / 2**30, time_limit_s=time_limit_s)
    planned = fxmem.optimize(model, plan=plan)
    peak = measure_peak_bytes(planned, inputs)
    seconds = _step_seconds({"eager": model, "full-ac": checkpointed, "fxmem": planned}, inputs, repeats)
    return {"model": f"{name} b{batch}", "full-ac MiB": f"{budget / MIB:.2f}", "fxmem MiB": f"{peak / MIB:.2f}",
            "fxmem predicted MiB": f"{plan.predicted_peak_bytes / MIB:.2f}",
            "fxmem extra FLOPs": f"{100 * plan.extra_flops / plan.total_flops:.1f}%",
            "full-ac x eager": f"{seconds['full-ac'] / seconds['eager']:.2f}",
            "fxmem x eager": f"{seconds['fxmem'] / seconds['eager']:.2f}",
            "fxmem faster than full-ac": f"{100 * (1 - seconds['fxmem'] / seconds['full-ac']):.1f}%",
            "solver": plan.solver}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt-small"], help="zoo presets (default gpt-small)")
    p.add_argument("--batch-size", type=int, help="one batch size for all (default: per model)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per method (default 7)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver limit, seconds (default 10)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row(name, args.batch_size or BATCH.get(name, 8), args.repeats, args.time_limit) for name in args.models]
    print(tabulate(rows, headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
