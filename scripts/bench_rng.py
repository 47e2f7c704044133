#!/usr/bin/env python
"""Least budget with random ops (dropout) always kept against replayed (passes/rng.py), beside eager's
and full activation checkpointing's measured peaks (MemTracker on CPU). Plans on fake tensors.

examples:
  python scripts/bench_rng.py gpt-tiny:8 gpt-small:8      # zoo preset:batch size
"""
from __future__ import annotations

import sys

import torch

import fxmem
from fxmem import models
from fxmem.run.engine import plan_step
from fxmem.measure import measure_peak_bytes
from fxmem.planner.planner import PlanRequest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from baselines import full_ac

MIB = 2**20


def least(model, inputs, replay: bool) -> int:
    try:
        plan_step(model, inputs, {}, PlanRequest(budget_bytes=1, replay_random=replay, time_limit_s=10))
    except fxmem.InfeasibleBudgetError as exc:
        return exc.min_budget_bytes
    raise AssertionError("a 1-byte budget was met")


def main(argv: list[str]) -> int:
    for spec in argv or ["gpt-tiny:8"]:
        name, _, batch = spec.partition(":")
        torch.manual_seed(0)
        model = models.from_name(name).train()
        inputs = models.example_inputs(name, int(batch) if batch else None)
        kept, replayed = least(model, inputs, False), least(model, inputs, True)
        eager, ac = measure_peak_bytes(model, inputs), measure_peak_bytes(full_ac(model), inputs)
        print(f"{spec}: eager {eager / MIB:.2f} MiB, full-AC {ac / MIB:.2f} MiB, least kept {kept / MIB:.2f} MiB "
              f"({kept / eager:.0%} of eager), least replayed {replayed / MIB:.2f} MiB ({replayed / eager:.0%})",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
