#!/usr/bin/env python
"""fxmem's plan compiled by Inductor, beside torch.compile's own memory budget (the knapsack), on this machine.

For each model: eager, full activation checkpointing (`--full-ac`), `torch.compile` (Inductor) with no budget and with
`activation_memory_budget` at each --knapsack fraction, then fxmem under a budget of 1 TiB (nothing need be recomputed;
under Inductor, pointwise ops may be, where that is predicted faster, as `torch.compile`'s default does) and at each
knapsack's (and full checkpointing's) measured peak, with `inner="aot_eager"` (eager kernels) and `inner="inductor"`
(where fxmem refuses a budget, at the least it names instead). Peaks are measured by `fxmem.measure` with `allocator=True`: on CPU the larger of MemTracker's
and the CPU allocator's (the profiler's memory events: Inductor's code allocates where MemTracker does
not see), on `--device cuda` `torch.cuda.max_memory_allocated`; fxmem's predicted peak and its error
beside them, and fxmem's predicted step time against the measured one. Step times are medians of --repeats steps timed
round-robin over every configuration, so a change of load hits each alike.

examples:
  python scripts/bench_inductor.py --model gpt-tiny
  python scripts/bench_inductor.py --model gpt2-hf --knapsack 0.5,0.2 --repeats 5
  python scripts/bench_inductor.py --model gpt2-hf --dropout 0.1 --knapsack 0.5 --inners inductor
  python scripts/bench_inductor.py --model llama-hf --knapsack 0.8,0.5,0.2 --inners inductor
  python scripts/bench_inductor.py --model gpt2-hf --knapsack 0.5,0.2 --inners inductor --drop-outputs
  python scripts/bench_inductor.py --model gpt2-124m --batch 8 --seq 1024 --device cuda --full-ac \
      --knapsack 0.5,0.2 --inners inductor
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
from fxmem.measure import loss_of, measure_peak_bytes

MiB = 2**20


def build(name, batch, seq, dropout=0.0):
    if name == "gpt2-124m":  # GPT-2 small's shape, labels= (the loss inside the model), dropout 0
        from bench_floor import gpt2
        model, ids = gpt2(f"12x768x{batch}x{seq}")
        return model, (), {"input_ids": ids, "labels": ids}
    if name == "gpt2-hf":
        import transformers as t
        torch.manual_seed(0)
        model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=256,
                                               use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout,
                                               attn_pdrop=dropout))
        ids = torch.randint(0, 8000, (4, 256))
        return model, (), {"input_ids": ids, "labels": ids}
    if name == "llama-hf":
        import transformers as t
        torch.manual_seed(0)
        model = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256, use_cache=False))
        ids = torch.randint(0, 8000, (4, 256))
        return model, (), {"input_ids": ids, "labels": ids}
    from fxmem import models
    torch.manual_seed(0)
    return models.from_name(name, dropout=dropout), models.example_inputs(name), {}


def own_inductor():
    """Inductor as `torch.compile`'s default runs it, as a backend of its own. Dynamo keeps compiled code on the
    model class's `forward` and reuses it for another copy whose backend compares equal, which every default
    `torch.compile` does: each budget's row ran the first row compiled (llama-hf: 135.14 MiB for
    `torch.compile`'s default, 187.81 MiB compiled alone)."""
    from torch._inductor.compile_fx import compile_fx

    return lambda gm, example_inputs: compile_fx(gm, example_inputs)


