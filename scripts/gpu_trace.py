#!/usr/bin/env python
"""CUDA allocator traces of measured steps -> a small JSON fixture; fxmem's predictions against it.

Reads `torch.cuda.memory._snapshot()` pickles of one measured training step each (recorded from the
warm-up on; the measured step starts after the last `segment_free`, the `empty_cache` before it),
the fidelity logs of the same runs (`plan on cuda f=1.00 ... pred P measured M ...`) and the plans'
JSON; writes, per plan: the measured peaks, the recompute list, and from its trace the traced peak,
the blocks held across steps (BLAS workspaces) and the kernel scratch (blocks allocated and freed
while one graph line runs). Frames `<eval_with_key>.N:LINE` name the graph line; the first graph the
step runs is forward. With --predict FIXTURE, re-plans those plans here on fake tensors (CPU) and
prints fxmem's prediction for the target (allocator model included) against the measured peaks.

examples:
  python scripts/gpu_trace.py --dir /path/to/h100 --out tests/fixtures/h100_gpt_small_b32.json
  python scripts/gpu_trace.py --predict tests/fixtures/h100_gpt_small_b32.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import re
import sys
from collections import Counter
from dataclasses import replace

MIB = 2**20
LINE = re.compile(r"plan on (cuda|cpu)\s+f=([\d.]+) budget\s+([\d.]+) pred\s+([\d.]+) measured\s+([\d.]+)")
BEFORE = re.compile(r"allocated before the measured step ([\d.]+) MiB")
# A run measured this much above another run of the same plan held memory that was not the plan's.
STRAY_FRACTION = 0.01


def _graph_line(event: dict) -> str | None:
    for frame in event.get("frames") or ():
        if frame["filename"].startswith("<eval_with_key>"):
            return f"{frame['filename'][len('<eval_with_key>.'):]}:{frame['line']}"
    return None


def read_trace(path: str) -> dict:
    """What one snapshot shows of its measured step (sizes in bytes)."""
    with open(path, "rb") as f:
        events = pickle.load(f)["device_traces"][0]
    start = max((i for i, e in enumerate(events) if e["action"] == "segment_free"), default=-1) + 1
    live: dict[int, tuple[int, str | None, int]] = {}  # addr -> size, graph line, group
    for e in events[:start]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _graph_line(e), -1)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    held_before = dict(live)
    level = peak = sum(s for s, _, _ in live.values())
    graphs: list[str] = []
    scratch: Counter = Counter()
    group, current = 0, None
    for e in events[start:]:
        where = _graph_line(e)
        if where != current:
            group, current = group + 1, where
        if where is not None and where.split(":")[0] not in graphs:
            graphs.append(where.split(":")[0])
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where, group)
            level += e["size"]
            peak = max(peak, level)
        elif e["action"] == "free_completed" and e["addr"] in live:
            size, line, born = live.pop(e["addr"])
            level -= size
            if born == group and line is not None and size >= MIB:
                scratch[(line, size)] += 1

    def phase(line: str) -> str:
        key = line.split(":")[0]
        return "forward" if graphs and key == graphs[0] else "backward"

    workspaces = [{"graph": phase(line), "line": int(line.split(":")[1]), "bytes": size}
                  for addr, (size, line, _) in held_before.items() if line is not None and addr in live]
    return {"traced_peak_bytes": peak, "held_across_steps": workspaces,
            "scratch": [{"graph": phase(line), "line": int(line.split(":")[1]), "bytes": size, "count": n}
                        for (line, size), n in sorted(scratch.items())]}


def read_logs(paths: list[str]) -> dict[tuple[str, float], list[dict]]:
    runs: dict[tuple[str, float], list[dict]] = {}
    for path in paths:
        before = None
        for line in open(path):
            if (b := BEFORE.search(line)) is not None:
                before = float(b.group(1))
            if (m := LINE.search(line)) is None:
                continue
            where, frac, budget, pred, measured = m.groups()
            run = {"log": os.path.basename(path), "budget_mib": float(budget), "predicted_mib": float(pred),
                   "measured_mib": float(measured)}
            if before is not None:
                run["allocated_before_step_mib"], before = before, None
            runs.setdefault((where, float(frac)), []).append(run)
    for same_plan in runs.values():
        low = min(r["measured_mib"] for r in same_plan)
        for r in same_plan:
            if r["measured_mib"] > low * (1 + STRAY_FRACTION):
                r["excluded"] = (f"{r['measured_mib'] - low:.1f} MiB above another run of the same plan: memory "
                                 "that was not this step's (one more copy of the model's parameters, 41.4 MiB, "
                                 "an earlier model still allocated during the step)")
    return runs


def make_fixture(directory: str, model: str, batch: int) -> dict:
    logs = sorted(glob.glob(os.path.join(directory, "fidelity*.log")))
    plans = []
    for (where, frac), runs in sorted(read_logs(logs).items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        tag = f"{model}-b{batch}-{where}-f{frac}"
        with open(os.path.join(directory, f"{tag}.plan.json")) as f:
            recompute = json.load(f)["recompute"]
        snap = os.path.join(directory, f"{tag}.snapshot.pickle")
        plans.append({"tag": tag, "where": where, "fraction": frac, "runs": runs, "recompute": recompute,
                      "trace": read_trace(snap) if os.path.exists(snap) else None})
    return {"model": model, "batch": batch, "target": "h100", "plans": plans}


def plan_graphs(model, inputs, budget: int | None, device):
    """fxmem's plan of `model` on `inputs` for `device` (fake tensors), and its forward and backward graphs."""
    from fxmem.api import make_request
    from fxmem.trace.capture import capture
    from fxmem.run.engine import CompiledStep, trace_on_fakes
    from fxmem.planner.planner import Planner

    class Recording(Planner):
        def __call__(self, joint, joint_inputs, **kw):
            self.graphs = super().__call__(joint, joint_inputs, **kw)
            return self.graphs

    request = make_request(model, tuple(inputs), {}, budget=budget, device=device, solver="auto",
                           time_limit_s=30.0, calibrate=False)  # generous: the recorded plans came unhurried
    planner = Recording(request)
    trace_on_fakes(CompiledStep(model, capture(model, inputs, {}), planner), model, inputs, {})
    return planner.plan, planner.graphs


