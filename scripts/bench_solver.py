#!/usr/bin/env python
"""Solver figures: the gap to the exact optimum, and solve time against graph size.

Reads zoo presets (each planned once on fake tensors to get its MemoryProblem; nothing runs)
and synthetic transformer-like stacks built here. Table 1: per problem (up to ~200 candidates)
and budget (90/70/50/30% of the way from the eager peak to the least peak), the recompute
cost of the exact optimum and each solver's gap to it. Table 2: solve time of the default
solver against graph size (candidates, and joint-graph steps) from ~500 to ~20,000 steps,
GPT with 4 to 48 layers among them. Prints markdown; --out writes it (JSON when it ends .json).

examples:
  python scripts/bench_solver.py --quick
  python scripts/bench_solver.py --out solver.md
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from tabulate import tabulate

from fxmem.solve.problem import NEVER, MemoryProblem, eager_decision, peak_bytes
from fxmem.solve.recompute import solve
from fxmem.solve.recompute.exact import exact_min_peak, solve_exact
from fxmem.solve.recompute.layered import layered_min_peak
from fxmem.solve.recompute.layers import find_layers

FRACTIONS = (0.9, 0.7, 0.5, 0.3)
GAP_SOLVERS = ("auto", "layered", "cpsat", "greedy")


def zoo_problem(name: str, batch: int | None = None, **overrides) -> MemoryProblem:
    """The MemoryProblem fxmem builds for one training step of a zoo preset (fake tensors)."""
    import torch

    import fxmem.planner.planner as planner
    from fxmem import models
    from fxmem.api import plan

    seen = {}
    original = planner.build_problem

    def keep(*args, **kwargs):
        seen["lowered"] = original(*args, **kwargs)
        return seen["lowered"]

    planner.build_problem = keep
    try:
        torch.manual_seed(0)
        plan(models.from_name(name, **overrides), models.example_inputs(name, batch, **overrides))
    finally:
        planner.build_problem = original
    return seen["lowered"].problem


def stack(layers: int, width: int = 1 << 20) -> MemoryProblem:
    """Transformer-like blocks (norm, qkv, scores, softmax, a kept random mask, attention,
    projection, residual, norm, up, gelu, down, residual) between an embedding and a head.
    Op k runs forward at step k and backward at step 2n-1-k; costs in ns, sizes in bytes."""
    w = width
    spec = [("emb", 1, 300, (), True)]  # (name, size in w, cost, inputs, recomputable)
    x = "emb"
    for k in range(layers):
        spec += [(f"ln.{k}", 1, 60, (x,), True), (f"qkv.{k}", 3, 900, (f"ln.{k}",), True),
                 (f"s.{k}", 2, 400, (f"qkv.{k}",), True), (f"p.{k}", 2, 80, (f"s.{k}",), True),
                 (f"d.{k}", 2, 50, (f"p.{k}",), False), (f"a.{k}", 1, 400, (f"d.{k}", f"qkv.{k}"), True),
                 (f"o.{k}", 1, 600, (f"a.{k}",), True), (f"r.{k}", 1, 20, (x, f"o.{k}"), True),
                 (f"ln2.{k}", 1, 60, (f"r.{k}",), True), (f"up.{k}", 4, 1200, (f"ln2.{k}",), True),
                 (f"g.{k}", 4, 100, (f"up.{k}",), True), (f"dn.{k}", 1, 1200, (f"g.{k}",), True),
                 (f"x.{k}", 1, 20, (f"r.{k}", f"dn.{k}"), True)]
        x = f"x.{k}"
    spec += [("lnf", 1, 60, (x,), True), ("head", 8, 1000, ("lnf",), True), ("loss", 0, 200, ("head",), True)]
    n, idx = len(spec), {s[0]: i for i, s in enumerate(spec)}
    reads: list[list[int]] = [[] for _ in spec]
    for k, (_, _, _, ins, _) in enumerate(spec):
        for name in ins:  # backward of op k reads its inputs
            reads[idx[name]].append(2 * n - 1 - k)
    return MemoryProblem(
        names=tuple(s[0] for s in spec), size=tuple(s[1] * w for s in spec), cost=tuple(s[2] for s in spec),
        inputs=tuple(tuple(idx[i] for i in s[3]) for s in spec), aliases=(False,) * n,
        needed=tuple(bool(r) for r in reads), can_save=(True,) * n, can_recompute=tuple(s[4] for s in spec),
        saved_from=tuple(k + 1 for k in range(n)), need_first=tuple(min(r) if r else NEVER for r in reads),
        need_last=tuple(max(r) if r else NEVER for r in reads),
        base=tuple(64 * w + spec[min(t, 2 * n - 1 - t)][1] * w for t in range(2 * n)), budget=1)


def _budgets(problem: MemoryProblem, low: int) -> list[tuple[float, int]]:
    high = peak_bytes(problem, eager_decision(problem))
    return [(f, int(low + (high - low) * f)) for f in FRACTIONS]


def gap_rows(problems: dict[str, MemoryProblem], exact_s: float, solver_s: float) -> list[dict]:
    rows = []
    for name, problem in problems.items():
        lowest = exact_min_peak(problem, exact_s)
        if lowest is None:
            print(f"  {name}: no decision found for the least peak", file=sys.stderr)
            continue
        for fraction, budget in _budgets(problem, lowest[0]):
            p = replace(problem, budget=budget)
            best = solve_exact(p, exact_s)
            row = {"problem": name, "candidates": p.num_values, "budget": f"{fraction:.0%}",
                   "exact cost": best.objective, "exact": best.status, "exact s": round(best.solve_time_s, 1)}
            for solver in GAP_SOLVERS:
                sol = solve(p, solver, solver_s)
                fits = sol.fits
                gap = (sol.objective - best.objective) / max(best.objective, 1) if fits else None
                row[f"{solver} gap"] = "n/a" if gap is None else f"{gap:+.1%}"
                row[f"{solver} s"] = round(sol.solve_time_s, 2)
            rows.append(row)
            print(f"  {name} {fraction:.0%}: {row}", file=sys.stderr)
    return rows


def time_rows(problems: dict[str, MemoryProblem], solver_s: float, compare: bool) -> list[dict]:
    rows = []
    for name, problem in problems.items():
        started = time.perf_counter()
        layers = find_layers(problem)
        detect = time.perf_counter() - started
        low = layered_min_peak(problem, 2.0, layers)
        high = peak_bytes(problem, eager_decision(problem))
        budget = int((low[0] if low else high) + (high - (low[0] if low else high)) * 0.5)
        sol = solve(replace(problem, budget=budget), "auto", solver_s)
        row = {"problem": name, "candidates": problem.num_values, "steps": problem.num_steps,
               "layers": f"{layers.count} x {layers.length}" if layers else "none",
               "detect s": round(detect, 3), "solver": sol.solver, "status": sol.status,
               "solve s (50% budget)": round(sol.solve_time_s, 2)}
        if compare:
            other = solve(replace(problem, budget=budget), "cpsat", solver_s)
            row["cpsat cost vs auto"] = "no fit" if not other.fits else \
                f"{(other.objective - sol.objective) / max(sol.objective, 1):+.1%}"
            row["cpsat s"] = round(other.solve_time_s, 2)
        rows.append(row)
        print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller problems (about 3 minutes)")
    parser.add_argument("--exact-time", type=float, default=None, help="exact solver limit per solve, s")
    parser.add_argument("--time-limit", type=float, default=10.0, help="limit for the compared solvers, s")
    parser.add_argument("--skip-gap", action="store_true", help="only the solve-time table")
    parser.add_argument("--out", help="write the tables here (markdown, or JSON when the name ends .json)")
    args = parser.parse_args(argv)
    exact_s = args.exact_time or (30.0 if args.quick else 300.0)
    solver_s = min(args.time_limit, 2.0) if args.quick else args.time_limit

    print("building problems", file=sys.stderr)
    small = {} if args.skip_gap else {"gpt-tiny (2 layers)": zoo_problem("gpt-tiny"), "stack 3": stack(3)}
    if not args.quick and not args.skip_gap:
        small |= {"stack 4": stack(4), "mlp-tiny": zoo_problem("mlp-tiny"), "resnet-tiny": zoo_problem("resnet-tiny"),
                  "gpt-tiny 3 layers": zoo_problem("gpt-tiny", n_layer=3), "stack 8": stack(8)}
    depths = (4, 12) if args.quick else (4, 12, 24, 48)
    sizes = {f"gpt-tiny {n} layers": zoo_problem("gpt-tiny", n_layer=n) for n in depths}
    sizes |= {f"stack {k}": stack(k) for k in ((16, 64, 256) if args.quick else (16, 64, 256, 700))}
    if not args.quick:
        sizes["gpt-small (6 layers)"] = zoo_problem("gpt-small")

    print("gap to the exact optimum", file=sys.stderr)
    gaps = [] if args.skip_gap else gap_rows(small, exact_s, solver_s)
    print("solve time against size", file=sys.stderr)
    times = time_rows(sizes, args.time_limit, compare=not args.quick)
    note = (f"exact: time-indexed 0-1 program, {exact_s:.0f} s limit per solve ('feasible' = not proven, "
            f"gaps then against its best); compared solvers: {solver_s:.0f} s limit; "
            "gap = extra recompute cost over the exact solver's")
    if args.out and args.out.endswith(".json"):
        text = json.dumps({"gap": gaps, "time": times, "note": note}, indent=2)
    else:
        text = "\n\n".join(["## Gap to the exact optimum", tabulate(gaps, headers="keys", tablefmt="github"),
                            note, "## Solve time against graph size (default solver 'auto', 50% budget)",
                            tabulate(times, headers="keys", tablefmt="github")])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
