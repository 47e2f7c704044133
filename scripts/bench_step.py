#!/usr/bin/env python
"""The user's loss in the plan: a transformers GPT-2 trained with cross-entropy outside the model, planned
without and with `loss_fn`, each measured (MemTracker on CPU, max_memory_allocated on CUDA) against
its budget and against PyTorch eager. Prints a markdown table. With --full-ac: fxmem's least
feasible budget for the step (loss included), with the loss as traced and with it in chunks where that
lowers it (`fxmem.planner.loss_chunks`), against full activation checkpointing's measured peak; then fxmem
planned at full-AC's peak: its measured peak, chunk count and extra FLOPs, both methods' gradients
against eager's (the same dropout seed) and their step times, interleaved in one process (medians),
with the machine's load average.

examples:
  python scripts/bench_step.py                      # GPT-2 6 x 512, vocab 50257, batch 4 x 512
  python scripts/bench_step.py --full-ac --layers 12 --width 768 --seq-len 1024 --batch-size 2
  python scripts/bench_step.py --layers 2 --batch-size 1 --seq-len 256 --fractions 0.8 0.5
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxmem
from fxmem.measure import measure_peak_bytes
from fxmem.trace.step_module import LossStep

MIB = 2**20


def cross_entropy(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


class _LossOutside(torch.nn.Module):
    """What a user runs when only the model is optimized: loss_fn(optimized(x), y)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, target):
        return cross_entropy(self.inner(x), target)


def main(argv: list[str] | None = None) -> int:
    import transformers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6], help="budgets as fractions of eager's peak")
    p.add_argument("--full-ac", action="store_true", help="compare with full activation checkpointing instead")
    p.add_argument("--repeats", type=int, default=5, help="with --full-ac: timed steps each, interleaved (default 5)")
    p.add_argument("--no-least", action="store_true", help="with --full-ac: no least budget searches")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropout (default 0.1, as GPT-2's config)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                     vocab_size=50257, n_positions=args.seq_len, use_cache=False,
                                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    model = transformers.GPT2LMHeadModel(config).to(device)
    x = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=device)
    y = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=device)
    if args.full_ac:
        rows = against_full_ac(model, x, y, args.repeats, not args.no_least)
        print(f"\nGPT-2 {args.layers} x {args.width}, vocab 50257, dropout {args.dropout}, batch {args.batch_size} x "
              f"{args.seq_len}, {device}\n")
        print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
        return 0
    eager = measure_peak_bytes(LossStep(copy.deepcopy(model), cross_entropy), (x,), {"target": y})
    rows = [{"method": "eager", "budget MiB": "", "measured MiB": f"{eager / MIB:.1f}", "within budget": ""}]
    for fraction in args.fractions:
        budget = int(fraction * eager)
        started = time.perf_counter()
        for label, build, kwargs in (
                ("model only, loss outside", lambda m: _LossOutside(fxmem.optimize(m, budget_gb=budget / 2**30)),
                 None),
                ("loss_fn", lambda m: fxmem.optimize(m, budget_gb=budget / 2**30, loss_fn=cross_entropy), "target")):
            row = {"method": f"{label}, {fraction:.2f} x eager", "budget MiB": f"{budget / MIB:.1f}"}
            module = build(copy.deepcopy(model))
            try:
                measured = measure_peak_bytes(module, (x,), {"target": y}) if kwargs else measure_peak_bytes(module, (x, y))
            except fxmem.InfeasibleBudgetError as exc:
                rows.append({**row, "measured MiB": f"refused: least {exc.min_budget_bytes / MIB:.1f}", "within budget": ""})
                continue
            plans = module.plans if kwargs else module.inner.plans
            rows.append({**row, "measured MiB": f"{measured / MIB:.1f} (predicted {plans[0].predicted_peak_bytes / MIB:.1f})",
                         "within budget": measured <= budget})
        print(f"{fraction:.2f}: {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\nGPT-2 {args.layers} x {args.width}, vocab 50257, batch {args.batch_size} x {args.seq_len}, {device}\n")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    return 0