def step_seconds(module, args, kwargs):
    module.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    loss_of(module(*args, **kwargs)).backward()
    sync()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny", help="zoo preset, gpt2-hf (transformers GPT-2 4x256, labels=), llama-hf "
                   "(transformers Llama 4x256, grouped-query attention, labels=) "
                   "or gpt2-124m (GPT-2 small's shape at --batch x --seq, labels=)")
    p.add_argument("--batch", type=int, default=8, help="gpt2-124m only")
    p.add_argument("--seq", type=int, default=1024, help="gpt2-124m only")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--full-ac", action="store_true", help="add full activation checkpointing (and fxmem at its peak)")
    p.add_argument("--inners", default="aot_eager,inductor", help="fxmem's inner compilers to run")
    p.add_argument("--knapsack", default="0.5,0.2", help="torch.compile activation_memory_budget fractions (\"\" for none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.0, help="gpt2-hf and zoo presets: dropout everywhere (default 0: "
                   "exact comparisons; transformers' GPT-2 trains with 0.1)")
    p.add_argument("--time-limit", type=float, default=5.0)
    p.add_argument("--drop-outputs", dest="keep_outputs", action="store_false",
                   help="plan fxmem for a loop that drops the model's outputs before backward, as this bench's "
                        "step does (keep_outputs=False: the loss alone is returned, and may be computed in chunks)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="price fxmem's plans by the device preset instead of timing kernels and the memory rate here")
    a = p.parse_args()
    model, args, kwargs = build(a.model, a.batch, a.seq, a.dropout)
    model = model.to(a.device)
    args = tuple(x.to(a.device) for x in args)
    kwargs = {k: v.to(a.device) for k, v in kwargs.items()}
    configs = {"eager": copy.deepcopy(model)}
    if a.full_ac:
        from baselines import full_ac
        configs["full checkpointing"] = full_ac(copy.deepcopy(model))
    torch._dynamo.reset()
    configs["torch.compile"] = torch.compile(copy.deepcopy(model), backend=own_inductor())
    for fraction in [float(f) for f in a.knapsack.split(",") if f]:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            module = torch.compile(copy.deepcopy(model), backend=own_inductor())
            step_seconds(module, args, kwargs)  # compiles under the patched budget
        configs[f"torch.compile budget {fraction}"] = module
    for name, module in list(configs.items()):
        step_seconds(module, args, kwargs)
    peaks = {name: measure_peak_bytes(m, args, kwargs, allocator=True) for name, m in configs.items()}
    print("; ".join(f"{name}: {peak / MiB:.2f} MiB" for name, peak in peaks.items()), flush=True)
    for m in configs.values():
        m.zero_grad(set_to_none=True)
    predicted, predicted_s, refused = {}, {}, {}
    at_peaks = [n for n in configs if n.startswith("torch.compile budget") or n == "full checkpointing"]
    for name in [None] + at_peaks:  # None: a budget nothing needs recomputing for
        for inner in a.inners.split(","):
            label = f"fxmem {inner}, budget 1 TiB" if name is None else f"fxmem {inner} at {name}'s peak"
            module = fxmem.optimize(copy.deepcopy(model), budget_gb=1024 if name is None else peaks[name] / 2**30,
                                    inner=inner, time_limit_s=a.time_limit, calibrate=a.calibrate,
                                    keep_outputs=a.keep_outputs)
            try:
                step_seconds(module, args, kwargs)
            except fxmem.InfeasibleBudgetError as exc:  # planned instead at the least it names
                refused[label] = exc.min_budget_bytes
                label = f"fxmem {inner} at its least, {exc.min_budget_bytes / MiB:.2f} MiB"
                if label in configs:
                    continue
                module = fxmem.optimize(copy.deepcopy(model), budget_gb=exc.min_budget_bytes / 2**30, inner=inner,
                                        time_limit_s=a.time_limit, calibrate=a.calibrate, keep_outputs=a.keep_outputs)
                step_seconds(module, args, kwargs)
            configs[label], predicted[label] = module, module.plan.predicted_peak_bytes
            predicted_s[label] = module.plan.predicted_step_s
            fused = module.plan.timelines.get("inductor")
            if fused is not None:
                print(f"{label}: fused estimate {fused.peak / MiB:.2f} MiB", flush=True)
            peaks[label] = measure_peak_bytes(module, args, kwargs, allocator=True)
            print(f"{label}: measured {peaks[label] / MiB:.2f} MiB, predicted {predicted[label] / MiB:.2f}", flush=True)
            module.zero_grad(set_to_none=True)
    on_cpu = a.device == "cpu"
    times = {name: [] for name in configs}
    for _ in range(a.repeats):
        for name, module in configs.items():
            times[name].append(step_seconds(module, args, kwargs))
    base = statistics.median(times["torch.compile"])
    rows = [[name, f"{peaks[name] / MiB:.2f}",
             f"{predicted[name] / MiB:.2f} ({(predicted[name] - peaks[name]) / peaks[name]:+.1%})"
             if name in predicted else "-",
             f"{statistics.median(times[name]) * 1e3:.1f}", f"{statistics.median(times[name]) / base:.2f}",
             f"{predicted_s[name] * 1e3:.1f} ({predicted_s[name] / statistics.median(times[name]) - 1:+.0%})"
             if name in predicted_s else "-"]
            for name in configs]
    rows += [[name, f"refused: least {least / MiB:.2f}", "-", "-", "-", "-"] for name, least in refused.items()]
    meter = "MemTracker and the CPU allocator" if on_cpu else "max_memory_allocated"
    print(tabulate(rows, headers=["", f"measured peak MiB ({meter})", "predicted MiB (error)",
                                  "step ms (median)", "x torch.compile", "predicted step ms (error)"]))
    where = torch.cuda.get_device_name() if not on_cpu else "cpu"
    print(f"{a.model}; {where}; torch {torch.__version__}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
