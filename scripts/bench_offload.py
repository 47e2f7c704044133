#!/usr/bin/env python
"""Keep-all, recompute-only and recompute+offload on a zoo transformer at several budgets.

Plans offline for a target device preset (default h100 with its PCIe Gen5 link; works on a machine
without that device) and prints, per budget: predicted peak, predicted step time, extra FLOPs,
bytes offloaded and exposed transfer time. Budgets are fractions of the eager (keep-all) peak.
With CUDA present it also runs each plan on the GPU and measures peak (max_memory_allocated) and
step time (median of --repeats steps). Without it, every figure is the cost model's prediction.

examples:
  python scripts/bench_offload.py --quick
  python scripts/bench_offload.py --model gpt-small --batch-size 64 --fractions 0.8 0.6 0.4
  python scripts/bench_offload.py --target h100 --link nvlink-c2c
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem import models
from fxmem.measure import training_step

MIB = 2**20


def _measure(model, plan, inputs, repeats: int) -> tuple[float, float]:
    """(peak MiB, median step ms) of the planned step on CUDA."""
    module = fxmem.optimize(copy.deepcopy(model).cuda(), plan=plan)
    cuda_inputs = [x.cuda() for x in inputs]
    training_step(module, cuda_inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        for p in module.parameters():
            p.grad = None
        start = time.perf_counter()
        training_step(module, cuda_inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return torch.cuda.max_memory_allocated() / MIB, statistics.median(times) * 1e3


def _row(label: str, fraction: float | None, plan: fxmem.Plan, eager: fxmem.Plan) -> dict:
    return {
        "method": label,
        "budget": "-" if fraction is None else f"{fraction:.2f} x eager",
        "peak MiB": round(plan.predicted_peak_bytes / MIB, 1),
        "step ms": round(plan.predicted_step_s * 1e3, 3),
        "slowdown %": round(100 * (plan.predicted_step_s / eager.predicted_step_s - 1), 2),
        "memory saved %": round(100 * (1 - plan.predicted_peak_bytes / eager.predicted_peak_bytes), 1),
        "extra GFLOP": round(plan.extra_flops / 1e9, 2),
        "offloaded MiB": round(plan.offloaded_bytes / MIB, 1),
        "exposed ms": round(plan.exposed_transfer_s * 1e3, 3),
        "recomputed": len(plan.recompute),
        "offloaded": len(plan.offload),
    }


def _unscheduled(eager: fxmem.Plan, target: fxmem.DeviceSpec) -> dict:
    """Reference: every saved value of at least 1 MiB copied out and back on the compute stream (no
    overlap), so the step waits for every byte both ways; its peak is not modelled."""
    big = [r.bytes for r in eager.nodes if r.kept_on_device and r.bytes >= MIB]
    wait = sum(2 * target.host_link.seconds(b) for b in big) if target.host_link else float("nan")
    step = eager.predicted_step_s + wait
    return {"method": "offload all, unscheduled", "budget": "-", "peak MiB": "-", "step ms": round(step * 1e3, 3),
            "slowdown %": round(100 * (step / eager.predicted_step_s - 1), 1), "offloaded MiB": round(sum(big) / MIB, 1),
            "exposed ms": round(wait * 1e3, 3), "offloaded": len(big)}


def bench(name: str, batch: int, fractions: list[float], target: fxmem.DeviceSpec, time_limit_s: float,
          repeats: int) -> list[dict]:
    torch.manual_seed(0)
    model = models.from_name(name)
    inputs = models.example_inputs(name, batch)
    eager = fxmem.plan(model, inputs, target=target)
    rows = [_row("keep all", None, eager, eager), _unscheduled(eager, target)]
    measured = {id(rows[0]): eager}
    for fraction in fractions:
        budget = eager.baseline_peak_bytes * fraction / 2**30
        for label, offload in (("recompute", False), ("recompute+offload", True)):
            try:
                plan = fxmem.plan(model, inputs, budget_gb=budget, target=target, offload=offload,
                                  time_limit_s=time_limit_s)
            except fxmem.InfeasibleBudgetError:
                rows.append({"method": label, "budget": f"{fraction:.2f} x eager", "peak MiB": "infeasible"})
                continue
            rows.append(_row(label, fraction, plan, eager))
            measured[id(rows[-1])] = plan
    if torch.cuda.is_available():
        for row in rows:
            plan = measured.get(id(row))
            if plan is not None:
                row["measured peak MiB"], row["measured step ms"] = (round(x, 2) for x in
                                                                     _measure(model, plan, inputs, repeats))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small", help="zoo preset (default gpt-small)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.75, 0.6, 0.45],
                        help="budgets as fractions of the keep-all peak")
    parser.add_argument("--target", default="h100", help="device preset to plan for (default h100)")
    parser.add_argument("--link", help="host link preset instead of the device's own (pcie4, pcie5, nvlink-c2c)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per plan on CUDA")
    parser.add_argument("--quick", action="store_true", help="two budgets, short solver limit (a few minutes on CPU)")
    args = parser.parse_args(argv)
    target = fxmem.DeviceSpec.from_name(args.target)
    if args.link:
        target = target.with_link(args.link)
    fractions, limit = (args.fractions[1:3], 3.0) if args.quick else (args.fractions, args.time_limit)
    rows = bench(args.model, args.batch_size, fractions, target, limit, args.repeats)
    link = target.host_link.name if target.host_link else "none"
    where = "measured on CUDA" if torch.cuda.is_available() else "predicted by the cost model (no GPU here)"
    print(f"{args.model}, batch {args.batch_size}, planned for {target.name} over {link}; {where}\n")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