def predict(fixture: dict, fractions: list[float] | None = None) -> list[dict]:
    """Re-make the recorded plans (planned then without an allocator model: same budgets, same plans)
    and simulate their graphs with the target's allocator model."""
    import torch
    from fxmem import models
    from fxmem.price.cost import DeviceSpec
    from fxmem.price.memory import AllocatorModel, simulate_step

    target = DeviceSpec.from_name(fixture["target"])
    as_recorded = replace(target, block_bytes=1, blas_workspace_bytes=0, scratch_ops=())
    torch.manual_seed(0)
    model = models.from_name(fixture["model"])
    inputs = models.example_inputs(fixture["model"], fixture["batch"])
    rows = []
    for frac in sorted({p["fraction"] for p in fixture["plans"]}, reverse=True):
        if fractions is not None and frac not in fractions:
            continue
        recorded = [p for p in fixture["plans"] if p["fraction"] == frac]
        budget = round(recorded[0]["runs"][0]["budget_mib"] * MIB)
        plan, (fw, bw) = plan_graphs(model, inputs, budget, as_recorded)
        n_out = len(fw.graph.output_node().args[0]) - len([p for p in bw.graph.find_nodes(op="placeholder")
                                                           if not p.name.startswith("tangents")])
        allocator = AllocatorModel.for_device(target)
        timeline = simulate_step(fw, bw, n_out, allocator)
        runs = [r for p in recorded for r in p["runs"] if not r.get("excluded")]
        rows.append({"fraction": frac, "old_predicted_mib": plan.predicted_peak_bytes / MIB,
                     "predicted_mib": timeline.peak / MIB, "workspace_mib": timeline.workspace / MIB,
                     "measured_mib": sorted(r["measured_mib"] for r in runs),
                     "scratch_bytes": [b for n in bw.graph.nodes if (b := allocator.scratch(n))],
                     "same_plan": all(sorted(plan.recompute) == sorted(p["recompute"]) for p in recorded)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="folder of *.snapshot.pickle, *.plan.json, fidelity*.log")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", help="fixture JSON to write")
    ap.add_argument("--predict", help="fixture JSON: print fxmem's prediction against its measured peaks")
    args = ap.parse_args()
    if args.predict:
        with open(args.predict) as f:
            fixture = json.load(f)
        print("| budget (x eager) | predicted before (MiB) | predicted now (MiB) | measured (MiB) | error "
              "| same plan |")
        print("|---|---|---|---|---|---|")
        for r in predict(fixture):
            errors = [(r["predicted_mib"] - m) / m for m in r["measured_mib"]]
            worst = max(errors, key=abs)
            print(f"| {r['fraction']:.2f} | {r['old_predicted_mib']:.1f} | {r['predicted_mib']:.1f} | "
                  f"{' / '.join(f'{m:.1f}' for m in r['measured_mib'])} | {worst:+.2%} | {r['same_plan']} |")
        return
    if not args.dir or not args.out:
        sys.exit("give --dir and --out (or --predict FIXTURE)")
    fixture = make_fixture(args.dir, args.model, args.batch)
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
    print(f"wrote {args.out}: {len(fixture['plans'])} plans")


if __name__ == "__main__":
    main()
