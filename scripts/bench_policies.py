"""Benchmark the named policies against the hand-written checkpointing they stand for: per policy, the
peak fxmem predicts, the peak MemTracker measures (fxmem.measure) and the median measured step time,
beside `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around the same blocks of the same
zoo GPT. Prints a markdown table (tabulate).

    python scripts/bench_policies.py                               # gpt-small, batch 8, 6 blocks
    python scripts/bench_policies.py --model gpt-tiny --n-layer 4 --batch-size 4 --steps 3
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

import fxmem
from fxmem import models
from fxmem.errors import fmt_bytes
from fxmem.measure import measure_peak_bytes, training_step
from fxmem.planner.policies import POLICIES, parse_policy, units_of


def hand_checkpointed(model: torch.nn.Module, policy: str) -> torch.nn.Module | None:
    """The zoo GPT with the policy's blocks run inside `checkpoint` calls (None for "memory": no such recipe)."""
    parsed = parse_policy(policy)
    if parsed.name == "memory":
        return None
    if not parsed.checkpoints:
        return model
    names = tuple(f"blocks.{k}" for k in range(len(model.blocks)))
    calls: dict[int, list[int]] = {}
    for name, unit in units_of(parsed, names).items():
        calls.setdefault(unit, []).append(int(name.rsplit(".", 1)[1]))
    for group in calls.values():
        forwards = [model.blocks[i].forward for i in group]

        def run(x, forwards=forwards):
            for forward in forwards:
                x = forward(x)
            return x

        model.blocks[group[0]].forward = lambda x, run=run: checkpoint(run, x, use_reentrant=False)
        for i in group[1:]:
            model.blocks[i].forward = lambda x: x
    return model


def step_seconds(module: torch.nn.Module, inputs: tuple, steps: int) -> float:
    """Median wall time of `steps` training steps (after the warm-up the peak measurement ran)."""
    times = []
    for _ in range(steps):
        for p in module.parameters():
            p.grad = None
        started = time.perf_counter()
        training_step(module, inputs)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rows(model: torch.nn.Module, inputs: tuple, steps: int, time_limit_s: float) -> list[list[str]]:
    out = []
    for policy in POLICIES:
        optimized = fxmem.optimize(copy.deepcopy(model), policy=policy, time_limit_s=time_limit_s)
        peak = measure_peak_bytes(optimized, inputs)
        plan = optimized.plan
        seconds = step_seconds(optimized, inputs, steps)
        by_hand = hand_checkpointed(copy.deepcopy(model), policy)
        hand_peak = measure_peak_bytes(by_hand, inputs) if by_hand is not None else None
        hand_s = step_seconds(by_hand, inputs, steps) if by_hand is not None else None
        out.append([policy, fmt_bytes(plan.predicted_peak_bytes), fmt_bytes(peak),
                    fmt_bytes(hand_peak) if hand_peak else "-",
                    f"{100 * (peak / hand_peak - 1):+.1f}%" if hand_peak else "-",
                    f"{seconds * 1e3:,.0f}", f"{hand_s * 1e3:,.0f}" if hand_s else "-"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--n-layer", type=int, default=None, help="blocks (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per policy (median)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="the memory policy's search, seconds")
    args = parser.parse_args()
    overrides = {"n_layer": args.n_layer} if args.n_layer else {}
    torch.manual_seed(0)
    model = models.from_name(args.model, **overrides)
    inputs = models.example_inputs(args.model, args.batch_size, **overrides)
    print(f"{args.model} batch {args.batch_size}, {len(model.blocks)} blocks (sqrt: segments of "
          f"{max(1, round(math.sqrt(len(model.blocks))))}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    headers = ["policy", "predicted peak", "measured peak", "torch.utils.checkpoint peak", "fxmem vs by hand",
               "step (ms)", "by hand step (ms)"]
    print(tabulate(rows(model, inputs, args.steps, args.time_limit), headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
