"""Plan tables: per module path (or per op) what is kept, recomputed and offloaded, with a totals row
and a legend; a summary; for pipeline plans the stages, for multi-device plans the devices.

Reads a `Plan` (its `nodes` rows, figures and sections); returns text made with tabulate. Writes nothing.
"""
from __future__ import annotations

import textwrap
from collections import OrderedDict
from typing import Any, Iterable

from tabulate import tabulate

from fxmem.errors import fmt_bytes

MIB, KIB = 2**20, 2**10
WIDTH = 110  # legend lines wrap here
TABLE_WIDTH = 120  # tables fit this many columns by default (`Plan.table(width=...)`)
OPS_WIDTH = 40  # the "ops" column's widest text before a table is narrowed to fit
MIN_OPS_WIDTH = 12  # narrower than this, the "ops" column is left out (before any module path is shortened)
MIN_NAME_WIDTH = 16  # module paths (or op names) are shortened in the middle to no fewer characters
NO_BOUND_GAP = 0.9999  # a solver that proved no lower bound reports a gap of 100%


def _group(rows: Iterable[Any], by: str) -> "OrderedDict[str, list[Any]]":
    """Rows per module path, or per op: an output of a multi-output op (a getitem, which the graph places
    right after its op) counts for that op."""
    groups: OrderedDict[str, list[Any]] = OrderedDict()
    producer = "getitem"
    for row in rows:
        if by == "module":
            key = row.module or "(top level)"
        else:
            producer = row.op if row.op != "getitem" else producer
            key = producer
        groups.setdefault(key, []).append(row)
    return groups


def _decision(rows: list[Any]) -> str:
    """keep / recompute / "recompute k of n" over the group's values that hold storage."""
    heavy = [r for r in rows if r.bytes > 0]
    recomputed = sum(r.decision == "recompute" for r in heavy)
    offloaded = sum(r.decision == "offload" for r in heavy)
    if offloaded:
        return f"offload {offloaded} of {len(heavy)}" + (f", recompute {recomputed}" if recomputed else "")
    if not heavy or recomputed == 0:
        return "keep"
    if recomputed == len(heavy):
        return "recompute"
    return f"recompute {recomputed} of {len(heavy)}"


def _units(nbytes: int) -> tuple[str, int]:
    return ("MiB", MIB) if nbytes >= MIB else ("KiB", KIB)


def _flop_unit(flops: float) -> tuple[str, float]:
    return ("GFLOP", 1e9) if flops >= 1e10 else ("MFLOP", 1e6)


def _totals(group: list[Any]) -> tuple[int, int, int]:
    kept = sum(r.bytes for r in group if r.decision in ("save", "offload"))
    recomputed = sum(r.bytes for r in group if r.decision == "recompute")
    return kept, recomputed, sum(r.flops for r in group if r.decision == "recompute")


def op_names(ops: list[str], limit: int = OPS_WIDTH) -> str:
    """The ops, overloads left out (`add.Tensor` -> `add`), as many as fit in `limit` characters, then `+k`;
    where even one does not fit, its end is cut (`_scaled_dot.. +14`)."""
    names = sorted({op.split(".")[0] for op in ops})
    for shown in range(len(names), 0, -1):
        more = f" +{len(names) - shown}" if shown < len(names) else ""
        text = ", ".join(names[:shown]) + more
        if len(text) <= limit:
            return text
        if shown == 1:
            return names[0][:max(4, limit - len(more) - 2)] + ".." + more
    return ""


def shortened(text: str, limit: int) -> str:
    """`text`, its middle replaced by '..' when longer than `limit` (a module path keeps both ends)."""
    if len(text) <= limit or limit < 8:
        return text
    head = (limit - 2) // 2
    return f"{text[:head]}..{text[len(text) - (limit - 2 - head):]}"


