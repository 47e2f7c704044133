"""Benchmark pooled buffers: arena vs lower bound vs one allocation per buffer on zoo models, and
the offset planner on hard generated instances. Prints markdown tables (tabulate).

    python scripts/bench_pool.py --quick                  # tiny presets, small hard instances (< 2 min)
    python scripts/bench_pool.py                          # also realistic presets; 100, 500, 2000 buffers
    python scripts/bench_pool.py --models gpt-tiny --sizes 100 500 --time-limit 10
    python scripts/bench_pool.py --pool-all --sizes           # pool every intermediate; zoo only
    python scripts/bench_pool.py --models --sizes 100 500 1000 2000 --seeds 0 1   # hard instances only
    python scripts/bench_pool.py --models --sizes 500 --no-lns  # CP-SAT on the whole packing, as before LNS

Zoo figures come from planning on fake tensors (`fxmem.plan(..., pool=True)`), per forward and
backward graph; the allocator column runs the step on a GPU (`torch.cuda.max_memory_reserved`)
when CUDA exists.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem import models
from fxmem.errors import fmt_bytes
from fxmem.solve.packing import best_heuristic, heuristic_orders, live_profile, place
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/
from tests.solve.pack_instances import hard_instance  # noqa: E402

TINY = [("mlp-tiny", 1024), ("gpt-tiny", None), ("resnet-tiny", None), ("unet-tiny", None)]
REALISTIC = [("gpt-small", 8), ("resnet18", 8), ("unet-small", 4)]


def _reserved_peak(name: str, batch: int | None, pool: bool | str) -> str:
    if not torch.cuda.is_available():
        return "n/a (no GPU)"
    torch.manual_seed(0)
    model = models.from_name(name).cuda()
    inputs = models.example_inputs(name, batch, device="cuda")
    step = fxmem.optimize(model, budget_gb=1e3, pool=pool)
    fxmem.measure.training_step(step, inputs)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for p in model.parameters():
        p.grad = None
    fxmem.measure.training_step(step, inputs)
    torch.cuda.synchronize()
    return fmt_bytes(torch.cuda.max_memory_reserved())


def zoo_rows(names: list[tuple[str, int | None]], time_limit_s: float, pool: bool | str) -> list[list]:
    rows = []
    for name, batch in names:
        torch.manual_seed(0)
        model, inputs = models.from_name(name), models.example_inputs(name, batch)
        started = time.perf_counter()
        plan = fxmem.plan(model, inputs, pool=pool, time_limit_s=time_limit_s)
        elapsed = time.perf_counter() - started
        label = f"{name} ({inputs[0].shape[0]})"
        for graph, s in (("forward", plan.pool.forward), ("backward", plan.pool.backward)):
            rows.append([label, graph, fmt_bytes(s.no_reuse_bytes), fmt_bytes(s.lower_bound_bytes),
                         fmt_bytes(s.arena_bytes), f"{s.pooled} ({s.out_variant} out=, {s.copied} copy)",
                         s.allocations_avoided, f"{s.solve_time_s * 1e3:.1f} ms"])
        pooled_peak = plan.pool.predicted_peak_bytes
        rows.append([label, "step peak", "", "", f"{fmt_bytes(plan.predicted_peak_bytes)} unpooled, "
                     f"{fmt_bytes(pooled_peak)} pooled ({(pooled_peak / plan.predicted_peak_bytes - 1) * 100:+.1f}%)",
                     f"allocator reserved: {_reserved_peak(name, batch, False)} / {_reserved_peak(name, batch, pool)}",
                     "", f"plan {elapsed:.1f} s"])
    return rows


def hard_rows(sizes: list[int], time_limit_s: float, seeds: list[int]) -> list[list]:
    import numpy as np

    rows = []
    for n in sizes:
        for seed in seeds:
            buffers = hard_instance(n, seed=seed)
            arr = np.asarray(buffers, dtype=np.int64)
            start, end, size = arr[:, 0], arr[:, 1], arr[:, 2] // 64
            lower = int(live_profile(start, end, size)[1].max())
            largest = place(heuristic_orders(start, end, size)["largest-first"], start, end, size, "best")
            heur, _ = best_heuristic(start, end, size, min(1.0, time_limit_s / 10))
            started = time.perf_counter()
            packed = fxmem.pack_buffers(buffers, time_limit_s=time_limit_s)
            wall = time.perf_counter() - started
            gap = lambda off: f"{((off + size).max() / lower - 1) * 100:.1f}%"  # noqa: E731
            rows.append([n, seed, fmt_bytes(packed.lower_bound_bytes), gap(largest), gap(heur),
                         f"{packed.gap * 100:.1f}%", packed.status, packed.method.split(" (")[0],
                         f"{wall:.1f} s"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny presets and 100/500-buffer instances only")
    parser.add_argument("--models", nargs="*", help="zoo presets (default: tiny, plus realistic without --quick)")
    parser.add_argument("--sizes", nargs="*", type=int, help="hard-instance sizes (default 100 500 2000)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1], help="hard-instance seeds")
    parser.add_argument("--pool-all", action="store_true",
                        help="pool every intermediate (pool=\"all\"), not only those that keep each graph's peak")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per packing (default 10)")
    parser.add_argument("--no-lns", action="store_true",
                        help="CP-SAT on the whole packing at every size (no large-neighbourhood search), for comparison")
    args = parser.parse_args(argv)
    if args.no_lns:
        from fxmem.solve import packing

        packing.LNS_ABOVE = 1 << 62
    names = [(m, None) for m in args.models] if args.models is not None else TINY + ([] if args.quick else REALISTIC)
    sizes = args.sizes if args.sizes is not None else ([100, 500] if args.quick else [100, 500, 2000])
    limit = min(args.time_limit, 5.0) if args.quick else args.time_limit
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}\n")
    if names:
        headers = ["model (batch)", "graph", "no reuse", "lower bound", "arena", "pooled values",
                   "allocations avoided", "solve"]
        pool = "all" if args.pool_all else True
        print(f"fxmem.plan(..., pool={pool!r}): per graph, and the step's simulated peak\n")
        print(tabulate(zoo_rows(names, limit, pool), headers=headers, tablefmt="github"), "\n")
    if sizes:
        headers = ["buffers", "seed", "lower bound", "largest-first best-fit", "best heuristic", "pack_buffers",
                   "status", "method", "wall time"]
        print(f"Hard instances (zero-slack tilings, time limit {limit:g} s, gaps above the lower bound"
              f"{'; no LNS' if args.no_lns else ''}):\n")
        print(tabulate(hard_rows(sizes, limit, args.seeds), headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
