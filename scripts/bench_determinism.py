#!/usr/bin/env python
"""The same plan twice: a transformers GPT-2 planned at a fraction of its keep-all peak in two fresh
processes, the second beside a process that keeps a core busy, compared.

The model is built from a config (layers x width x batch x sequence, vocab 50257, heads of 64, dropout 0;
nothing is downloaded) with cross-entropy as `loss_fn`, and planned on this machine's CPU: first with no
budget (keep-all), then at `--fraction` of that peak with `time_limit_s=--time-limit`. Each process has its
own string hashing (PYTHONHASHSEED 1 and 2). Solver limits are counted work (`fxmem/solve/effort.py`), so the
decisions and predicted peaks must be identical; only the seconds may differ. Prints each plan call's
seconds, the two plans side by side, and whether they are identical.

examples:
  python scripts/bench_determinism.py
  python scripts/bench_determinism.py --shape 4x256x4x256 --fraction 0.5 --time-limit 5
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MIB = 2**20


def _plan_here(shape: str, fraction: float, time_limit: float) -> dict:
    """Plan the model in this process; what the plan decided and how long each plan call took."""
    import torch
    import torch.nn.functional as F
    import transformers

    import fxmem

    layers, width, batch, seq = map(int, shape.split("x"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=seq,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))

    def cross_entropy(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    began = time.perf_counter()
    keep_all = fxmem.plan(model, (ids,), loss_fn=cross_entropy, example_target=ids)
    keep_all_s = time.perf_counter() - began
    budget = fraction * keep_all.predicted_peak_bytes
    began = time.perf_counter()
    plan = fxmem.plan(model, (ids,), budget / 2**30, loss_fn=cross_entropy, example_target=ids,
                      time_limit_s=time_limit)
    plan_s = time.perf_counter() - began
    return {"keep_all_peak": keep_all.predicted_peak_bytes, "keep_all_s": keep_all_s, "budget": budget,
            "plan_s": plan_s, "recompute": list(plan.recompute), "saved": list(plan.saved),
            "predicted_peak": plan.predicted_peak_bytes, "solver": plan.solver, "status": plan.solver_status,
            "chunks": [plan.loss_chunks, plan.attention_chunks]}


def _run(args, seed: int, busy: bool) -> dict:
    """One fresh process planning the model (beside a process spinning on a core when `busy`)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        command = [sys.executable, os.path.abspath(__file__), "--child", path, "--shape", args.shape,
                   "--fraction", str(args.fraction), "--time-limit", str(args.time_limit)]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONHASHSEED": str(seed), "FXMEM_PROGRESS": "0"})
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    with open(path) as f:
        found = json.load(f)
    os.unlink(path)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6x384x4x256", help="layers x width x batch x sequence")
    parser.add_argument("--fraction", type=float, default=0.45, help="budget as a fraction of the keep-all peak")
    parser.add_argument("--time-limit", type=float, default=10.0, help="time_limit_s of the plan at the budget")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with open(args.child, "w") as f:
            json.dump(_plan_here(args.shape, args.fraction, args.time_limit), f)
        return
    runs = [("idle", _run(args, 1, busy=False)), ("a core kept busy", _run(args, 2, busy=True))]
    print(f"transformers GPT-2 {args.shape} (layers x width x batch x sequence), cross-entropy loss_fn, "
          f"budget {args.fraction} x keep-all, time_limit_s={args.time_limit}")
    print("| process | keep-all plan (s) | plan at the budget (s) | budget (MiB) | predicted peak (MiB) "
          "| recomputed | loss, attention chunks | solver | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in runs:
        print(f"| {name} | {r['keep_all_s']:.1f} | {r['plan_s']:.1f} | {r['budget'] / MIB:.1f} "
              f"| {r['predicted_peak'] / MIB:.2f} | {len(r['recompute'])} | {r['chunks'][0]}, {r['chunks'][1]} "
              f"| {r['solver']} | {r['status']} |")
    (_, a), (_, b) = runs
    same_decisions = (a["recompute"], a["saved"], a["chunks"]) == (b["recompute"], b["saved"], b["chunks"])
    same_peaks = a["predicted_peak"] == b["predicted_peak"]
    print(f"identical decisions (recomputed and saved values, loss and attention chunks): "
          f"{'yes' if same_decisions else 'no'}")
    print(f"identical predicted peaks: {'yes' if same_peaks else 'no'} "
          f"({a['predicted_peak']} and {b['predicted_peak']} bytes)")
    if not (same_decisions and same_peaks):
        print("recomputed only in the first:", sorted(set(a["recompute"]) - set(b["recompute"]))[:20])
        print("recomputed only in the second:", sorted(set(b["recompute"]) - set(a["recompute"]))[:20])
        sys.exit(1)


if __name__ == "__main__":
    main()
