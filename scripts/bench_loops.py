#!/usr/bin/env python
"""Training loops as transformers users write them (`labels=`, no `loss_fn`), measured with MemTracker:
eager, the model's own `gradient_checkpointing_enable()`, and fxmem at its least budget and at 1.0x and
1.5x eager's peak. Two loop shapes: "held" (`out = model(...); out.loss.backward()`, the output alive
through backward) and "dropped" (`model(...).loss.backward()`). `keep_outputs=True` returns the logits
detached and counts them held; `keep_outputs=False` returns the loss alone; the default plans them held until
a call is seen dropping them (fxmem.trace.loop), measured at both leasts on every call, the first of each loop
and the one that switches plans included.

examples:
  python scripts/bench_loops.py
  python scripts/bench_loops.py --models mistral --time-limit 5
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch
from tabulate import tabulate

import fxmem
from fxmem.errors import InfeasibleBudgetError
from fxmem.measure import measure_peak_bytes

MiB = 2**20


def build(name):
    import transformers as t
    torch.manual_seed(0)
    if name == "gpt2":  # 6 x 256, vocab 8192, 4 x 256 tokens
        model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                                               use_cache=False))
    else:  # mistral 4 x 128, eager attention
        model = t.MistralForCausalLM(t.MistralConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                                                     use_cache=False, attn_implementation="eager"))
    return model, torch.randint(0, 8192, (4, 256))


def held(m, inputs, kw):
    out = m(*inputs, **kw)
    out.loss.backward()
    return out


def dropped(m, inputs, kw):
    m(*inputs, **kw).loss.backward()


def peaks(module, ids, warmup=True):
    """Held, then dropped (without `warmup`: the largest of two calls of each, the first of each included)."""
    kw = {"labels": ids}
    return [max(measure_peak_bytes(module, (ids,), kw, step=step, warmup=warmup) for _ in range(1 if warmup else 2))
            / MiB for step in (held, dropped)]


def rows_for(name, time_limit):
    model, ids = build(name)
    eager = peaks(copy.deepcopy(model), ids)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    rows = [[name, "eager", "-", *eager, "-"], [name, "model's own checkpointing", "-", *peaks(checkpointed, ids), "-"]]
    leasts = {}
    for keep in (True, False):
        try:
            fxmem.plan(model, (ids,), example_kwargs={"labels": ids}, budget_gb=0.001, time_limit_s=time_limit,
                       keep_outputs=keep)
        except InfeasibleBudgetError as exc:
            leasts[keep] = least = exc.min_budget_bytes
        opt = fxmem.optimize(copy.deepcopy(model), budget_gb=least / 2**30, time_limit_s=time_limit, keep_outputs=keep)
        rows.append([name, f"fxmem least (keep_outputs={keep})", least / MiB, *peaks(opt, ids),
                     opt.plan.predicted_peak_bytes / MiB])
    for keep, least in leasts.items():  # the default learns the loop: every call measured, the switching one too
        opt = fxmem.optimize(copy.deepcopy(model), budget_gb=least / 2**30, time_limit_s=time_limit)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # below the held least: "outputs not returned"
            measured = peaks(opt, ids, warmup=False)
        rows.append([name, f"fxmem default at the {'held' if keep else 'dropped'} least, every call", least / MiB,
                     *measured, max(p.predicted_peak_bytes for p in opt.plans) / MiB])
    for times in (1.0, 1.5):
        budget = times * eager[0] * MiB
        opt = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / 2**30, time_limit_s=time_limit)
        measured = peaks(opt, ids)
        rows.append([name, f"fxmem at {times}x eager" + (" (runs eagerly)" if opt.plan.runs_eagerly else ""),
                     budget / MiB, *measured, opt.plan.predicted_peak_bytes / MiB])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "mistral"], choices=["gpt2", "mistral"])
    p.add_argument("--time-limit", type=float, default=10.0)
    a = p.parse_args(argv)
    rows = [r for name in a.models for r in rows_for(name, a.time_limit)]
    print(tabulate(rows, headers=["model", "method", "budget MiB", "held MiB", "dropped MiB", "predicted MiB"],
                   tablefmt="github", floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
