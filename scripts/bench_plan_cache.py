"""A plan made once, read back in a second process: the plan call's seconds in a fresh process with an
empty plan cache, then in another process with the same model, inputs and budget (the cache it left).

    python scripts/bench_plan_cache.py [--layers 6 --width 384 --batch 4 --seq 256 --fraction 0.45]

A transformers GPT-2 built from a config (no download), `labels=`, budget = fraction x its keep-all peak.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time, torch, fxmem
from transformers import GPT2Config, GPT2LMHeadModel
a = json.loads(sys.argv[1])
torch.manual_seed(0)
config = GPT2Config(n_layer=a["layers"], n_embd=a["width"], n_head=a["width"] // 64, vocab_size=8192,
                    n_positions=a["seq"], use_cache=False, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
ids = torch.randint(0, 8192, (a["batch"], a["seq"]))
kwargs = {"input_ids": ids, "labels": ids}
keep_all = fxmem.plan(model, (), example_kwargs=kwargs, cache=False).baseline_peak_bytes
start = time.perf_counter()
plan = fxmem.plan(model, (), a["fraction"] * keep_all / 2**30, example_kwargs=kwargs)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": plan.predicted_peak_bytes,
                  "recompute": sorted(plan.recompute)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 6), ("width", 384), ("batch", 4), ("seq", 256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--fraction", type=float, default=0.45)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "FXMEM_CACHE": "1", "FXMEM_CACHE_DIR": folder}
        runs = []
        for label in ("first process (empty cache)", "second process (the first's cache)"):
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(vars(args))], env=env,
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{label}: plan call {runs[-1]['seconds']:.1f} s, predicted peak {runs[-1]['peak'] / 2**20:.2f} MiB")
    first, second = runs
    print(f"second / first: {second['seconds'] / first['seconds']:.2f}; same plan: "
          f"{first['peak'] == second['peak'] and first['recompute'] == second['recompute']}")


if __name__ == "__main__":
    main()
