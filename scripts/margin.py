#!/usr/bin/env python
"""Measure how far fxmem's predicted peak falls below the measured one, the figure the planning margin
(`fxmem.planner.margin`) is made of: per model and budget, plan with fxmem.optimize, measure the step with an
independent meter (MemTracker on CPU, torch.cuda.max_memory_allocated on a GPU) and print
(measured - predicted) / predicted. Positive: fxmem predicted too little (the margin must cover it).
Models: the zoo's tiny presets and transformers architectures from tiny configs, each trained as users
train it (`labels=`); budgets: fractions of eager's measured peak, and the least budget a refusal names.

examples:
  python scripts/margin.py
  python scripts/margin.py --models gpt-tiny gpt2 llama --fractions 0.9 0.5 --device cuda
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from tabulate import tabulate

import fxmem
from fxmem.errors import InfeasibleBudgetError
from fxmem.measure import measure_peak_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_architectures import builders as transformers_builders  # noqa: E402

ZOO = ("gpt-tiny", "mlp-tiny", "resnet-tiny", "unet-tiny")
TRANSFORMERS = ("gpt2", "llama", "mistral-gqa", "bert-mlm", "t5", "deberta-v2-cls", "wav2vec2-ctc")


def zoo_builder(name):
    def build():
        from fxmem import models
        return models.from_name(name), models.example_inputs(name), {}  # the model returns its loss
    return build


def builders():
    hf = transformers_builders()
    return {name: zoo_builder(name) for name in ZOO} | {name: hf[name] for name in TRANSFORMERS}


def one(model, args, kwargs, budget, device):
    opt = fxmem.optimize(copy.deepcopy(model).to(device), budget_gb=budget / 2**30, time_limit_s=5)
    measured = measure_peak_bytes(opt, args, kwargs)  # the outputs held until backward ends, as loops do
    predicted = max(p.predicted_peak_bytes for p in opt.plans)
    return predicted, measured


def run(name, build, fractions, device):
    torch.manual_seed(0)
    model, args, kwargs = build()
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    eager = measure_peak_bytes(copy.deepcopy(model).to(device), args, kwargs)
    rows = []
    for label in [*fractions, "least"]:
        if label == "least":
            try:
                one(model, args, kwargs, int(0.05 * eager), device)
                continue
            except InfeasibleBudgetError as exc:
                budget = exc.min_budget_bytes
        else:
            budget = int(label * eager)
        torch._dynamo.reset()
        try:
            predicted, measured = one(model, args, kwargs, budget, device)
        except InfeasibleBudgetError as exc:
            rows.append({"model": name, "budget": label, "note": str(exc)[:90]})
            continue
        rows.append({"model": name, "budget": label, "budget KiB": budget // 1024, "predicted KiB": predicted // 1024,
                     "measured KiB": measured // 1024, "under-predicted by": (measured - predicted) / predicted,
                     "within budget": measured <= budget})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", help=f"default: {' '.join(ZOO + TRANSFORMERS)}")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.6], help="of eager's measured peak")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    rows = []
    for name, build in builders().items():
        if a.models and name not in a.models:
            continue
        try:
            rows += run(name, build, a.fractions, a.device)
        except Exception as exc:  # a row per model, whatever happens
            rows.append({"model": name, "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"})
        print(rows[-1], file=sys.stderr, flush=True)
    worst = max((r["under-predicted by"] for r in rows if "under-predicted by" in r), default=0.0)
    for r in rows:
        if "under-predicted by" in r:
            r["under-predicted by"] = f"{r['under-predicted by']:+.3%}"
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print(f"\nlargest under-prediction: {worst:+.3%} over {sum('measured KiB' in r for r in rows)} plans "
          f"({torch.__version__}, {a.device})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
