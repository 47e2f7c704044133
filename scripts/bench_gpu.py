#!/usr/bin/env python
"""fxmem on a GPU: per budget, predicted peak against the measured one and step time against eager.

Models: zoo presets (`--models gpt-small resnet-small ...`) and `hf-gpt2-124m`, a transformers
GPT-2 of 124M parameters' shape built from its config (no download), at `--batch` x `--seq` tokens.
Budgets are fractions of fxmem's predicted eager peak for this GPU. Each plan is applied to a fresh
copy of the model and measured by `fxmem.measure` (`torch.cuda.max_memory_allocated` of a step
after a warm-up step: the cuBLAS workspaces and everything else the step's kernels allocate count,
as an out-of-memory error counts them). Step time: median of `--repeats` synchronised steps, against
eager's. Prints a markdown table (and writes it with --out); without CUDA it refuses in one line
(exit status 2).

examples:
  python scripts/bench_gpu.py --models gpt-small --batch 32
  python scripts/bench_gpu.py --models hf-gpt2-124m --batch 8 --seq 1024 --autocast bf16 --out gpu.md
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 2**20


def hf_gpt2_124m(batch: int, seq: int):
    """transformers' GPT2LMHeadModel with GPT-2 small's shape (12 layers, width 768, vocab 50257)."""
    import transformers
    from baselines import CausalLMLoss

    config = transformers.GPT2Config(n_positions=max(seq, 1024), use_cache=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"
    ids = torch.randint(config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return CausalLMLoss(lm), (ids, ids.clone())


def load(name: str, batch: int, seq: int):
    if name == "hf-gpt2-124m":
        return hf_gpt2_124m(batch, seq)
    from fxmem import models
    torch.manual_seed(0)
    return models.from_name(name), tuple(models.example_inputs(name, batch))


def step_ms(module, inputs, repeats: int, autocast) -> float:
    from fxmem.measure import training_step
    times = []
    for _ in range(repeats):
        for p in module.parameters():
            p.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast():
            training_step(module, inputs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(name: str, args) -> list[dict]:
    import fxmem
    from fxmem.measure import measure_peak_bytes, training_step

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype else contextlib.nullcontext
    cpu_model, cpu_inputs = load(name, args.batch, args.seq)
    inputs = tuple(x.cuda() for x in cpu_inputs)

    def step(module, xs, kwargs=None):
        with autocast():
            return training_step(module, xs, kwargs)

    eager_model = copy.deepcopy(cpu_model).cuda()
    eager_peak = measure_peak_bytes(eager_model, inputs, step=step)
    eager_ms = step_ms(eager_model, inputs, args.repeats, autocast)
    del eager_model
    with autocast():
        eager_plan = fxmem.plan(copy.deepcopy(cpu_model).cuda(), inputs, time_limit_s=args.time_limit)
    rows = _Rows([{"model": name, "method": "eager", "budget MiB": "-", "predicted MiB": eager_plan.baseline_peak_bytes / MIB,
             "measured MiB": eager_peak / MIB, "over budget": "-", "step ms": eager_ms, "x eager": 1.0}])
    for fraction in args.budgets:
        budget = fraction * eager_plan.baseline_peak_bytes
        model = copy.deepcopy(cpu_model).cuda()
        try:
            with autocast():
                plan = fxmem.plan(model, inputs, budget_gb=budget / 2**30, time_limit_s=args.time_limit)
        except fxmem.InfeasibleBudgetError as error:
            rows.append({"model": name, "method": f"fxmem {fraction:.2f}", "budget MiB": budget / MIB,
                         "predicted MiB": f"infeasible (least {error.min_budget_bytes / MIB:.1f})"})
            continue
        optimized = fxmem.optimize(model, plan=plan)
        peak = measure_peak_bytes(optimized, inputs, step=step)
        ms = step_ms(optimized, inputs, args.repeats, autocast)
        rows.append({"model": name, "method": f"fxmem {fraction:.2f}", "budget MiB": budget / MIB,
                     "predicted MiB": plan.predicted_peak_bytes / MIB, "measured MiB": peak / MIB,
                     "error %": 100 * (plan.predicted_peak_bytes - peak) / peak,
                     "over budget": "yes" if peak > budget else "no", "step ms": ms, "x eager": ms / eager_ms})
        del optimized, model
        torch.cuda.empty_cache()
    return rows


class _Rows(list):
    """The table's rows, each printed as it comes (a run cut off by a time limit keeps what it made)."""

    def __init__(self, rows):
        super().__init__()
        for row in rows:
            self.append(row)

    def append(self, row):
        super().append(row)
        print(table([row]).splitlines()[-1], flush=True)


def table(rows: list[dict]) -> str:
    cols = ["model", "method", "budget MiB", "predicted MiB", "measured MiB", "error %", "over budget", "step ms",
            "x eager"]
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "-")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt-small", "hf-gpt2-124m"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (hf-gpt2-124m)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.45, 0.3])
    parser.add_argument("--autocast", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here (torch.cuda.is_available() is False); run it on a machine "
              "with a GPU", file=sys.stderr)
        return 2
    rows = [r for name in args.models for r in bench(name, args)]
    text = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.autocast}, batch {args.batch}\n\n"
            + table(rows))
    over = sum(r.get("over budget") == "yes" for r in rows)
    text += f"\n\nplans over budget (measured): {over} of {sum('error %' in r for r in rows)}"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
