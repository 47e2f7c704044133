"""`fxmem-plan MODEL --world-size N`: one rank of an FSDP2 job, planned offline.

Reads the CLI's arguments and the model it built; writes the rank's table to stdout and, with --out, the
`FsdpPlan` JSON that `fxmem.fsdp.shard` applies on every rank. The rank is simulated under torch's fake
process group in this one process (`fxmem.fsdp`) on fake tensors, so the model may be built on the meta device
(--meta): no weights needed.
"""
from __future__ import annotations

import argparse
from typing import Any


def run_fsdp(args: argparse.Namespace, model: Any, inputs: tuple) -> None:
    from fxmem.errors import InfeasibleBudgetError, fmt_bytes
    from fxmem.fsdp import full_checkpoint_peak, plan_fsdp

    for flag, given in (("--stages", args.stages), ("--offload", args.offload), ("--policy", args.policy),
                        ("--estimate", args.estimate), ("--check", args.check)):
        if given:
            raise ValueError(f"--world-size does not combine with {flag} (it plans one FSDP2 rank under a budget)")
    optimizer = None if args.optimizer == "none" else args.optimizer or "adamw"
    try:
        plan = plan_fsdp(model, inputs, args.budget_gb, world_size=args.world_size, optimizer=optimizer,
                         time_limit_s=args.time_limit, target=args.target)
    except InfeasibleBudgetError as exc:
        raise ValueError(f"budget {fmt_bytes(exc.budget_bytes)} per rank is below the least found for "
                         f"{args.model} at {args.world_size} ranks, {fmt_bytes(exc.min_budget_bytes)}") from None
    full = full_checkpoint_peak(model, inputs, world_size=args.world_size, optimizer=optimizer, target=args.target)
    print(plan.table())
    print(f"{'FSDP2 + full checkpointing':<28}  {fmt_bytes(full)}")
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}")
