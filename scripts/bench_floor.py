#!/usr/bin/env python
"""Below full checkpointing: the loss computed in chunks (passes/chunked_loss.py) as a planner decision.

For transformers GPT-2 shapes (layers x width x batch x sequence, vocab 50257) with cross-entropy as
`loss_fn`: the least budget fxmem names (`InfeasibleBudgetError`, planned on fake tensors) and its loss
chunk count, the least with the loss as traced (never chunked), against full checkpointing (transformers' `gradient_checkpointing_enable`, non-reentrant)
measured by MemTracker on fake tensors. With `--real`, the shape also runs for real on this machine:
full checkpointing's measured peak, then `fxmem.optimize` at the least budget: its measured peak
(MemTracker), the prediction's error, the chunk count, the largest gradient difference against eager
and the step times (one run each). Prints a markdown table.

examples:
  python scripts/bench_floor.py --shapes 12x768x8x1024
  python scripts/bench_floor.py --shapes 6x384x2x1024 --real
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxmem
from fxmem.eager_meter import eager_peak_bytes
from fxmem.measure import measure_peak_bytes
from fxmem.step_module import LossStep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import full_ac  # noqa: E402

MIB = 2**20


def cross_entropy(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def gpt2(shape: str):
    """A transformers GPT-2 of `shape` (layers x width x batch x sequence), dropout 0, and its token ids."""
    import transformers

    layers, width, batch, seq = map(int, shape.split("x"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=seq,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train(), torch.randint(0, config.vocab_size, (batch, seq))


def least(model, ids, time_limit: float) -> tuple[int, int, float]:
    """(least budget, loss chunks at it, seconds) as fxmem names it, planned on fake tensors."""
    started = time.perf_counter()
    try:
        fxmem.plan(model, (ids,), 1e-6, loss_fn=cross_entropy, example_target=ids, time_limit_s=time_limit)
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes, getattr(exc, "loss_chunks", 1), time.perf_counter() - started
    raise AssertionError("a 1 KiB budget was met")


def least_as_traced(model, ids, time_limit: float) -> int:
    """The least budget with the loss as traced (never chunked), for comparison."""
    from dataclasses import replace

    from fxmem.api import device_spec, make_request
    from fxmem.engine import plan_step

    step = LossStep(model, cross_entropy)
    request = make_request(step, (ids,), {"target": ids}, budget=1024, device=device_spec(None, model=step),
                           solver="auto", time_limit_s=time_limit)
    try:
        plan_step(step, (ids,), {"target": ids}, replace(request, chunk_loss=False))
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes
    raise AssertionError("a 1 KiB budget was met")


def timed_step(module, ids) -> float:
    started = time.perf_counter()
    loss = module(ids, target=ids)
    loss.backward()
    return time.perf_counter() - started


def real_row(model, ids, budget: int, full_ac_step) -> dict:
    """fxmem at `budget` on real tensors: measured peak, prediction, gradients against eager, step times."""
    eager = LossStep(copy.deepcopy(model), cross_entropy)
    for p in eager.parameters():
        p.grad = None
    eager(ids, target=ids).backward()
    want = {name: p.grad for name, p in eager.named_parameters()}
    del eager
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, loss_fn=cross_entropy, time_limit_s=10)
    measured = measure_peak_bytes(optimized, (ids,), {"target": ids}, warmup=True)  # the warm-up plans
    plan = optimized.plan
    for p in model.parameters():
        p.grad = None
    seconds = timed_step(optimized, ids)
    diff = max((p.grad - want[f"fxmem_model.{name}"] if f"fxmem_model.{name}" in want else p.grad - want[name])
               .abs().max().item() for name, p in model.named_parameters())
    for p in full_ac_step.parameters():
        p.grad = None
    ac_seconds = timed_step(full_ac_step, ids)
    return {"measured peak (MiB)": measured / MIB, "predicted (MiB)": plan.predicted_peak_bytes / MIB,
            "prediction error": f"{(plan.predicted_peak_bytes - measured) / measured * 100:+.2f}%",
            "met": measured <= budget, "chunks used": plan.loss_chunks, "max |grad - eager|": f"{diff:.1e}",
            "step s (fxmem)": round(seconds, 2), "step s (full ckpt)": round(ac_seconds, 2)}


def row(shape: str, real: bool, time_limit: float) -> dict:
    model, ids = gpt2(shape)
    ac_step = LossStep(full_ac(model), cross_entropy)
    ac_fake = eager_peak_bytes(ac_step, (ids,), {"target": ids})
    budget, chunks, seconds = least(model, ids, time_limit)
    out = {"shape": shape, "full ckpt, fake MemTracker (MiB)": ac_fake / MIB, "least budget (MiB)": budget / MIB,
           "least / full ckpt": f"{budget / ac_fake:.2f}", "chunks at least": chunks, "planning s": round(seconds, 1),
           "least, loss as traced (MiB)": least_as_traced(model, ids, time_limit) / MIB}
    if real:
        ac_real = measure_peak_bytes(ac_step, (ids,), {"target": ids}, warmup=False)
        out |= {"full ckpt measured (MiB)": ac_real / MIB, "least / measured full ckpt": f"{budget / ac_real:.2f}"}
        out |= real_row(model, ids, budget, ac_step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["6x384x2x1024"])
    parser.add_argument("--real", action="store_true", help="also run the step for real at the least budget")
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args(argv)
    rows = [row(shape, args.real, args.time_limit) for shape in args.shapes]
    rows = [{k: f"{v:,.1f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
