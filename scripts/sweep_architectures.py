#!/usr/bin/env python
"""Train transformers architectures built from tiny configs (no download) with fxmem.optimize at a
budget below eager's peak; per model: the capture path (one graph by torch.export, or Dynamo's graphs),
the measured peak against the budget (MemTracker), and whether loss and gradients (and which are
None) equal eager's bit for bit. Prints a markdown table.

examples:
  python scripts/sweep_architectures.py
  python scripts/sweep_architectures.py --models gpt2 llama --fraction 0.8
"""
from __future__ import annotations

import argparse
import copy
import traceback

import torch
from tabulate import tabulate

import fxmem
from fxmem.measure import measure_peak_bytes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: tests.conftest
from tests.conftest import step  # noqa: E402

S, B = 32, 4


def _ids(vocab=128):
    return torch.randint(0, vocab, (B, S))


def builders():
    import transformers as t
    small = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128)
    return {
        "gpt2": lambda: (t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, use_cache=False)),
                         (_ids(),), {"labels": _ids()}),
        "bert-mlm": lambda: (t.BertForMaskedLM(t.BertConfig(vocab_size=128, **small)), (_ids(),), {"labels": _ids()}),
        "llama": lambda: (t.LlamaForCausalLM(t.LlamaConfig(vocab_size=128, num_key_value_heads=4, use_cache=False, **small)),
                          (_ids(),), {"labels": _ids()}),
        "mistral-gqa": lambda: (t.MistralForCausalLM(t.MistralConfig(vocab_size=128, num_key_value_heads=2, use_cache=False,
                                                                     **small)), (_ids(),), {"labels": _ids()}),
        "deberta-v2-cls": lambda: (t.DebertaV2ForSequenceClassification(t.DebertaV2Config(vocab_size=128, num_labels=3, **small)),
                                   (_ids(),), {"labels": torch.randint(0, 3, (B,))}),
        "wav2vec2-ctc": lambda: (t.Wav2Vec2ForCTC(t.Wav2Vec2Config(vocab_size=32, layerdrop=0.0, mask_time_prob=0.0,
                                                                   conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                                                   num_feat_extract_layers=2, **small)),
                                 (torch.randn(B, 1600),), {"labels": torch.randint(1, 32, (B, 20))}),
        "vit-cls": lambda: (t.ViTForImageClassification(t.ViTConfig(image_size=32, patch_size=8, num_labels=10, **small)),
                            (torch.randn(B, 3, 32, 32),), {"labels": torch.randint(0, 10, (B,))}),
        "distilbert-cls": lambda: (t.DistilBertForSequenceClassification(t.DistilBertConfig(
            vocab_size=128, n_layers=2, n_heads=4, dim=64, hidden_dim=128, num_labels=3)),
            (_ids(),), {"labels": torch.randint(0, 3, (B,))}),
        "bart": lambda: (t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, use_cache=False)),
            (_ids(),), {"labels": _ids()}),
        "t5": lambda: (t.T5ForConditionalGeneration(t.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2,
                                                               num_heads=4, d_kv=16, use_cache=False,
                                                               decoder_start_token_id=0, pad_token_id=0)),
                       (_ids(),), {"labels": _ids()}),
    }


def run(name, build, fraction):
    torch.manual_seed(0)
    model, args, kwargs = build()
    model.train()
    eager = measure_peak_bytes(copy.deepcopy(model), args, kwargs)
    budget = int(fraction * eager)
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=5)
    out, ref = step(optimized, args, kwargs), step(reference, args, kwargs)
    path = "dynamo" if any(type(s).__name__ == "DynamoStep" for s in optimized._steps.values()) else "export"
    ref_params = dict(reference.named_parameters())
    same_none = all((p.grad is None) == (ref_params[n].grad is None) for n, p in model.named_parameters())
    worst = max((float((p.grad - ref_params[n].grad).abs().max()) for n, p in model.named_parameters()
                 if p.grad is not None and ref_params[n].grad is not None), default=0.0)
    measured = measure_peak_bytes(optimized, args, kwargs)
    predicted = max(p.predicted_peak_bytes for p in optimized.plans)  # each graph's plan: the step while it runs
    return {"model": name, "path": f"{path} ({len(optimized.plans)} graph{'s' * (len(optimized.plans) != 1)})",
            "budget KiB": budget // 1024, "measured KiB": measured // 1024, "within": measured <= budget,
            "prediction error": f"{(predicted - measured) / measured:+.2%}",
            "loss equal": bool(torch.equal(out.loss, ref.loss)), "grads max diff": f"{worst:.1e}",
            "None grads as eager": same_none}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+")
    p.add_argument("--fraction", type=float, default=0.85, help="budget as a fraction of eager's measured peak")
    args = p.parse_args(argv)
    rows = []
    for name, build in builders().items():
        if args.models and name not in args.models:
            continue
        torch._dynamo.reset()
        try:
            rows.append(run(name, build, args.fraction))
        except Exception as exc:  # a row per model, whatever happens
            rows.append({"model": name, "path": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"})
            traceback.print_exc()
        print(rows[-1], flush=True)
    print(tabulate(rows, headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
