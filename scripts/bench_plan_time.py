#!/usr/bin/env python
"""How long `fxmem.plan` takes at real size, on the meta device (nothing runs, no weights), stage by stage:
the plan call's wall seconds and this process's CPU seconds (steadier on a loaded machine: planning is one
Python thread, CP-SAT two workers), plan cache off.

  gpt2-124m: transformers GPT-2 124M shape (12x768, vocab 50257), 8x1024 tokens, cross-entropy `loss_fn`,
             target h100, budget 3 GiB (the loss must be computed in chunks)
  llama-8b:  Llama-3-8B shape (transformers `LlamaConfig`, bf16, sdpa), 1x2048 tokens, the causal LM loss as
             `scripts/bench_meta.py` writes it, target h100, budget 40 GiB

examples:
  python scripts/bench_plan_time.py                     # both
  python scripts/bench_plan_time.py --models gpt2-124m --budget-gb 3 --time-limit 10
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def gpt2_124m():
    import transformers

    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                     use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    loss = lambda out, labels: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # noqa: E731
    return model, ids, loss, 3.0


def llama_8b():
    from bench_meta import build, cross_entropy  # the same model and loss

    args = argparse.Namespace(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                              seq=2048, attention="sdpa")
    return build(args), torch.zeros(1, 2048, dtype=torch.long, device="meta"), cross_entropy, 40.0


MODELS = {"gpt2-124m": gpt2_124m, "llama-8b": llama_8b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--budget-gb", type=float, help="instead of each model's budget above")
    parser.add_argument("--time-limit", type=float, default=10.0, help="the solver's (default 10, fxmem's)")
    args = parser.parse_args()
    import fxmem
    from fxmem import stage_times

    for name in args.models:
        model, ids, loss, budget = MODELS[name]()
        wall, cpu = time.perf_counter(), time.process_time()
        with stage_times.recording() as seconds:
            plan = fxmem.plan(model, (ids,), args.budget_gb or budget, target="h100", loss_fn=loss,
                              example_target=ids, time_limit_s=args.time_limit, cache=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{name}: plan in {wall:.1f} s wall, {cpu:.1f} s CPU; predicted peak "
              f"{plan.predicted_peak_bytes / 2**30:.2f} GiB of {args.budget_gb or budget:g}, loss in "
              f"{plan.loss_chunks} chunks, solver {plan.solver}")
        print(stage_times.table(seconds, wall))


if __name__ == "__main__":
    main()
