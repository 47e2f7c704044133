#!/usr/bin/env python
"""Measured figures for fxmem on the zoo: budgets met, prediction error, extra FLOPs, step time.

Reads zoo presets; for each, plans at budgets between the least feasible one and the eager
peak, runs the planned step, and measures its peak with an independent meter (MemTracker on
CPU, torch.cuda.max_memory_allocated on GPU) and its time side by side with eager (interleaved
repeats, medians). Prints a markdown table; --out writes it (or JSON when the name ends .json).

examples:
  python scripts/bench.py --quick
  python scripts/bench.py --compile --models gpt-tiny resnet-tiny
  python scripts/bench.py --models gpt-small resnet18 --fractions 0.7 0.3 0 --out BENCH.md
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem import models
from fxmem.backend import plans_for
from fxmem.measure import measure_peak_bytes, training_step

QUICK = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "unet-tiny"]
QUICK_BATCH = {"mlp-tiny": 1024}
MIB = 2**20


def _min_budget(model, inputs, time_limit_s: float) -> int:
    try:
        fxmem.plan(model, inputs, budget_gb=1e-9, time_limit_s=time_limit_s)
    except fxmem.InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("a 1-byte budget was accepted")


def _step_seconds(modules: dict, inputs, repeats: int) -> dict[str, float]:
    """Median step time per module, runs interleaved so machine noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(repeats):
        for name, module in modules.items():
            start = time.perf_counter()
            training_step(module, inputs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_model(name: str, fractions: list[float], batch: int | None, repeats: int, time_limit_s: float,
                device: str) -> list[dict]:
    torch.manual_seed(0)
    model = models.from_name(name).to(device)
    inputs = tuple(x.to(device) for x in models.example_inputs(name, batch))
    eager_plan = fxmem.plan(model, inputs)
    lowest = _min_budget(model, inputs, time_limit_s)
    eager_measured = measure_peak_bytes(model, inputs)
    rows = []
    if lowest >= eager_plan.baseline_peak_bytes:
        print(f"  {name}: activations are within the planner's safety margin; nothing to plan", file=sys.stderr)
        return rows
    for fraction in fractions:
        budget = int(lowest + fraction * (eager_plan.baseline_peak_bytes - lowest))
        started = time.perf_counter()
        plan = fxmem.plan(model, inputs, budget_gb=budget / 2**30, time_limit_s=time_limit_s)
        plan_s = time.perf_counter() - started
        optimized = fxmem.optimize(copy.deepcopy(model), plan=plan)
        measured = measure_peak_bytes(optimized, inputs)
        seconds = _step_seconds({"eager": model, "fxmem": optimized}, inputs, repeats)
        floor = sum(plan.breakdown.values())
        rows.append({
            "model": name, "fraction": fraction, "eager_peak_mib": eager_measured / MIB,
            "budget_mib": budget / MIB, "measured_mib": measured / MIB, "predicted_mib": plan.predicted_peak_bytes / MIB,
            "within_budget": measured <= budget,
            "prediction_error_pct": 100 * (plan.predicted_peak_bytes - measured) / measured,
            "activation_cut_pct": 100 * (eager_measured - measured) / max(eager_measured - floor, 1),
            "extra_flops_pct": plan.extra_flops_pct, "step_time_ratio": seconds["fxmem"] / seconds["eager"],
            "solver": f"{plan.solver_status} gap {plan.solver_gap:.2f}", "plan_s": plan_s,
            "solve_s": plan.solve_time_s})
    return rows


def _aot_eager_counting(graph_flops: list[int]):
    """The aot_eager backend (min-cut partitioner, activation_memory_budget applies), recording the
    FLOPs of every forward and backward graph it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fxmem.cost import estimate

    def count(gm, example_inputs):
        graph_flops.append(estimate(gm).total_flops())
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=count, bw_compiler=count, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


def bench_compile(name: str, fractions: list[float], batch: int | None, repeats: int, time_limit_s: float,
                  device: str) -> list[dict]:
    """fxmem's backend next to PyTorch's activation_memory_budget (knapsack), both on aot_eager, at
    equal measured peak: for each fxmem budget, the torch fraction whose measured peak is the
    largest one not above fxmem's. FLOPs (FlopCounterMode cannot count inside compiled frames):
    fxmem's planned extra FLOPs (the eager path measures exactly these); for PyTorch, the FLOPs of
    the forward and backward graphs it compiled, less those of its 1.0 (save-all) graphs."""
    torch.manual_seed(0)
    model = models.from_name(name).to(device)
    inputs = tuple(x.to(device) for x in models.example_inputs(name, batch))
    eager_plan = fxmem.plan(model, inputs)
    lowest = _min_budget(model, inputs, time_limit_s)
    torch_runs = []
    for fraction in (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            twin = copy.deepcopy(model)
            graph_flops: list[int] = []
            twin.compile(backend=_aot_eager_counting(graph_flops))
            peak = measure_peak_bytes(twin, inputs)
            seconds = _step_seconds({"eager": model, "torch": twin}, inputs, repeats)
        torch_runs.append((fraction, peak, seconds["torch"] / seconds["eager"], sum(graph_flops)))
    save_all_flops = torch_runs[0][3]
    rows = []
    for fraction in fractions:
        budget = int(lowest + fraction * (eager_plan.baseline_peak_bytes - lowest))
        torch._dynamo.reset()
        twin = copy.deepcopy(model)
        options = {"budget_gb": budget / 2**30, "inner": "aot_eager", "time_limit_s": time_limit_s}
        twin.compile(backend="fxmem", options=options)
        peak = measure_peak_bytes(twin, inputs)
        plans = plans_for(options)
        extra = 100 * sum(p.extra_flops for p in plans) / max(sum(p.total_flops for p in plans), 1)
        ratio = (lambda s: s["fxmem"] / s["eager"])(_step_seconds({"eager": model, "fxmem": twin}, inputs, repeats))
        match = max((r for r in torch_runs if r[1] <= peak), key=lambda r: r[1], default=None)
        rows.append({"model": name, "budget_mib": budget / MIB, "fxmem_peak_mib": peak / MIB,
                     "fxmem_extra_flops_pct": extra, "fxmem_time": ratio,
                     "torch_fraction": match and match[0], "torch_peak_mib": match and match[1] / MIB,
                     "torch_time": match and match[2],
                     "torch_extra_flops_pct": match and 100 * (match[3] - save_all_flops) / max(save_all_flops, 1),
                     "torch_lowest_peak_mib": min(r[1] for r in torch_runs) / MIB})
    return rows


def _compile_table(rows: list[dict]) -> str:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    return tabulate([[r["model"], f"{r['budget_mib']:.2f}", f"{r['fxmem_peak_mib']:.2f}",
                      f"{r['fxmem_extra_flops_pct']:.1f}%", f"{r['fxmem_time']:.2f}", fmt(r["torch_fraction"], ".1f"),
                      fmt(r["torch_peak_mib"], ".2f"), fmt(r["torch_extra_flops_pct"], ".1f"), fmt(r["torch_time"], ".2f"),
                      f"{r['torch_lowest_peak_mib']:.2f}"] for r in rows],
                    headers=["model", "budget MiB", "fxmem-compile MiB", "planned extra FLOPs", "time ×eager",
                             "torch-budget frac", "torch MiB", "extra FLOPs %", "time ×eager", "torch lowest MiB"], tablefmt="github")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help=f"zoo presets (default: {' '.join(QUICK)})")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.7, 0.3, 0.0],
                        help="budgets as fractions of the way from the least feasible budget to the eager peak")
    parser.add_argument("--batch-size", type=int, nargs="+",
                        help="batch size, one for all models or one per model (default: each preset's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per method (default 5)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds")
    parser.add_argument("--quick", action="store_true", help="tiny presets only (CI-sized, a few minutes)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile rows: the fxmem backend next to PyTorch's activation_memory_budget")
    parser.add_argument("--out", help="write the table here (.md) or the rows (.json)")
    args = parser.parse_args(argv)
    names = args.models or QUICK
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    sizes = args.batch_size or []
    if len(sizes) not in (0, 1, len(names)):
        parser.error("give one --batch-size, or one per model")
    for k, name in enumerate(names):
        print(f"benchmarking {name} on {device} ...", file=sys.stderr, flush=True)
        batch = (sizes[k] if len(sizes) > 1 else sizes[0]) if sizes else QUICK_BATCH.get(name)
        run = bench_compile if args.compile else bench_model
        rows += run(name, args.fractions, batch, args.repeats, args.time_limit, device)
    if args.compile:
        print(_compile_table(rows))
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(rows, indent=1) if args.out.endswith(".json") else _compile_table(rows) + "\n")
        return 0
    table = tabulate([[r["model"], r["fraction"], f"{r['eager_peak_mib']:.2f}", f"{r['budget_mib']:.2f}",
                       f"{r['measured_mib']:.2f}", "yes" if r["within_budget"] else "NO",
                       f"{r['prediction_error_pct']:+.2f}%", f"{r['activation_cut_pct']:.0f}%",
                       f"{r['extra_flops_pct']:.1f}%", f"{r['step_time_ratio']:.2f}", r["solver"],
                       f"{r['solve_s']:.1f}"] for r in rows],
                     headers=["model", "frac", "eager MiB", "budget MiB", "measured MiB", "fits", "pred err",
                              "act. cut", "extra FLOPs", "time ×eager", "solver", "solve s"], tablefmt="github")
    header = (f"device: {device}, torch {torch.__version__}, meter: "
              f"{'torch.cuda.max_memory_allocated' if device == 'cuda' else 'MemTracker'}")
    print(header + "\n\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            if args.out.endswith(".json"):
                json.dump(rows, f, indent=1)
            else:
                f.write(header + "\n\n" + table + "\n")
    return 0 if all(r["within_budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
