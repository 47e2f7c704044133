"""`fxmem-plan`: plan a model's training step under a memory budget, print the table, write the plan.

Reads a zoo preset name or a `package.module:factory` returning (model, example_inputs);
writes the plan JSON given with --out. Planning runs on fake tensors: no real memory is used.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from typing import Any, Sequence

EXAMPLES = """\
examples:
  fxmem-plan gpt-small --budget-gb 2               plan nanoGPT-sized GPT under 2 GiB
  fxmem-plan gpt2 --budget-gb 6 --batch-size 8 --out gpt2.plan.json
  fxmem-plan resnet18 --budget-gb 3 --target h100   price recompute for an H100
  fxmem-plan mypkg.models:make --budget-gb 10     your factory returning (model, example_inputs)
  fxmem-plan --list-models

The budget bounds one training step (forward, loss, backward): parameters, gradients,
saved activations and temporaries, in GiB (2**30 bytes).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxmem-plan", description="Plan what to keep and what to recompute so a training step "
        "fits a memory budget.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="zoo preset (see --list-models) or package.module:factory")
    parser.add_argument("--budget-gb", type=float, help="memory budget of one training step, GiB")
    parser.add_argument("--batch-size", type=int, help="batch size (default: the preset's)")
    parser.add_argument("--target", default="cpu", help="device to price time for: cpu, a100, h100, h200, l4, "
                        "rtx4090 (default: cpu)")
    parser.add_argument("--solver", default="auto", help="auto (default: exact on small graphs, layered on repeated layers, else cpsat), cpsat, exact, layered or greedy")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds (default 10)")
    parser.add_argument("--by", choices=("module", "op"), default="module", help="group the table by")
    parser.add_argument("--out", help="write the plan JSON here")
    parser.add_argument("--list-models", action="store_true", help="list the zoo presets and exit")
    return parser


def load_model(spec: str, batch_size: int | None) -> tuple[Any, tuple]:
    """A zoo preset, or `package.module:factory` called as factory() or factory(batch_size=N)."""
    from fxmem import models

    if ":" not in spec:
        if spec not in models.list_models():
            raise SystemExit(f"fxmem-plan: unknown model {spec!r}. Presets: {', '.join(models.list_models())}; "
                             "or give package.module:factory")
        return models.from_name(spec), models.example_inputs(spec, batch_size)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"fxmem-plan: cannot load {spec!r}: {exc}") from None
    made = factory(batch_size=batch_size) if batch_size is not None else factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit(f"fxmem-plan: {spec} must return (model, example_inputs), got {type(made).__name__}")
    return made[0], tuple(made[1])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_models:
        from fxmem import models

        print("\n".join(f"{name:12s} batch {models.default_batch_size(name)}" for name in models.list_models()))
        return 0
    if args.model is None or args.budget_gb is None:
        _parser().error("give a MODEL and --budget-gb (see the examples below --help)")
    import fxmem

    logging.basicConfig(level=logging.INFO, format="fxmem: %(message)s", stream=sys.stderr)
    started = time.perf_counter()
    model, inputs = load_model(args.model, args.batch_size)
    print(f"planning {args.model} {fxmem.runtime.signature_of(model, inputs, {})} under {args.budget_gb} GiB ...",
          file=sys.stderr, flush=True)
    try:
        plan = fxmem.plan(model, inputs, budget_gb=args.budget_gb, device=args.target, solver=args.solver,
                          time_limit_s=args.time_limit)
    except (fxmem.FxmemError, ValueError, KeyError) as exc:
        print(f"fxmem-plan: {exc}", file=sys.stderr)
        return 2
    print(plan.table(by=args.by))
    if args.out:
        plan.save(args.out)
        print(f"\nplan written to {args.out}")
    print(f"(planned in {time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