def plan_rows(plan: Any, by: str = "module", all_rows: bool = False, ops_width: int | None = OPS_WIDTH
              ) -> tuple[list[list[Any]], list[str], int]:
    """(rows with a totals row last, headers, groups not shown). Without `all_rows` only the groups that
    keep or recompute bytes are listed. Grouped by module, a row also names the module's ops (as many as
    fit in `ops_width` characters; None: no ops column)."""
    groups = _group(plan.nodes, by)
    kept_all, rec_all, flops_all = _totals(list(plan.nodes))
    unit, scale = _units(max(kept_all, rec_all))
    funit, fscale = _flop_unit(flops_all)

    def row(label: str, ops: str, kept: int, recomputed: int, flops: int, decision: str) -> list[Any]:
        return [label] + ([ops] if by == "module" and ops_width else []) + [kept / scale, recomputed / scale,
                                                              f"{flops / fscale:,.2f}", decision]

    rows, hidden = [], 0
    for key, group in groups.items():
        kept, recomputed, flops = _totals(group)
        if not all_rows and kept == 0 and recomputed == 0:
            hidden += 1
            continue
        label = op_names([r.op for r in group if r.op != "getitem"] or ["getitem"], ops_width or OPS_WIDTH)
        rows.append(row(key, label, kept, recomputed, flops, _decision(group)))
    values = [r for r in plan.nodes if r.bytes > 0]
    n_rec = sum(r.decision == "recompute" for r in values)
    rows.append(row(f"total ({len(groups)} {by}s)", "", kept_all, rec_all, flops_all,
                    f"recompute {n_rec} of {len(values)}" if n_rec else "keep"))
    headers = row(by, "ops", 0, 0, 0, "decision")
    headers[-4:-1] = [f"kept ({unit})", f"recomputed ({unit})", f"recompute cost ({funit})"]
    return rows, headers, hidden


def _solver_text(plan: Any) -> str:
    if plan.solver in ("none", "policy"):
        return "not run: the policy decides" if plan.solver == "policy" else "not run: the eager step fits the budget"
    took = f"{plan.solve_time_s:.2f} s"
    if plan.solver_status == "optimal":
        return f"{plan.solver}: optimal (proven), {took}"
    if plan.solver_gap >= NO_BOUND_GAP:
        return f"{plan.solver}: {plan.solver_status}, not proven optimal (no lower bound, gap unknown), {took}"
    return (f"{plan.solver}: {plan.solver_status}, gap {plan.solver_gap * 100:.2f}% (the plan's recompute cost is at "
            f"most that share above the least possible), {took}")