def _step_seconds(module, x, y, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        for p in module.parameters():
            p.grad = None
        start = time.perf_counter()
        module(x, target=y).backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _grads(module, x, y, seed: int = 0) -> dict[str, torch.Tensor]:
    """One step's gradients by parameter name (the model's own names), dropout drawn from `seed`."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    module(x, target=y).backward()
    names = {id(p): n.removeprefix("fxmem_model.").removeprefix("model.") for n, p in module.named_parameters()}
    return {names[id(p)]: p.grad for p in module.parameters() if p.grad is not None}


def _largest_difference(got: dict, want: dict) -> str:
    if got.keys() != want.keys():
        return f"gradients of other parameters: {sorted(got.keys() ^ want.keys())[:3]}"
    return f"{max((got[n] - want[n]).abs().max().item() for n in want):.1e}"


def _least(model, x, y, traced: bool) -> tuple[int, int, int]:
    """(least budget, its proven lower bound, loss chunks at it) fxmem names on fake tensors, with the loss
    chunked where that lowers it, or (`traced`) as traced."""
    from dataclasses import replace

    from fxmem.api import device_spec, make_request
    from fxmem.run.engine import plan_step

    step = LossStep(model, cross_entropy)
    request = make_request(step, (x,), {"target": y}, budget=1024, device=device_spec(None, model=step),
                           solver="auto", time_limit_s=10.0)
    try:
        fxmem.plan(model, (x,), budget_gb=1e-6, loss_fn=cross_entropy, example_target=y) if not traced else \
            plan_step(step, (x,), {"target": y}, replace(request, chunk_loss=False))
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes, exc.lower_bound_bytes, getattr(exc, "loss_chunks", 1)
    raise AssertionError("a 1 KiB budget was met")


def against_full_ac(model, x, y, repeats: int = 5, with_least: bool = True) -> list[dict]:
    """fxmem's least budget with and without the loss in chunks, and fxmem planned at full-AC's measured
    peak against full-AC (every block checkpointed): peaks (MemTracker), gradients against eager's (the
    same dropout seed), step times side by side (interleaved A, B, A, B, ...; medians). `with_least`: also the
    least budgets."""
    import statistics

    from baselines import full_ac  # scripts/ is on sys.path when this script runs

    load = os.getloadavg()
    checkpointed = LossStep(full_ac(model), cross_entropy)
    full = measure_peak_bytes(checkpointed, (x,), {"target": y})
    rows = [{"what": "full-AC measured peak", "MiB": f"{full / MIB:.1f}", "x full-AC": "1.00"}]
    for label, traced in (("fxmem least budget, loss as traced", True), ("fxmem least budget, loss in chunks", False)
                          ) if with_least else ():
        least, proven, chunks = _least(model, x, y, traced)
        rows.append({"what": label + (f" ({chunks} chunks)" if chunks > 1 else ""),
                     "MiB": f"{least / MIB:.1f}" + (f" (proven >= {proven / MIB:.1f})" if proven else ""),
                     "x full-AC": f"{least / full:.2f}"})
    planned = fxmem.optimize(copy.deepcopy(model), budget_gb=full / 2**30, loss_fn=cross_entropy)
    try:
        measured = measure_peak_bytes(planned, (x,), {"target": y})  # the warm-up step plans
    except fxmem.InfeasibleBudgetError:
        rows.append({"what": "fxmem at full-AC's peak", "MiB": "refused (least budget above it)"})
        return rows
    plan = planned.plan
    want = _grads(LossStep(copy.deepcopy(model), cross_entropy), x, y)
    grads = {"full-AC": _largest_difference(_grads(checkpointed, x, y), want),
             "fxmem": _largest_difference(_grads(planned, x, y), want)}
    times = {"full-AC": [], "fxmem": []}
    for _ in range(repeats):  # side by side: the machine's load hits both alike
        times["full-AC"] += _step_seconds(checkpointed, x, y, 1)
        times["fxmem"] += _step_seconds(planned, x, y, 1)
    median = {k: statistics.median(v) for k, v in times.items()}
    rows[0] |= {"step s (median)": f"{median['full-AC']:.2f}", "max |grad - eager|": grads["full-AC"]}
    rows.append({"what": f"fxmem at full-AC's peak, measured (loss in {plan.loss_chunks} chunks, "
                         f"{100 * plan.extra_flops / plan.total_flops:.1f}% extra FLOPs)",
                 "MiB": f"{measured / MIB:.1f} (predicted {plan.predicted_peak_bytes / MIB:.1f})",
                 "x full-AC": f"{measured / full:.2f}",
                 "step s (median)": f"{median['fxmem']:.2f} ({1 - median['fxmem'] / median['full-AC']:+.1%} time)",
                 "max |grad - eager|": grads["fxmem"]})
    print(f"{repeats} steps each, interleaved; every step s: full-AC {[round(t, 2) for t in times['full-AC']]}, "
          f"fxmem {[round(t, 2) for t in times['fxmem']]}; load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
