#!/usr/bin/env python
"""Below full checkpointing: the loss (passes/chunked_loss.py) and naive attention
(passes/chunked_attention.py) computed in chunks as planner decisions.

For transformers GPT-2 shapes (layers x width x batch x sequence, vocab 50257) with cross-entropy as
`loss_fn`, or with `--attention` the zoo GPT (models/gpt.py: attention written out, q @ k^T -> scale ->
causal mask -> softmax -> @ v, dropout 0, vocab 256, its own loss): the least budget fxmem names
(`InfeasibleBudgetError`, planned on fake tensors) and its chunk counts, the least with the graph as
traced (never chunked), against full checkpointing (transformers' `gradient_checkpointing_enable`, or
every zoo block checkpointed; non-reentrant) measured by MemTracker on fake tensors. With `--real`, the shape also runs for real on this machine:
full checkpointing's measured peak, then `fxmem.optimize` at the least budget: its measured peak
(MemTracker), the prediction's error, the chunk count, the largest gradient difference against eager
and the step times (one run each); `--device cuda` plans and runs it on the GPU (peaks by
`torch.cuda.max_memory_allocated`). Prints a markdown table.

examples:
  python scripts/bench_floor.py --shapes 12x768x8x1024
  python scripts/bench_floor.py --shapes 6x384x2x1024 --real
  python scripts/bench_floor.py --attention --shapes 4x256x1x2048 --real
  python scripts/bench_floor.py --shapes 12x768x8x1024 --real --device cuda --no-traced
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
from fxmem.trace.eager_meter import eager_peak_bytes
from fxmem.measure import measure_peak_bytes
from fxmem.trace.step_module import LossStep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def zoo_gpt(shape: str):
    """The zoo GPT (naive attention) of `shape` (layers x width x batch x sequence), heads of 64, dropout 0,
    vocab 256, and its token ids."""
    from models.gpt import GPT, GPTConfig

    layers, width, batch, seq = map(int, shape.split("x"))
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width,
                       dropout=0.0)
    return GPT(config).train(), torch.randint(0, config.vocab_size, (batch, seq))


class Case:
    """A model and how its step is called: `loss_fn` cross-entropy (transformers) or its own loss (zoo)."""

    def __init__(self, model, ids, own_loss: bool):
        self.model, self.ids, self.own_loss = model, ids, own_loss
        self.kwargs = {"targets": ids} if own_loss else {"target": ids}

    def step(self, model):
        return model if self.own_loss else LossStep(model, cross_entropy)

    def planned(self) -> dict:
        return {"example_kwargs": self.kwargs} if self.own_loss else {"loss_fn": cross_entropy,
                                                                      "example_target": self.ids}


def least(case: Case, time_limit: float) -> tuple[int, int, int, float]:
    """(least budget, loss chunks and attention chunks at it, seconds) as fxmem names it, on fake tensors."""
    started = time.perf_counter()
    try:
        fxmem.plan(case.model, (case.ids,), 1e-6, time_limit_s=time_limit, **case.planned())
    except fxmem.InfeasibleBudgetError as exc:
        return (exc.min_budget_bytes, getattr(exc, "loss_chunks", 1), getattr(exc, "attention_chunks", 1),
                time.perf_counter() - started)
    raise AssertionError("a 1 KiB budget was met")


def least_as_traced(case: Case, time_limit: float) -> int:
    """The least budget with the graph as traced (loss and attention never chunked), for comparison."""
    from dataclasses import replace

    from fxmem.api import device_spec, make_request
    from fxmem.run.engine import plan_step

    step = case.step(case.model)
    request = make_request(step, (case.ids,), case.kwargs, budget=1024, device=device_spec(None, model=step),
                           solver="auto", time_limit_s=time_limit)
    try:
        plan_step(step, (case.ids,), case.kwargs, replace(request, chunk_loss=False))
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes
    raise AssertionError("a 1 KiB budget was met")


def timed_step(module, case: Case) -> float:
    sync = torch.cuda.synchronize if case.ids.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    module(case.ids, **case.kwargs).backward()
    sync()
    return time.perf_counter() - started


def real_row(case: Case, budget: int, full_ac_step) -> dict:
    """fxmem at `budget` on real tensors: measured peak, prediction, gradients against eager, step times."""
    model, ids = case.model, case.ids
    eager = case.step(copy.deepcopy(model))
    for p in eager.parameters():
        p.grad = None
    eager(ids, **case.kwargs).backward()
    want = {name.removeprefix("fxmem_model."): p.grad for name, p in eager.named_parameters()}
    del eager
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=10,
                               **({} if case.own_loss else {"loss_fn": cross_entropy}))
    measured = measure_peak_bytes(optimized, (ids,), case.kwargs, warmup=True)  # the warm-up plans
    plan = optimized.plan
    for p in model.parameters():
        p.grad = None
    seconds = timed_step(optimized, case)
    diff = max((p.grad - want[name]).abs().max().item() for name, p in model.named_parameters())
    for p in full_ac_step.parameters():
        p.grad = None
    ac_seconds = timed_step(full_ac_step, case)
    return {"measured peak (MiB)": measured / MIB, "predicted (MiB)": plan.predicted_peak_bytes / MIB,
            "prediction error": f"{(plan.predicted_peak_bytes - measured) / measured * 100:+.2f}%",
            "met": measured <= budget, "chunks used (loss, attention)": f"{plan.loss_chunks}, {plan.attention_chunks}",
            "max |grad - eager|": f"{diff:.1e}", "step s (fxmem)": round(seconds, 2),
            "step s (full ckpt)": round(ac_seconds, 2)}


def row(shape: str, real: bool, time_limit: float, attention: bool, device: str = "cpu", traced: bool = True) -> dict:
    model, ids = zoo_gpt(shape) if attention else gpt2(shape)
    case = Case(model.to(device), ids.to(device), own_loss=attention)
    ac_step = case.step(full_ac(case.model))
    ac_fake = eager_peak_bytes(ac_step, (case.ids,), case.kwargs)
    budget, loss_chunks, attention_chunks, seconds = least(case, time_limit)
    out = {"shape": shape, "full ckpt, fake MemTracker (MiB)": ac_fake / MIB, "least budget (MiB)": budget / MIB,
           "least / full ckpt": f"{budget / ac_fake:.2f}", "chunks at least (loss, attention)":
           f"{loss_chunks}, {attention_chunks}", "planning s": round(seconds, 1),
           "least, as traced (MiB)": least_as_traced(case, time_limit) / MIB if traced else "-"}
    print(out, flush=True)
    if real:
        ac_real = measure_peak_bytes(ac_step, (case.ids,), case.kwargs, warmup=False)
        out |= {"full ckpt measured (MiB)": ac_real / MIB, "least / measured full ckpt": f"{budget / ac_real:.2f}"}
        out |= real_row(case, budget, ac_step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["6x384x2x1024"])
    parser.add_argument("--real", action="store_true", help="also run the step for real at the least budget")
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--attention", action="store_true",
                        help="the zoo GPT (naive attention, its own loss, vocab 256) instead of transformers' GPT-2")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model is planned and run")
    parser.add_argument("--no-traced", action="store_true", help="skip the least with the graph as traced")
    args = parser.parse_args(argv)
    rows = [row(shape, args.real, args.time_limit, args.attention, args.device, not args.no_traced)
            for shape in args.shapes]
    rows = [{k: f"{v:,.1f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