def _step_rows(plan: Any) -> list[list[str]]:
    """Peak, budget, what every plan holds, and the cost of the plan."""
    rows = [["captured as", plan.capture]] if plan.capture else []
    rows += [["loss", plan.loss]] if plan.loss else []
    rows += [["policy", plan.policy]] if plan.policy else []
    if getattr(plan, "loss_chunks", 1) > 1:
        rows.append(["loss chunks", f"{plan.loss_chunks} (logits made, reduced and freed per chunk of "
                                    f"{plan.loss_chunk_tokens} tokens; backward makes them again: the lm head's "
                                    "matmul, in the extra FLOPs)"])
    if getattr(plan, "attention_chunks", 1) > 1:
        rows.append(["attention chunks", f"{plan.attention_chunks} (scores made, softmaxed and freed per chunk of "
                                         f"{plan.attention_chunk_rows}; backward makes them again: the q @ k^T "
                                         "matmul, in the extra FLOPs; attention with dropout p>0 is left as traced)"])
    rows += [["numerics", plan.numerics]] if getattr(plan, "numerics", "") else []
    rows.append(["gradients", f"resident ({plan.resident_gradients}): {fmt_bytes(plan.resident_gradient_bytes)} from "
                 "the start, new ones added in by backward" if plan.resident_gradient_bytes else
                 "none at the start (every .grad None, as after zero_grad())"])
    if plan.eager_peak_bytes:  # what the user runs today: the figure to compare the budget and peak with
        rows.append(["PyTorch eager's peak", f"{fmt_bytes(plan.eager_peak_bytes)} (MemTracker on fake tensors)"])
    keep_all = "fxmem's step with nothing recomputed; 'activation memory removed' counts from it"
    if plan.eager_peak_bytes and plan.eager_peak_bytes < plan.baseline_peak_bytes:
        keep_all += "; above PyTorch eager's, so a budget here recomputes to meet it"
    rows.append(["keep-all peak", f"{fmt_bytes(plan.baseline_peak_bytes)} ({keep_all})"])
    if plan.runs_eagerly:
        rows.append(["runs", f"eagerly: PyTorch's step peaks at {fmt_bytes(plan.predicted_peak_bytes)} (MemTracker on "
                             f"fake tensors), below fxmem's keep-all step ({fmt_bytes(plan.baseline_peak_bytes)}), "
                             "and the budget covers it"])
    rows.append(["predicted peak", fmt_bytes(plan.predicted_peak_bytes)])
    rows += [[f"  of which {name}", fmt_bytes(nbytes)] for name, nbytes in plan.breakdown.items()]
    rows.append(["budget", fmt_bytes(plan.budget_bytes)])
    if plan.min_budget_bytes is not None:
        rows.append(["least feasible budget found", fmt_bytes(plan.min_budget_bytes)])
    step_overhead = (plan.predicted_step_s / plan.baseline_step_s - 1) * 100 if plan.baseline_step_s else 0.0
    values = [r for r in plan.nodes if r.bytes > 0]
    recomputed = sum(r.decision == "recompute" for r in values)
    rows += [
        ["activation memory removed", f"{plan.activation_reduction_pct:.1f}% (of the keep-all peak above parameters, "
                                      "inputs and gradients)"],
        ["recomputed values", f"{recomputed} of the {len(values)} values backward needs "
                              f"({len(plan.recompute)} ops run again)"],
        ["extra FLOPs", f"{plan.extra_flops / 1e9:,.3f} GFLOP ({plan.extra_flops_pct:.2f}% of the step)"],
        ["predicted step time", f"{plan.predicted_step_s * 1e3:,.2f} ms on {plan.device} "
                                f"(eager {plan.baseline_step_s * 1e3:,.2f} ms, +{step_overhead:.1f}%)"
                                + (f"; {plan.timing}" if plan.timing else "")],
    ]
    if plan.offload:
        rows += [["offloaded to host", f"{len(plan.offload)} values, {fmt_bytes(plan.offloaded_bytes)} over "
                                       f"{plan.host_link or 'the host link'}"],
                 ["exposed transfer time", f"{plan.exposed_transfer_s * 1e3:,.3f} ms (copy waits and launches; "
                                           "in the step time)"]]
    rows += _host_rows(plan)
    if plan.fallback_ops:
        rows.append(["priced by memory traffic", f"{', '.join(plan.fallback_ops)} (no FLOP formula: timed by the "
                                                 "bytes they move, their FLOPs not counted)"])
    if plan.graph_device == "cpu" and plan.device not in ("cpu", ""):
        kernels = "; ".join(f"{op} priced as {kernel}" for op, kernel in sorted(plan.priced_as.items()))
        rows.append(["graph", f"traced on CPU for {plan.device}: where CUDA runs other kernels (attention backends, "
                              "autocast casts) the GPU's graph differs; fxmem.check_plan on the GPU says so"
                              + (f"; {kernels}" if kernels else "")])
    rows.append(["solver", _solver_text(plan)])
    if plan.pool is not None:
        for graph, stats in (("forward", plan.pool.forward), ("backward", plan.pool.backward)):
            if stats is not None:
                rows.append([f"pooled {graph} arena", f"{fmt_bytes(stats.arena_bytes)} (lower bound "
                             f"{fmt_bytes(stats.lower_bound_bytes)}, no reuse {fmt_bytes(stats.no_reuse_bytes)}), "
                             f"{stats.allocations_avoided} allocations avoided"])
        rows.append(["pooled step peak (simulated)", fmt_bytes(plan.pool.predicted_peak_bytes)])
    return rows


