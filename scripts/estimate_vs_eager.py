"""fxmem.estimate against PyTorch eager's measured peak (MemTracker) on a small transformers GPT-2 with its
loss, fp32 and bf16 autocast: without the loss (as before loss_fn=), with loss_fn=, and with labels=.

    python scripts/estimate_vs_eager.py
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import transformers

import fxmem
from fxmem.measure import measure_peak_bytes
from fxmem.trace.step_module import LossStep


def lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1024, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 1024, (4, 64))
    print(f"{'':6s} {'eager (MemTracker)':>20s} {'no loss':>16s} {'loss_fn=':>16s} {'labels=':>16s}")
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            eager = measure_peak_bytes(LossStep(model, lm_loss), (ids,), {"target": ids})
            eager_labels = measure_peak_bytes(model, (ids,), {"labels": ids})
            bare = fxmem.estimate(model, (ids,)).peak_step
            with_loss = fxmem.estimate(model, (ids,), loss_fn=lm_loss, example_target=ids).peak_step
            labels = fxmem.estimate(model, (ids,), example_kwargs={"labels": ids}).peak_step

        def share(x: int, of: int) -> str:
            return f"{x / 2**20:.2f} MiB {100 * (x / of - 1):+.1f}%"
        print(f"{'bf16' if autocast else 'fp32':6s} {eager / 2**20:>15.2f} MiB {share(bare, eager):>16s} "
              f"{share(with_loss, eager):>16s} {share(labels, eager_labels):>16s}")


if __name__ == "__main__":
    main()
