#!/usr/bin/env python
"""fxmem against what users do instead, measured side by side: peak, step time, extra FLOPs.

Methods per model: eager; full-ac (checkpoint every block); sqrt-n (Chen et al. segments);
torch-budget (torch.compile aot_eager under activation_memory_budget, swept); fxmem at budgets
from the eager peak down to the least feasible one, and at the peak each baseline reached. Peaks
come from an independent meter (MemTracker on CPU, torch.cuda.max_memory_allocated on GPU); step
times are medians of interleaved repeats (all methods alike under machine noise); extra FLOPs from
FlopCounterMode over a step (torch-budget: the FLOPs of the graphs it compiled, against its own
save-all graphs). Prints markdown tables and the targets; --out writes them (.md) or the rows
(.json); --plot draws peak vs step time per method (PNG).

examples:
  python scripts/bench.py --quick
  python scripts/bench.py --models gpt-small hf-gpt2 --budgets 0.9 0.5 0.3 --out BENCHMARKS.md
  python scripts/bench.py --compile --models gpt-tiny resnet-tiny
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from tabulate import tabulate
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxmem  # noqa: E402
from baselines import aot_eager_counting, full_ac, hf_gpt2, sqrt_n, torch_budget  # noqa: E402
from fxmem import models  # noqa: E402
from fxmem.backend import plans_for  # noqa: E402
from fxmem.measure import measure_peak_bytes, training_step  # noqa: E402
from fxmem.price.op_pricing import FLOP_FORMULAS  # noqa: E402  (attention kernels torch's counter lacks)

QUICK = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "unet-tiny"]
FULL = ["gpt-small", "hf-gpt2", "resnet18", "unet-small", "mlp-small"]
BATCH = {"mlp-tiny": 1024, "gpt-small": 8, "hf-gpt2": 8, "resnet18": 8, "unet-small": 4, "mlp-small": 4096}
TORCH_FRACTIONS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
QUICK_TORCH_FRACTIONS = (1.0, 0.5, 0.0)
MIB = 2**20


def load(name: str, batch: int | None, device: str) -> tuple[torch.nn.Module, tuple]:
    """A zoo preset or the library model (hf-gpt2), and its example inputs, on `device`."""
    torch.manual_seed(0)
    if name == "hf-gpt2":
        model, inputs = hf_gpt2(batch)
    else:
        model, inputs = models.from_name(name), models.example_inputs(name, batch)
    return model.to(device), tuple(x.to(device) for x in inputs)


def _min_budget(model, inputs, time_limit_s: float) -> int:
    try:
        fxmem.plan(model, inputs, budget_gb=1e-9, time_limit_s=time_limit_s)
    except fxmem.InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("a 1-byte budget was accepted")


def _step(module, inputs):
    for p in module.parameters():
        p.grad = None
    return training_step(module, inputs)


def _step_flops(module, inputs) -> int:
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        _step(module, inputs)
    return counter.get_total_flops()


def _step_seconds(modules: dict, inputs, repeats: int) -> dict[str, float]:
    """Median step time per module, runs interleaved so machine noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(repeats):
        for name, module in modules.items():
            start = time.perf_counter()
            _step(module, inputs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    for module in modules.values():
        for p in module.parameters():
            p.grad = None
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass
class Run:
    method: str
    setting: str
    module: torch.nn.Module | None
    flops: int = 0
    peak: int = 0
    plan: fxmem.Plan | None = None
    plan_s: float = 0.0
    budget: int | None = None
    note: str = ""
    seconds: float = field(default=0.0)

    @property
    def label(self) -> str:
        return f"{self.method} {self.setting}".strip()


def _fxmem_run(model, inputs, budget: int, setting: str, time_limit_s: float, lowest: int) -> Run:
    if budget < lowest:
        return Run("fxmem", setting, None, note=f"below fxmem's least feasible budget {lowest / MIB:.2f} MiB")
    started = time.perf_counter()
    try:
        plan = fxmem.plan(model, inputs, budget_gb=budget / 2**30, time_limit_s=time_limit_s)
    except fxmem.InfeasibleBudgetError as err:  # the least peak found varies with the solver's luck
        return Run("fxmem", setting, None, note=f"infeasible in this solve (least found {err.min_budget_bytes / MIB:.2f} MiB)")
    run = Run("fxmem", setting, fxmem.optimize(model, plan=plan), plan=plan, plan_s=time.perf_counter() - started,
              budget=budget)
    run.peak, run.flops = measure_peak_bytes(run.module, inputs), _step_flops(run.module, inputs)
    return run


def bench_model(name: str, budgets: list[float], batch: int | None, repeats: int, time_limit_s: float,
                device: str, torch_fractions) -> list[dict]:
    """Every method on one model; one row per method and setting."""
    model, inputs = load(name, batch, device)
    eager_plan = fxmem.plan(model, inputs, time_limit_s=time_limit_s)
    lowest = _min_budget(model, inputs, time_limit_s)
    eager = Run("eager", "", model)
    eager.peak, eager.flops = measure_peak_bytes(model, inputs), _step_flops(model, inputs)
    baselines = [eager]
    for method, build in (("full-ac", lambda: full_ac(model)), ("sqrt-n", lambda: sqrt_n(model, inputs))):
        module = build()
        run = Run(method, "", module, note="" if module is not None else "blocks do not chain")
        if module is not None:
            run.peak, run.flops = measure_peak_bytes(module, inputs), _step_flops(module, inputs)
        baselines.append(run)
    save_all_flops = None
    for fraction in sorted(set(torch_fractions) | {1.0}, reverse=True):
        module, graph_flops = torch_budget(model, fraction, inputs, _step)
        save_all_flops = save_all_flops or graph_flops
        run = Run("torch-budget", f"{fraction:.1f}", module, flops=eager.flops + graph_flops - save_all_flops)
        run.peak = measure_peak_bytes(module, inputs)
        baselines.append(run)
    fxmem_runs = [Run("fxmem", "no budget", fxmem.optimize(model, plan=eager_plan), plan=eager_plan)]
    fxmem_runs[0].peak, fxmem_runs[0].flops = measure_peak_bytes(fxmem_runs[0].module, inputs), eager.flops
    top = eager_plan.baseline_peak_bytes
    for fraction in budgets:
        fxmem_runs.append(_fxmem_run(model, inputs, int(lowest + fraction * (top - lowest)),
                                     f"{100 * fraction:.0f}% act.", time_limit_s, lowest))
    for base in baselines[1:]:
        if base.module is not None and base.peak < top:
            fxmem_runs.append(_fxmem_run(model, inputs, base.peak, f"@ {base.label}", time_limit_s, lowest))
    runs = baselines + fxmem_runs
    timed = {r.label: r.module for r in runs if r.module is not None}
    for label, seconds in _step_seconds(timed, inputs, repeats).items():
        next(r for r in runs if r.label == label).seconds = seconds
    floor = sum(eager_plan.breakdown.values())
    rows = []
    for r in runs:
        measured = r.module is not None
        rows.append({
            "model": name, "batch": inputs[0].shape[0], "method": r.method, "setting": r.setting, "note": r.note,
            "peak_mib": r.peak / MIB if measured else None,
            "activation_cut_pct": 100 * (eager.peak - r.peak) / max(eager.peak - floor, 1) if measured else None,
            "time_ratio": r.seconds / eager.seconds if measured else None,
            "extra_flops_pct": 100 * (r.flops - eager.flops) / eager.flops if measured else None,
            "budget_mib": r.budget / MIB if r.budget else None,
            "predicted_mib": r.plan.predicted_peak_bytes / MIB if r.plan else None,
            "prediction_error_pct": 100 * (r.plan.predicted_peak_bytes - r.peak) / r.peak if r.plan else None,
            "within_budget": r.peak <= r.budget if r.budget and measured else None,
            "solver": f"{r.plan.solver_status} gap {r.plan.solver_gap:.2f}" if r.plan else "",
            "plan_s": r.plan_s if r.plan else None})
    return rows


def bench_compile(name: str, fractions: list[float], batch: int | None, repeats: int, time_limit_s: float,
                  device: str) -> list[dict]:
    """fxmem's backend next to PyTorch's activation_memory_budget (knapsack), both on aot_eager, at
    equal measured peak: for each fxmem budget, the torch fraction whose measured peak is the
    largest one not above fxmem's. FLOPs (FlopCounterMode cannot count inside compiled frames):
    fxmem's planned extra FLOPs (the eager path measures exactly these); for PyTorch, the FLOPs of
    the forward and backward graphs it compiled, less those of its 1.0 (save-all) graphs."""
    model, inputs = load(name, batch, device)
    eager_plan = fxmem.plan(model, inputs)
    lowest = _min_budget(model, inputs, time_limit_s)
    torch_runs = []
    for fraction in (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            twin = copy.deepcopy(model)
            graph_flops: list[int] = []
            twin.compile(backend=aot_eager_counting(graph_flops))
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


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def methods_table(rows: list[dict]) -> str:
    return tabulate([[r["model"], r["method"], r["setting"], _fmt(r["peak_mib"], ".2f"),
                      _fmt(r["activation_cut_pct"], ".0f", "%"), _fmt(r["time_ratio"], ".2f"),
                      _fmt(r["extra_flops_pct"], ".1f", "%"), _fmt(r["budget_mib"], ".2f"),
                      _fmt(r["predicted_mib"], ".2f"), _fmt(r["prediction_error_pct"], "+.2f", "%"),
                      _fmt(r["plan_s"], ".1f"), r["note"] or r["solver"]] for r in rows],
                    headers=["model", "method", "setting", "peak MiB", "act. cut", "time ×eager", "extra FLOPs",
                             "budget MiB", "predicted MiB", "pred err", "plan s", "solver / note"], tablefmt="github")


def _find(rows, method, setting=None):
    return next((r for r in rows if r["method"] == method and (setting is None or r["setting"] == setting)
                 and r["peak_mib"] is not None), None)


def targets_table(rows: list[dict]) -> str:
    """The issue's targets per model, read off the measured rows."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        fx = [r for r in mine if r["method"] == "fxmem" and r["peak_mib"] is not None]
        cut = lambda limit: max((r["activation_cut_pct"] for r in fx if r["time_ratio"] <= limit), default=None)  # noqa: E731
        full, at_full = _find(mine, "full-ac"), _find(mine, "fxmem", "@ full-ac")
        speedup = full and at_full and 100 * (full["time_ratio"] / at_full["time_ratio"] - 1)
        wins, total = 0, 0
        for t in (r for r in mine if r["method"] == "torch-budget" and r["setting"] != "1.0"):
            match = _find(mine, "fxmem", f"@ torch-budget {t['setting']}")
            if match:
                total += 1
                wins += (match["extra_flops_pct"] <= t["extra_flops_pct"] + 0.05 and match["time_ratio"] <= t["time_ratio"])
        plain = _find(mine, "fxmem", "no budget")
        out.append([name, _fmt(cut(1.05), ".0f", "%"), _fmt(cut(1.15), ".0f", "%"), _fmt(speedup, "+.0f", "%"),
                    f"{wins}/{total}", _fmt(plain and 100 * (plain["time_ratio"] - 1), "+.1f", "%")])
    return tabulate(out, headers=["model", "act. cut at ≤5% time (≥50%)", "act. cut at ≤15% time (≥70%)",
                                  "faster than full-ac at its peak (≥15%)",
                                  "≤ torch-budget FLOPs and time at its peak", "nothing recomputed (≤2%)"],
                    tablefmt="github")


def plot(rows: list[dict], path: str) -> None:
    """Peak vs step time per method, one panel per model (PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]'")
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for method, style in (("fxmem", "o"), ("torch-budget", "s"), ("full-ac", "^"), ("sqrt-n", "v"), ("eager", "*")):
            pts = sorted((r["peak_mib"], r["time_ratio"]) for r in rows
                         if r["model"] == name and r["method"] == method and r["peak_mib"] is not None)
            if pts:
                ax.plot(*zip(*pts), style, label=method, markersize=7)
        ax.set(title=name, xlabel="measured peak (MiB)", ylabel="step time × eager")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine() -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    meter = "torch.cuda.max_memory_allocated" if device == "cuda" else "MemTracker"
    return f"{device} ({name}), torch {torch.__version__}, meter: {meter}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help=f"zoo presets or hf-gpt2 (default: {' '.join(FULL)}; "
                                                    f"--quick: {' '.join(QUICK)})")
    parser.add_argument("--budgets", "--fractions", dest="budgets", nargs="+", type=float,
                        help="fxmem budgets as fractions of the activation part, i.e. of the way from the least "
                             "feasible budget to the eager peak (default 0.9 0.7 0.5 0.3 0)")
    parser.add_argument("--batch-size", type=int, nargs="+",
                        help="batch size, one for all models or one per model (default: the benchmark's per model)")
    parser.add_argument("--repeats", type=int, help="timed steps per method (default 7; --quick 3)")
    parser.add_argument("--time-limit", type=float, help="solver time limit, seconds (default 10; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="tiny presets, fewer budgets (a few minutes on 2 cores)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile rows: the fxmem backend next to PyTorch's activation_memory_budget")
    parser.add_argument("--out", help="write the tables here (.md) or the rows (.json)")
    parser.add_argument("--plot", help="write peak vs step time per method here (PNG)")
    args = parser.parse_args(argv)
    names = args.models or (QUICK if args.quick else FULL)
    budgets = args.budgets or ([0.7, 0.3, 0.0] if args.quick else [0.9, 0.7, 0.5, 0.3, 0.0])
    repeats = args.repeats or (3 if args.quick else 7)
    time_limit = args.time_limit or (3.0 if args.quick else 10.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = args.batch_size or []
    if len(sizes) not in (0, 1, len(names)):
        parser.error("give one --batch-size, or one per model")
    unknown = [n for n in names if n != "hf-gpt2" and n not in models.list_models()]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(models.list_models())}, hf-gpt2")
    rows = []
    for k, name in enumerate(names):
        batch = (sizes[k] if len(sizes) > 1 else sizes[0]) if sizes else BATCH.get(name)
        print(f"[{k + 1}/{len(names)}] benchmarking {name} on {device} ...", file=sys.stderr, flush=True)
        if args.compile:
            rows += bench_compile(name, budgets, batch, repeats, time_limit, device)
        else:
            rows += bench_model(name, budgets, batch, repeats, time_limit, device,
                                QUICK_TORCH_FRACTIONS if args.quick else TORCH_FRACTIONS)
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.compile:
        text = _compile_table(rows)
    else:
        text = (f"{machine()}\ncommand: `{command}`\n\n" + methods_table(rows) + "\n\nTargets\n\n"
                + targets_table(rows))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(rows, indent=1) if args.out.endswith(".json") else text + "\n")
    if args.plot and not args.compile:
        plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(r.get("within_budget") is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