def _host_rows(plan: Any) -> list[list[str]]:
    """Where the optimizer's state lives (device / host) and what each place costs (fxmem.planner.host_state)."""
    if not plan.host_options:
        return []
    grads = (f"their gradients moved to the host inside backward ({fmt_bytes(plan.host_gradient_bytes)}, freed on the "
             "device)" if plan.host_gradients else "their gradients copied out after backward")
    rows = [["optimizer state", f"{fmt_bytes(plan.optimizer_state_bytes)} on the device, {fmt_bytes(plan.host_state_bytes)}"
                                f" on the host ({len(plan.host_parameters)} parameters' state; {grads}, updated on the host CPU)"]]
    if plan.host_parameters:
        rows.append(["host state's cost", f"update on the host CPU {plan.host_update_s * 1e3:,.1f} ms, copies "
                                          f"{plan.host_copy_s * 1e3:,.1f} ms over {plan.host_link or 'the host link'} "
                                          "(in the step time: the update, the values' copy back, the gradients' copies "
                                          "beyond backward)"])
    for row in plan.host_options:
        least = "least" if row.get("least") == "found" else "its state, parameters and gradients alone need"
        figure = f"refused ({least} {fmt_bytes(row['least_bytes'])})" if row["step_s"] is None else \
            f"peak {fmt_bytes(row['peak_bytes'])}, step {row['step_s'] * 1e3:,.2f} ms"
        rows.append([f"  {'* ' if row['chosen'] else ''}{row['mix']}", f"state on the device {fmt_bytes(row['device_state_bytes'])}"
                     f"{', gradients on the host' if row.get('host_gradient_bytes') else ''}: {figure}"])
    return rows


def summary_rows(plan: Any) -> list[list[str]]:
    """The summary under the table: the step's figures, or the stages' or devices' for those plans."""
    if plan.pipeline:
        return _pipeline_rows(plan)
    if plan.devices:
        return _placement_rows(plan)
    return _step_rows(plan)


def _legend(plan: Any, by: str, width: int = WIDTH, ops_left_out: bool = False) -> str:
    """What the table's columns mean (the solver's gap is said where it is shown: the summary's solver row)."""
    lines = [f"kept: bytes saved for backward, per {by}; recomputed: bytes backward recomputes instead of keeping "
             "them; recompute cost: the forward work done again",
             "recompute k of n: k of the n values backward needs from this "
             f"{by} are recomputed, the others kept (views cost nothing and are not counted)"]
    if ops_left_out:
        lines.append("the ops column is left out to keep the module paths whole within the width "
                     "(table(width=...) widens it; --by op groups by op)")
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ") for line in lines)


def short_signature(signature: str, limit: int = 6) -> str:
    """`(a, b, c, ... 30 inputs) eval` for an input signature of more than `limit` inputs."""
    inner, _, rest = signature[1:].partition(")") if signature.startswith("(") else (signature, "", "")
    parts = inner.split(", ") if inner else []
    if len(parts) <= limit:
        return signature
    return f"({', '.join(parts[:3])}, ... {len(parts)} inputs){rest}"


