#!/usr/bin/env python
"""The least budget at the size people train: transformers GPT-2 shapes of 12, 24 and 48 layers with
their loss (cross-entropy as `loss_fn`, dropout 0.1 as GPT-2's config), planned on fake tensors
(nothing runs). Per shape: the least peak the searches found (in the solvers' model, which counts a
recomputed chain as alive at once) and which search found it; the least peak of the simulated
rewritten graphs (the lowest of that, checkpointing every layer and the in-order descent); the lower
bound no plan can go below and the gap; the least budget (`InfeasibleBudgetError`, with the planning
margin); the seconds the search took and the whole plan (capture and AOTAutograd trace included).
Prints a markdown table. With `--budgets-gb`, also plans each shape at those budgets twice, side by
side: as fxmem does (the solver's decision and the least decision, each relaxed, the cheaper kept) and
with the solver's route alone, as before the least route was offered; a second table gives the
predicted extra FLOPs, predicted peak and plan seconds of each.

examples:
  python scripts/bench_scale.py
  python scripts/bench_scale.py --shapes 12x768x8x1024 --time-limit 30
  python scripts/bench_scale.py --shapes 12x768x8x1024 --time-limit 2 --budgets-gb 6 7 8 9
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxmem
import fxmem.planner.planner

MIB = 2**20
SHAPES = ("12x768x8x1024", "24x1024x4x1024", "48x768x2x1024")  # layers x width x batch x sequence


def cross_entropy(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def gpt2(shape: str):
    """A transformers GPT-2 of `shape` (layers x width x batch x sequence) and its token ids."""
    import transformers

    layers, width, batch, seq = map(int, shape.split("x"))
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=seq,
                                     use_cache=False)
    with torch.device("cpu"):
        model = transformers.GPT2LMHeadModel(config).train()
    return model, torch.randint(0, config.vocab_size, (batch, seq))


def budget_rows(shape: str, budgets_gb: list[float], time_limit: float) -> list[dict]:
    """Per budget: fxmem's plan and the solver's route alone (`fxmem.planner.planner.LARGE_CANDIDATES` raised
    past the graph's size), side by side."""
    model, ids = gpt2(shape)
    rows, large = [], fxmem.planner.planner.LARGE_CANDIDATES
    for budget in budgets_gb:
        for route, limit in (("both, cheaper kept", large), ("solver's alone", 1 << 30)):
            fxmem.planner.planner.LARGE_CANDIDATES = limit
            started = time.perf_counter()
            try:
                plan = fxmem.plan(model, (ids,), budget_gb=budget, loss_fn=cross_entropy, example_target=ids,
                                  time_limit_s=time_limit)
                found = {"extra FLOPs": f"{plan.extra_flops / plan.total_flops:.1%}",
                         "predicted MiB": f"{plan.predicted_peak_bytes / MIB:.0f}", "solver": plan.solver}
            except fxmem.InfeasibleBudgetError as error:
                found = {"extra FLOPs": "refused", "predicted MiB": f"least {error.min_budget_bytes / MIB:.0f}"}
            finally:
                fxmem.planner.planner.LARGE_CANDIDATES = large
            rows.append({"shape": shape, "budget GiB": budget, "route": route, **found,
                         "whole plan s": f"{time.perf_counter() - started:.0f}"})
            print(rows[-1], flush=True)
    return rows


def row(shape: str, time_limit: float) -> dict:
    model, ids = gpt2(shape)
    searched = {}
    least_peak = fxmem.planner.planner.least_peak

    def timed(problem, *args, **kwargs):
        started = time.perf_counter()
        found = least_peak(problem, *args, **kwargs)
        searched.update(seconds=time.perf_counter() - started, values=problem.num_values, found=found)
        return found

    lowest = fxmem.planner.planner.lowest

    def simulated(*args, **kwargs):
        found = lowest(*args, **kwargs)
        searched.update(simulated=found.timeline.peak)
        return found

    fxmem.planner.planner.least_peak, fxmem.planner.planner.lowest = timed, simulated
    started = time.perf_counter()
    try:
        fxmem.plan(model, (ids,), budget_gb=1e-6, loss_fn=cross_entropy, example_target=ids,
                   time_limit_s=time_limit)
    except fxmem.InfeasibleBudgetError as error:
        least_budget = error.min_budget_bytes
    finally:
        fxmem.planner.planner.least_peak, fxmem.planner.planner.lowest = least_peak, lowest
    total = time.perf_counter() - started
    found, peak = searched["found"], searched["simulated"]
    return {"shape (layers x width x batch x seq)": shape, "values": searched["values"],
            "search's least MiB": f"{found.peak / MIB:.1f}", "found by": found.method,
            "least peak, simulated MiB": f"{peak / MIB:.1f}", "lower bound MiB": f"{found.lower_bound / MIB:.1f}",
            "gap": f"{(peak - found.lower_bound) / found.lower_bound:.1%}",
            "least budget MiB": f"{least_budget / MIB:.1f}",
            "search s": f"{searched['seconds']:.1f}", "whole plan s": f"{total:.0f}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="layers x width x batch x sequence")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver limit, seconds (default 10)")
    p.add_argument("--budgets-gb", type=float, nargs="*", default=[],
                   help="also plan at these budgets, with and without the least route")
    args = p.parse_args(argv)
    rows, budgeted = [], []
    for shape in args.shapes:
        rows.append(row(shape, args.time_limit))
        print(rows[-1], flush=True)
        budgeted += budget_rows(shape, args.budgets_gb, args.time_limit)
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if budgeted:
        print(tabulate(budgeted, headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
