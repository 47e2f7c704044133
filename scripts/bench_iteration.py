#!/usr/bin/env python
"""Gradient accumulation under a budget, measured with MemTracker (`fxmem.measure`), 2-core CPU.

accumulation: the transformers GPT-2 of issue 30 (4 layers x 256, vocab 8000, 4 x 256 tokens, cross-entropy
as loss_fn) optimized at 60% of eager's first-micro-batch peak; one warm-up global batch (it plans each
signature), then the first micro-batch (every .grad None) and an accumulating one, measured. Runs on any
fxmem checkout (before this change, both micro-batches share the first one's plan).
fit: `fxmem.fit_batch` on a global batch at three budgets; beside it every micro-batch size, measured
(median time per sample over --repeats global batches, every configuration timed round-robin after
two warm-up global batches that plan it).

examples:
  python scripts/bench_iteration.py accumulation
  python scripts/bench_iteration.py fit --model gpt-tiny --global-batch 16
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem.measure import _StepTracker

MiB = 2**20


def cross_entropy(out, labels):
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def gpt2(layers=4, width=256, vocab=8000, batch=4, seq=256):
    import transformers as t
    torch.manual_seed(0)
    model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                                           n_positions=seq, use_cache=False))
    return model, torch.randint(0, vocab, (batch, seq))


def micro_batch_peak(module, ids):
    """One micro-batch, gradients as they are (None, or resident and accumulated into)."""
    tracker = _StepTracker()
    tracker.track_external(module, ids)
    with tracker:
        module(ids, target=ids).backward()
    return max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())


def accumulation(time_limit):
    from fxmem.trace.step_module import LossStep
    model, ids = gpt2()
    eager = LossStep(copy.deepcopy(model), cross_entropy)
    eager(ids, target=ids).backward()
    eager.zero_grad(set_to_none=True)
    first, later = micro_batch_peak(eager, ids), micro_batch_peak(eager, ids)
    budget = int(0.6 * first)
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, loss_fn=cross_entropy, time_limit_s=time_limit)
    for _ in range(2):  # warm-up global batch: plans the first and the accumulating micro-batch
        optimized(ids, target=ids).backward()
    optimized.zero_grad(set_to_none=True)
    fx_first, fx_later = micro_batch_peak(optimized, ids), micro_batch_peak(optimized, ids)
    rows = [["eager", f"{first / MiB:.1f}", f"{later / MiB:.1f}", "-"],
            ["fxmem", f"{fx_first / MiB:.1f}", f"{fx_later / MiB:.1f}", f"{budget / MiB:.1f}"]]
    print(tabulate(rows, headers=["", "first micro-batch (MiB)", "accumulating micro-batch (MiB)", "budget (MiB)"]))
    print(f"fxmem {fxmem.__file__}; plans: {len(optimized.plans)}")


def build(name, batch):
    if name.startswith("gpt2-hf"):
        model, ids = gpt2(layers=2, width=128, vocab=4000, batch=batch, seq=128)
        return model, (ids,), {"example_target": ids}, cross_entropy
    from fxmem import models
    torch.manual_seed(0)
    return models.from_name(name, dropout=0.0), models.example_inputs(name, batch), {}, None


def global_batch_seconds(module, args, target, micro, steps):
    """Seconds per sample of one global batch: `steps` micro-batches, each loss divided by `steps`."""
    start = time.perf_counter()
    for i in range(steps):
        part = [a[i * micro:(i + 1) * micro] for a in args]
        kw = {} if target is None else {"target": target[i * micro:(i + 1) * micro]}
        module(*part, **kw).div(steps).backward()
    module.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / (micro * steps)


def interleaved(runs, repeats):
    """Median seconds per sample of each run in `runs` ({key: thunk}), timed round-robin (A, B, C, A, B,
    C, ...) so a change of load on a shared machine hits every configuration alike."""
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(run())
    return {key: statistics.median(t) for key, t in times.items()}


def fit(name, global_batch, fractions, time_limit, repeats, calibrate=None):
    model, args, extra, loss_fn = build(name, global_batch)
    target = extra.get("example_target")
    probe = fxmem.plan(model, args, None, loss_fn=loss_fn, **extra)
    rows = []
    for fraction in fractions:
        budget_gb = fraction * probe.baseline_peak_bytes / 2**30
        chosen = fxmem.fit_batch(model, args, budget_gb, loss_fn=loss_fn, time_limit_s=time_limit, quiet=True,
                                 calibrate=calibrate, **extra)
        runs, planned = {}, {}
        for c in chosen.candidates:
            if not c.fits:
                continue
            module = fxmem.optimize(copy.deepcopy(model), budget_gb=budget_gb, loss_fn=loss_fn, time_limit_s=time_limit)
            for _ in range(2):  # plans the first and the accumulating micro-batch
                global_batch_seconds(module, args, target, c.micro_batch, c.steps)
            planned[c.micro_batch] = (module, len(module.plans))
            runs[c.micro_batch] = (lambda m=module, c=c: global_batch_seconds(m, args, target, c.micro_batch, c.steps))
        measured = interleaved(runs, repeats)
        for size, (module, count) in planned.items():
            assert len(module.plans) == count, f"micro-batch {size} planned again while timed"
        best = min(measured, key=measured.get)
        rows.append([name, f"{fraction:.2f} x keep-all ({budget_gb * 1024:.1f} MiB)",
                     f"{chosen.steps} x {chosen.micro_batch}", f"{measured[chosen.micro_batch] * 1e3:.3f}",
                     f"{global_batch // best} x {best}", f"{measured[best] * 1e3:.3f}",
                     f"{100 * (measured[chosen.micro_batch] / measured[best] - 1):+.1f}%",
                     " ".join(f"{m}:{t * 1e3:.2f}" for m, t in sorted(measured.items()))])
        print(chosen.table())
    print(tabulate(rows, headers=["model", "budget", "fit_batch chose", "ms/sample", "best measured", "ms/sample",
                                  "chosen vs best", "every micro-batch (ms/sample)"]))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("accumulation", "fit"))
    p.add_argument("--model", default="gpt-tiny", help="zoo preset, or gpt2-hf (transformers GPT-2, 2 x 128)")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--budgets", default="0.5,0.7,1.0", help="fractions of the keep-all step's peak at the global batch")
    p.add_argument("--time-limit", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=7, help="global batches timed per configuration, round-robin")
    p.add_argument("--no-calibrate", action="store_true",
                   help="fit with the device preset's prices instead of this machine's measured ones")
    args = p.parse_args()
    if args.what == "accumulation":
        accumulation(args.time_limit)
    else:
        fit(args.model, args.global_batch, [float(f) for f in args.budgets.split(",")], args.time_limit, args.repeats,
            False if args.no_calibrate else None)


if __name__ == "__main__":
    main()