def format_plan(plan: Any, by: str = "module", all_rows: bool = False, width: int = TABLE_WIDTH) -> str:
    """The plan's table, legend and summary, in lines of at most `width` characters (long op lists and module
    paths abbreviated, long summary values wrapped)."""
    if by not in ("module", "op"):
        raise ValueError(f"group plan rows by 'module' or 'op', not {by!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 60:
        raise ValueError(f"width must be a number of columns of at least 60, got {width!r}")
    title = textwrap.fill(f"fxmem plan for {plan.model} {short_signature(plan.signature)}", width,
                          subsequent_indent="  ")
    sections = [title]
    if plan.pipeline:
        sections.append(format_stages(plan))
    elif plan.devices:
        sections.append(format_devices(plan))
    if all_rows or not (plan.pipeline or plan.devices):
        body, hidden, ops_left_out = _plan_table(plan, by, all_rows, width)
        note = (f"\n({hidden} {by}s that keep and recompute nothing are not shown; --all or "
                "table(all_rows=True) lists them)") if hidden else ""
        sections.append(body + note + "\n" + _legend(plan, by, min(WIDTH, width), ops_left_out))
    sections.append(two_columns(summary_rows(plan), width))
    return "\n\n".join(sections)


def _plan_table(plan: Any, by: str, all_rows: bool, width: int) -> tuple[str, int, bool]:
    """The rows' table within `width` columns where it can be, cutting what matters least first: the ops
    column narrowed (down to MIN_OPS_WIDTH), then left out, and only then the first column's names (module
    paths) shortened in the middle; the totals row's label stays whole. Returns (text, groups not shown,
    whether the ops column was left out)."""
    ops_width: int | None = OPS_WIDTH if by == "module" else None
    name_width = None
    while True:
        rows, headers, hidden = plan_rows(plan, by, all_rows, ops_width)
        if name_width is not None:
            rows = [[shortened(str(r[0]), name_width)] + r[1:] for r in rows[:-1]] + rows[-1:]
        body = tabulate(rows, headers=[h.replace(" (", "\n(") for h in headers], tablefmt="simple", floatfmt=",.2f")
        excess = max(len(line) for line in body.splitlines()) - width
        if excess > 0 and ops_width is not None:
            ops_width = None if ops_width <= MIN_OPS_WIDTH else max(MIN_OPS_WIDTH, ops_width - excess)
        elif excess > 0 and (name_width is None or name_width > MIN_NAME_WIDTH):
            longest = max(len(str(r[0])) for r in rows[:-1]) if len(rows) > 1 else MIN_NAME_WIDTH
            name_width = max(MIN_NAME_WIDTH, (name_width or longest) - excess)
        else:
            break
    lines = body.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "})
    lines.insert(len(lines) - 1, lines[rule])  # a rule above the totals row
    return "\n".join(lines), hidden, by == "module" and ops_width is None


def two_columns(rows: list[list[str]], width: int = TABLE_WIDTH) -> str:
    """A (label, value) table whose values wrap so that every line fits in `width` columns."""
    if not rows:
        return ""
    label_width = max(len(str(r[0])) for r in rows)
    return tabulate(rows, tablefmt="simple", maxcolwidths=[None, max(20, width - label_width - 2)])


# ---- pipeline stages and devices -------------------------------------------------------------
def _layers(modules: list[str], limit: int = 4) -> str:
    if len(modules) <= limit:
        return ", ".join(modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} units)"


def _stage_recompute(stage: Any) -> tuple[int, int]:
    """(values recomputed, extra FLOPs) of a stage's own recompute plan."""
    if not stage.plan:
        return 0, 0
    return len(stage.plan.get("recompute", ())), int(stage.plan.get("extra_flops", 0))


def stage_rows(plan: Any) -> list[list[Any]]:
    stages = plan.pipeline.stages if plan.pipeline else ()
    rows = []
    for s in stages:
        count, _ = _stage_recompute(s)
        rows.append([s.index, _layers(list(s.modules)), fmt_bytes(s.param_bytes),
                     ("~" if s.peak_from == "stage model" else "") + fmt_bytes(s.predicted_peak_bytes),
                     f"{s.time_s * 1e3:,.3f}", s.in_flight,
                     f"recompute {count} values" if s.recompute else "keep all"])
    return rows


