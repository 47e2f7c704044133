#!/usr/bin/env python
"""The least budget for each way a causal-LM loss is written, on a transformers GPT-2 built on the meta
device and planned for a target (nothing runs; the least is what `InfeasibleBudgetError` names).

Loss forms (`--forms`; all, by default):
  flat         cross_entropy(logits.flatten(0, 1), labels.flatten())               (no shift)
  shift        cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
  shift-float  the same with `.contiguous().float()` on the shifted logits and a `.view(-1, vocab)`
  smooth       shift, ignore_index=0 and label_smoothing=0.1
  sum-count    shift, reduction="sum" divided by the count of labels that are not -100
  zloss        shift plus 1e-4 * logsumexp(shifted logits, -1).pow(2).mean()
  labels       the model's own loss (`labels=`, keep_outputs=False: transformers' ForCausalLMLoss)
  labels-count `labels=` and `num_items_in_batch=` (its reduction="sum" divided by the count)

With `--budget-gb B`, each form is also planned at B GiB: "fits" or the least the refusal names.
Prints a markdown table.

examples:
  python scripts/bench_loss_forms.py --shape 2x128x4x512 --vocab 32000
  python scripts/bench_loss_forms.py --shape 12x768x8x1024 --vocab 50257 --forms flat shift --budget-gb 3
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxmem

MIB = 2**20


def _shift(out, labels):
    return out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()


def _shift_float(out, labels):
    logits = out.logits[:, :-1, :].contiguous().float()
    return logits.view(-1, logits.shape[-1]), labels[:, 1:].contiguous().view(-1)


def _sum_count(out, labels):
    logits, target = _shift(out, labels)
    return F.cross_entropy(logits, target, reduction="sum") / (target != -100).sum()


def _zloss(out, labels):
    logits = out.logits[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
    return ce + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


LOSS_FNS = {
    "flat": lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
    "shift": lambda out, y: F.cross_entropy(*_shift(out, y)),
    "shift-float": lambda out, y: F.cross_entropy(*_shift_float(out, y)),
    "smooth": lambda out, y: F.cross_entropy(*_shift(out, y), ignore_index=0, label_smoothing=0.1),
    "sum-count": _sum_count,
    "zloss": _zloss,
}
FORMS = (*LOSS_FNS, "labels", "labels-count")


def gpt2_on_meta(shape: str, vocab: int, dropout: float | None = None):
    """A transformers GPT-2 of `shape` (layers x width x batch x sequence) on the meta device, and token ids;
    dropout GPT-2's own (0.1) unless given."""
    import transformers

    layers, width, batch, seq = map(int, shape.split("x"))
    rates = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=seq,
                                     vocab_size=vocab, use_cache=False, **rates)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).train()
    return model, torch.randint(0, vocab, (batch, seq), device="meta")


def planned(model, ids, form: str, budget_gb: float, target: str, time_limit: float):
    """(least or None where it fits, loss chunks) for `form` planned at `budget_gb`."""
    if form in LOSS_FNS:
        call = {"loss_fn": LOSS_FNS[form], "example_target": ids}
    else:
        kwargs = {"labels": ids} | ({"num_items_in_batch": torch.tensor(ids.numel())} if form == "labels-count" else {})
        call = {"example_kwargs": kwargs, "keep_outputs": False}
    try:
        plan = fxmem.plan(model, (ids,), budget_gb, target=target, time_limit_s=time_limit, **call)
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes, getattr(exc, "loss_chunks", 1)
    return None, plan.loss_chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2x128x4x512", help="layers x width x batch x sequence")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--target", default="h100")
    parser.add_argument("--budget-gb", type=float, default=None, help="also plan each form at this budget")
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--dropout", type=float, default=None, help="every dropout rate (GPT-2's 0.1 unless given)")
    args = parser.parse_args(argv)
    model, ids = gpt2_on_meta(args.shape, args.vocab, args.dropout)
    rows = []
    for form in args.forms:
        started = time.perf_counter()
        least, chunks = planned(model, ids, form, 1e-6, args.target, args.time_limit)
        row = {"loss": form, "least (MiB)": f"{least / MIB:,.1f}", "loss chunks at least": chunks}
        if args.budget_gb is not None:
            refused, chunks = planned(model, ids, form, args.budget_gb, args.target, args.time_limit)
            row[f"at {args.budget_gb:g} GiB"] = (f"fits ({chunks} chunks)" if refused is None
                                                 else f"refused, least {refused / 2**30:.2f} GiB")
        row["s"] = round(time.perf_counter() - started, 1)
        print(row, flush=True)
        rows.append(row)
    print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
