"""Plan tables: per module path (or per op) what is kept, recomputed and offloaded, a summary,
and for multi-device plans where each region runs.

Reads a `Plan` (its `nodes` rows and figures); returns text made with tabulate. Writes nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from tabulate import tabulate

from fxmem.errors import fmt_bytes

MIB = 2**20


def _group(rows: Iterable[Any], by: str) -> "OrderedDict[str, list[Any]]":
    groups: OrderedDict[str, list[Any]] = OrderedDict()
    for row in rows:
        key = getattr(row, by) or "(top level)" if by == "module" else getattr(row, by)
        groups.setdefault(key, []).append(row)
    return groups


def _decision(rows: list[Any]) -> str:
    heavy = [r for r in rows if r.bytes > 0]
    recomputed = sum(r.decision == "recompute" for r in heavy)
    offloaded = sum(r.decision == "offload" for r in heavy)
    if offloaded:
        return f"offload {offloaded}/{len(heavy)}" + (f", recompute {recomputed}" if recomputed else "")
    if not heavy or recomputed == 0:
        return "keep"
    if recomputed == len(heavy):
        return "recompute"
    return f"recompute {recomputed}/{len(heavy)}"


def plan_rows(plan: Any, by: str = "module") -> list[list[Any]]:
    rows = []
    for key, group in _group(plan.nodes, by).items():
        kept = sum(r.bytes for r in group if r.decision in ("save", "offload"))
        recomputed = sum(r.bytes for r in group if r.decision == "recompute")
        flops = sum(r.flops for r in group if r.decision == "recompute")
        ops = sorted({r.op for r in group if r.op != "getitem"}) or ["getitem"]
        label = ", ".join(ops[:4]) + (f" +{len(ops) - 4}" if len(ops) > 4 else "")
        rows.append([key, label, round(kept / MIB, 2), round(recomputed / MIB, 2),
                     f"{flops / 1e6:,.1f}", _decision(group)])
    return rows


def summary_rows(plan: Any) -> list[list[str]]:
    rows = [
        ["eager peak (no recompute)", fmt_bytes(plan.baseline_peak_bytes)],
        ["predicted peak", fmt_bytes(plan.predicted_peak_bytes)],
        ["budget", fmt_bytes(plan.budget_bytes)],
    ]
    if plan.min_budget_bytes is not None:
        rows.append(["minimum feasible budget", fmt_bytes(plan.min_budget_bytes)])
    for name, nbytes in plan.breakdown.items():
        rows.append([f"  of which {name}", fmt_bytes(nbytes)])
    step_overhead = (plan.predicted_step_s / plan.baseline_step_s - 1) * 100 if plan.baseline_step_s else 0.0
    rows += [
        ["activation memory removed", f"{plan.activation_reduction_pct:.1f}%"],
        ["extra FLOPs", f"{plan.extra_flops / 1e9:,.3f} GFLOP ({plan.extra_flops_pct:.2f}% of the step)"],
        ["predicted step time", f"{plan.predicted_step_s * 1e3:,.2f} ms on {plan.device} "
                                f"(eager {plan.baseline_step_s * 1e3:,.2f} ms, +{step_overhead:.1f}%)"
                                + (f"; {plan.timing}" if plan.timing else "")],
        ["recomputed values", str(len(plan.recompute))],
    ]
    if plan.offload:
        rows += [["offloaded to host", f"{len(plan.offload)} values, {fmt_bytes(plan.offloaded_bytes)} over "
                                       f"{plan.host_link or 'the host link'}"],
                 ["exposed transfer time", f"{plan.exposed_transfer_s * 1e3:,.3f} ms (copy waits and launches; in the step time)"]]
    if plan.graph_device == "cpu" and plan.device not in ("cpu", ""):
        rows.append(["graph", f"traced on CPU for {plan.device}: where CUDA runs other kernels (attention backends, "
                              "autocast casts) the GPU's graph differs; fxmem.check_plan on the GPU says so"])
    rows += [
        ["solver", f"{plan.solver}: {plan.solver_status}, gap {plan.solver_gap * 100:.2f}%, "
                   f"{plan.solve_time_s:.2f} s"],
    ]
    if plan.pool is not None:
        for graph, stats in (("forward", plan.pool.forward), ("backward", plan.pool.backward)):
            if stats is not None:
                rows.append([f"pooled {graph} arena", f"{fmt_bytes(stats.arena_bytes)} (lower bound "
                             f"{fmt_bytes(stats.lower_bound_bytes)}, no reuse {fmt_bytes(stats.no_reuse_bytes)}), "
                             f"{stats.allocations_avoided} allocations avoided"])
        rows.append(["pooled step peak (simulated)", fmt_bytes(plan.pool.predicted_peak_bytes)])
    return rows


def device_rows(plan: Any) -> list[list[Any]]:
    """Per device of a multi-device plan: its modules, parameters, predicted peak and time."""
    rows = []
    for entry in plan.devices:
        units = entry.modules
        label = (f"{units[0]} .. {units[-1]} ({len(units)})" if len(units) > 2 else ", ".join(units)) or "(none)"
        budget = fmt_bytes(entry.budget_bytes) if entry.budget_bytes is not None else "none"
        rows.append([entry.device, label, fmt_bytes(entry.parameter_bytes), fmt_bytes(entry.peak_bytes),
                     budget, f"{entry.seconds * 1e3:,.2f}"])
    return rows


def format_plan(plan: Any, by: str = "module") -> str:
    if by not in ("module", "op"):
        raise ValueError(f"group plan rows by 'module' or 'op', not {by!r}")
    headers = [by, "ops", "kept MiB", "recomputed MiB", "recompute MFLOP", "decision"]
    body = tabulate(plan_rows(plan, by), headers=headers, tablefmt="simple", floatfmt=".2f")
    summary = tabulate(summary_rows(plan), tablefmt="simple")
    title = f"fxmem plan for {plan.model} {plan.signature}"
    stages = format_stages(plan)
    tail = f"\n\n{stages}" if stages else ""
    if plan.devices:
        placed = tabulate(device_rows(plan), headers=["device", "modules", "parameters", "predicted peak", "budget",
                                                      "step ms"], tablefmt="simple")
        return f"{title}\n\n{body}\n\n{placed}\n\n{summary}" + tail
    return f"{title}\n\n{body}\n\n{summary}" + tail


def _layers(modules: list[str], limit: int = 4) -> str:
    if len(modules) <= limit:
        return ", ".join(modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} units)"


def stage_rows(plan: Any) -> list[list[Any]]:
    stages = plan.pipeline.stages if plan.pipeline else ()
    return [[s.index, _layers(list(s.modules)), fmt_bytes(s.param_bytes),
             ("~" if s.peak_from == "stage model" else "") + fmt_bytes(s.predicted_peak_bytes),
             f"{s.time_s * 1e3:,.3f}", s.in_flight, "recompute" if s.recompute else "keep"] for s in stages]


def format_stages(plan: Any) -> str:
    """Pipeline stages (plans made with num_stages): layers, parameters, peak memory, time; '' otherwise."""
    rows = stage_rows(plan)
    if not rows:
        return ""
    info = plan.pipeline
    headers = ["stage", "layers (module paths)", "parameters", "peak memory", "time ms", "in flight", "activations"]
    body = tabulate(rows, headers=headers, tablefmt="simple")
    return (f"pipeline: {info.num_stages} stages, {info.schedule}, {info.n_microbatches} microbatches; "
            f"slowest stage {info.slowest_s * 1e3:,.3f} ms, lower bound {info.lower_bound_s * 1e3:,.3f} ms, "
            f"balance {info.balance:.3f}\n\n{body}"
            + ("\n\n~ the stage model's estimate (no budget given, so no stage was checked with fxmem's planner)"
               if any(s.peak_from == "stage model" for s in info.stages) else ""))