def format_stages(plan: Any) -> str:
    """Pipeline stages (plans made with num_stages): units, parameters, peak memory, time; '' otherwise."""
    rows = stage_rows(plan)
    if not rows:
        return ""
    info = plan.pipeline
    headers = ["stage", "units (module paths)", "parameters", "peak memory", "time (ms)", "microbatches in flight",
               "activations"]
    body = tabulate(rows, headers=headers, tablefmt="simple")
    notes = [f"pipeline: {info.num_stages} stages, {info.schedule}, {info.n_microbatches} microbatches "
             "(example inputs = one microbatch)",
             "units: top-level modules and the items of a top-level ModuleList/Sequential; '(top-level ops: ...)' "
             "is a run of operations in the model's own forward",
             "peak memory: one stage's step plus what its other microbatches in flight keep, plus optimizer state"]
    if any(s.peak_from == "stage model" for s in info.stages):
        notes.append("~ the stage model's estimate (no budget given, so no stage was checked with fxmem's planner)")
    return f"{body}\n" + "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ") for line in notes)


def _pipeline_rows(plan: Any) -> list[list[str]]:
    info = plan.pipeline
    largest = max(info.stages, key=lambda s: s.predicted_peak_bytes)
    recomputing = [s for s in info.stages if s.recompute]
    counts = [_stage_recompute(s) for s in recomputing]
    rows = [["budget per stage", fmt_bytes(info.budget_bytes) if info.budget_bytes is not None else "none"],
            ["largest stage peak", f"{fmt_bytes(largest.predicted_peak_bytes)} (stage {largest.index})"],
            ["whole model on one device", f"{fmt_bytes(plan.baseline_peak_bytes)} (eager, one microbatch)"],
            ["recomputed values", (", ".join(f"{n} in stage {s.index}" for s, (n, _) in zip(recomputing, counts))
                                   + f" ({sum(f for _, f in counts) / 1e9:,.3f} GFLOP extra per microbatch)")
             if recomputing else "none: every stage fits keeping its activations"],
            ["slowest stage", f"{info.slowest_s * 1e3:,.3f} ms (lower bound {info.lower_bound_s * 1e3:,.3f} ms, "
                              f"balance {info.balance:.3f})"]]
    return rows


def device_rows(plan: Any) -> list[list[Any]]:
    """Per device of a multi-device plan: its modules, parameters, memory and time."""
    rows = []
    for entry in plan.devices:
        units = entry.modules
        label = (f"{units[0]} .. {units[-1]} ({len(units)})" if len(units) > 2 else ", ".join(units)) or "(none)"
        budget = fmt_bytes(entry.budget_bytes) if entry.budget_bytes is not None else "none"
        rows.append([entry.device, label, fmt_bytes(entry.parameter_bytes), fmt_bytes(entry.peak_bytes),
                     budget, f"{entry.seconds * 1e3:,.2f}"])
    return rows


def format_devices(plan: Any) -> str:
    body = tabulate(device_rows(plan), headers=["device", "modules", "parameters", "predicted peak", "budget",
                                                "step (ms)"], tablefmt="simple")
    return (f"{body}\npredicted peak: the device's parameters, their gradients and the activations its modules "
            "save for backward")


def _placement_rows(plan: Any) -> list[list[str]]:
    largest = max(plan.devices, key=lambda e: e.peak_bytes)
    budgets = {e.budget_bytes for e in plan.devices}
    budget = fmt_bytes(budgets.pop()) if len(budgets) == 1 and None not in budgets else \
        ", ".join(fmt_bytes(e.budget_bytes) if e.budget_bytes is not None else "none" for e in plan.devices)
    return [["budget per device", budget],
            ["largest device peak", f"{fmt_bytes(largest.peak_bytes)} ({largest.device})"],
            ["whole model on one device", f"{fmt_bytes(plan.baseline_peak_bytes)} (eager)"],
            ["slowest device", f"{max(e.seconds for e in plan.devices) * 1e3:,.2f} ms; the devices run one after "
                               f"another: {sum(e.seconds for e in plan.devices) * 1e3:,.2f} ms per step"]]
