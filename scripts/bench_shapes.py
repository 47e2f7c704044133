"""New sequence lengths in one run of `fxmem.optimize`: each length's first call (plan, compile and step)
timed and measured, against the first length's.

    python scripts/bench_shapes.py [--layers 4 --width 256 --batch 8 --seqs 256 224 192 160 128 --fraction 0.7]

A transformers GPT-2 built from a config (no download), `labels=`, trained with `model(**batch).loss.backward()`
on the CPU; budget = fraction x eager's peak at the first length (MemTracker, on a step run beforehand).
Every call's peak is measured by MemTracker (`torch.distributed._tools.mem_tracker`), never predicted; each
call's seconds split by stage (`fxmem.stage_times`) show what a new length still pays.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import fxmem
from fxmem import stage_times

MIB = 2**20


def measured_step(model, batch) -> int:
    """Peak bytes of one training step (forward, backward), MemTracker's, from fresh gradients."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(**batch).loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 4), ("width", 256), ("batch", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 224, 192, 160, 128])
    parser.add_argument("--fraction", type=float, default=0.7, help="budget as a share of eager's peak")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=8192,
                        n_positions=max(args.seqs), use_cache=False, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    batches = [{"input_ids": (ids := torch.randint(0, 8192, (args.batch, s))), "labels": ids} for s in args.seqs]
    budget = args.fraction * measured_step(model, batches[0])
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, cache=False)  # planned here, not read from disk
    print(f"GPT-2 {args.layers}x{args.width}, batch {args.batch}, budget {budget / MIB:.2f} MiB "
          f"({args.fraction} x eager's measured peak at seq {args.seqs[0]})")
    firsts, cpus = [], []
    for seq, batch in zip(args.seqs, batches):
        start, cpu = time.perf_counter(), time.process_time()
        with stage_times.recording() as seconds:
            peak = measured_step(optimized, batch)
        firsts.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
        print(f"seq {seq}: first call {firsts[-1]:.1f} s ({cpus[-1]:.1f} s CPU; {stages}), measured {peak / MIB:.2f} "
              f"MiB {'within' if peak <= budget else 'OVER'} budget, plan: {optimized.plan.solver}")
    print(f"first calls together / the first one's: {sum(firsts) / firsts[0]:.2f} wall, {sum(cpus) / cpus[0]:.2f} CPU")


if __name__ == "__main__":
    main()
