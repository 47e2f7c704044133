"""How a plan prices attention and which ops it prices by memory traffic, for small transformers models.

Plans each model at a budget `--fraction` of the way from its floor (parameters, inputs, gradients,
BLAS workspaces) to its eager peak, for `--target`, and prints the plan's extra FLOPs, its attention
rows, the ops priced by memory traffic and the GPU kernels priced for the CPU's:

  python scripts/pricing_survey.py --models hf-llama hf-gpt2 gpt-small --fraction 0.5 --target cpu
"""
from __future__ import annotations

import argparse
import copy

import torch

import fxmem
from fxmem import models

FLOOR = ("parameters, buffers and inputs", "gradients", "BLAS workspaces")


def _transformers(name: str):
    import transformers as t

    ids = torch.randint(0, 256, (4, 128))
    if name == "hf-llama":
        config = t.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               attn_implementation="sdpa")
        return t.LlamaForCausalLM(config), (ids,), {"labels": ids, "use_cache": False}
    config = t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
    return t.GPT2LMHeadModel(config), (ids,), {"labels": ids, "use_cache": False}


def survey(name: str, fraction: float, target: str) -> None:
    torch.manual_seed(0)
    if name in ("hf-llama", "hf-gpt2"):
        model, args, kwargs = _transformers(name)
    else:
        model, args, kwargs = models.from_name(name), models.example_inputs(name, batch_size=1), {}
    eager = fxmem.plan(copy.deepcopy(model), args, example_kwargs=kwargs, target=target, calibrate=False)
    floor = sum(eager.breakdown.get(k, 0) for k in FLOOR)
    budget = floor + fraction * (eager.baseline_peak_bytes - floor)
    plan = fxmem.plan(model, args, budget / 2**30, example_kwargs=kwargs, target=target, calibrate=False)
    attention = [(r.op, r.decision, r.flops) for r in plan.nodes if "attention" in r.op]
    print(f"{name} on {target}: extra FLOPs {plan.extra_flops / 1e6:,.1f} of {plan.total_flops / 1e6:,.1f} MFLOP "
          f"({plan.extra_flops_pct:.2f}%)")
    print(f"  attention rows (op, decision, FLOPs): {attention}")
    print(f"  priced by memory traffic: {list(plan.fallback_ops)}; priced as: {plan.priced_as}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["hf-llama", "hf-gpt2", "gpt-small"],
                        help="hf-llama, hf-gpt2 (small transformers models; GPT-2 with its attention dropout) or fxmem.models presets")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--target", default="cpu")
    args = parser.parse_args(argv)
    for name in args.models:
        survey(name, args.fraction, args.target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
