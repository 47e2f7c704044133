"""Which `fxmem-plan` flags each kind of run reads, so that a flag a run would ignore is refused in one line
instead of silently dropped (`--plot` with `--estimate`, `--schedule` without `--stages`). Reads the parsed
arguments and the parser's defaults; writes nothing.
"""
from __future__ import annotations

import argparse

# the flags that only some runs read: flag -> the runs that read it
OUTPUT = ("plan", "max-batch", "global-batch")
READ_BY = {
    "budget_gb": ("plan", "max-batch", "global-batch", "world-size", "policies"),
    "policy": ("plan", "global-batch", "world-size"),
    "offload": ("plan", "max-batch", "global-batch", "world-size"),
    "stages": ("plan", "max-batch", "global-batch", "world-size"),
    "solver": (*OUTPUT, "policies"),
    "time_limit": (*OUTPUT, "world-size", "policies"),
    "by": OUTPUT, "all": OUTPUT, "plot": OUTPUT,
    "out": (*OUTPUT, "world-size"),
    "max_overhead": ("max-batch",), "batch_multiple": ("max-batch",),
}
ONLY_WITH = {"schedule": "stages", "microbatches": "stages"}  # a flag -> the flag it refines


def run_kind(args: argparse.Namespace) -> str:
    """What this command does, in the order `fxmem-plan` decides it."""
    if args.estimate:
        return "policies" if args.policies else "estimate"
    if args.world_size:
        return "world-size"
    if args.check:
        return "check"
    if args.max_batch:
        return "max-batch"
    return "global-batch" if args.global_batch else "plan"


SAID = {"estimate": "--estimate", "policies": "--estimate --policies", "world-size": "--world-size",
        "check": "--check", "max-batch": "--max-batch", "global-batch": "--global-batch", "plan": "a plan"}


def refuse_unused(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Raise ValueError naming the first flag given that this run does not read."""
    kind = run_kind(args)

    def given(name: str) -> bool:
        return getattr(args, name) != parser.get_default(name)

    for name, runs in READ_BY.items():
        if given(name) and kind not in runs:
            readers = ", ".join(SAID[run] for run in runs)
            raise ValueError(f"--{name.replace('_', '-')} does nothing with {SAID[kind]} (it is read by {readers}); "
                             "drop it")
    for name, base in ONLY_WITH.items():
        if given(name) and not given(base):
            raise ValueError(f"--{name} goes with --{base} (pipeline stages); drop it or add --{base} S")
