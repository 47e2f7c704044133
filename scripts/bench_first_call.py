#!/usr/bin/env python
"""The first call a user waits for: compile (or plan) and one training step, from nothing cached, against
`torch.compile`'s knapsack at the same peak.

Each row runs in a fresh process with an empty Inductor cache (`TORCHINDUCTOR_CACHE_DIR`) and fxmem's plan cache
off, on a transformers GPT-2 built from a config (4 layers x 256, vocabulary 8000, `labels=`, dropout 0):
  eager                       the step as PyTorch runs it
  torch.compile, budget F     Inductor with `activation_memory_budget=F` (its knapsack)
  fxmem <inner>               `fxmem.optimize(budget_gb=the knapsack's measured peak, inner=...)`
The first call is timed (wall, and the CPU seconds of the process and the compilers it ran: Inductor compiles in
it, `TORCHINDUCTOR_COMPILE_THREADS=1`, so a loaded machine moves the wall time, hardly the CPU's) with the meter
on (MemTracker and the CPU allocator's events, `fxmem.measure`), the same for every row, so its peak is the first
call's own; the second call is timed without it. Ratios are against the knapsack's first call, in the same run.

examples:
  python scripts/bench_first_call.py
  python scripts/bench_first_call.py --batch 4 --seq 256 --knapsack 0.5 --inners aot_eager inductor
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tabulate import tabulate

MiB = 2**20

CHILD = """
import json, resource, sys, time, torch
import transformers as t
import fxmem
from fxmem.measure import loss_of, measure_peak_bytes
a = json.loads(sys.argv[1])
torch.manual_seed(0)
model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=a["seq"],
                                       use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
ids = torch.randint(0, 8000, (a["batch"], a["seq"]))
kwargs = {"input_ids": ids, "labels": ids}
if a["row"] == "eager":
    module = model
elif a["row"] == "knapsack":
    from torch._inductor.compile_fx import compile_fx
    torch._functorch.config.activation_memory_budget = a["fraction"]
    module = torch.compile(model, backend=lambda gm, inputs: compile_fx(gm, inputs))
else:
    module = fxmem.optimize(model, budget_gb=a["budget"] / 2**30, inner=a["row"])
def cpu():
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
start, cpu_start = time.perf_counter(), cpu()
first_peak = measure_peak_bytes(module, (), kwargs, warmup=False, allocator=True)
first_s, first_cpu = time.perf_counter() - start, cpu() - cpu_start
module.zero_grad(set_to_none=True)
start = time.perf_counter()
loss_of(module(**kwargs)).backward()
second_s = time.perf_counter() - start
peak = measure_peak_bytes(module, (), kwargs, warmup=False, allocator=True)
print(json.dumps({"first_s": first_s, "first_cpu": first_cpu, "first_peak": first_peak, "second_s": second_s, "peak": peak}))
"""


def run(row: str, **fields) -> dict:
    with tempfile.TemporaryDirectory() as inductor_cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache, "FXMEM_CACHE": "0",
               "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # compiled in this process: its CPU seconds count it all
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"row": row, **fields})], env=env,
                              capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{row} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--knapsack", type=float, default=0.5, help="activation_memory_budget (default 0.5)")
    parser.add_argument("--inners", nargs="+", default=["aot_eager", "inductor"], help="fxmem's inner compilers")
    args = parser.parse_args()
    shape = {"batch": args.batch, "seq": args.seq}
    rows = {"eager": run("eager", **shape)}
    knapsack = f"torch.compile, budget {args.knapsack}"
    rows[knapsack] = run("knapsack", fraction=args.knapsack, **shape)
    budget = rows[knapsack]["peak"]
    for inner in args.inners:
        rows[f"fxmem {inner} at the knapsack's peak"] = run(inner, budget=budget, **shape)
    anchor, anchor_cpu = rows[knapsack]["first_s"], rows[knapsack]["first_cpu"]
    print(f"transformers GPT-2 4x256, {args.batch}x{args.seq} tokens; budget {budget / MiB:.2f} MiB "
          f"(the knapsack's measured peak)")
    print(tabulate([[name, f"{r['first_s']:.1f}", f"{r['first_s'] / anchor:.2f}", f"{r['first_cpu']:.1f}",
                     f"{r['first_cpu'] / anchor_cpu:.2f}", f"{r['first_peak'] / MiB:.2f}",
                     f"{r['peak'] / MiB:.2f}", f"{r['second_s']:.2f}"] for name, r in rows.items()],
                   headers=["row", "first call s", "x the knapsack's", "its CPU s", "x the knapsack's",
                            "first call MiB", "second call MiB",
                            "second call s"], tablefmt="github"))


if __name__ == "__main__":
    main()
