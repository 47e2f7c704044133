"""`fxmem-plan`: plan a model's training step under a memory budget, offline, before training.

Reads a zoo preset name or a `package.module:factory` returning (model, example_inputs), and with
--check a plan JSON; writes the plan JSON given with --out and a PNG timeline given with --plot.
Planning runs on fake tensors: the model never runs and no activation memory is used.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Any, Callable, Iterator, Sequence

from fxmem.cli.models import CliError, model_factory
from fxmem.price.optimizer_state import NAMED

EXAMPLES = """\
examples:
  fxmem-plan --list-models                          the zoo presets and their batch sizes
  fxmem-plan gpt-small --estimate                   where the memory goes (no budget needed)
  fxmem-plan gpt-small --budget-gb 2                plan nanoGPT-sized GPT under 2 GiB, print the table
  fxmem-plan gpt-small --budget-gb 2 --out gpt.plan.json --plot gpt.png
                                                    save the plan and a picture of memory over the step
  fxmem-plan gpt2 --budget-gb 6 --batch-size 8 --seq-len 512 --dtype bf16 --target h100
                                                    bf16 autocast, time priced for an H100
  fxmem-plan gpt-small --policy every-layer         checkpoint every block (as torch.utils.checkpoint would),
                                                    planned and priced; also every-2-layers, sqrt, speed, memory
  fxmem-plan gpt-small --estimate --policies --budget-gb 2
                                                    every policy's peak and extra time beside the 2 GiB plan
  fxmem-plan gpt-small --budget-gb 2 --max-batch    largest batch that fits at <= 10% predicted overhead
  fxmem-plan gpt-small --budget-gb 1 --global-batch 64
                                                    micro-batch x accumulation steps = 64, fastest under 1 GiB
  fxmem-plan gpt-small --budget-gb 2 --profile --no-cache
                                                    plan afresh and say where the time went, stage by stage
  fxmem-plan gpt-small --batch-size 64 --check gpt.plan.json
                                                    does a saved plan still apply to this model/shape/torch?
  fxmem-plan gpt-tiny --budget-gb 0.003 --stages 2 --microbatches 4 --out pipe.plan.json
                                                    2 pipeline stages under 0.003 GiB each (inputs: one microbatch)
  fxmem-plan mypkg.models:make --budget-gb 10       your factory: make(batch_size=N, seq_len=L) or make()
                                                    returning (model, example_inputs)
  fxmem-plan mypkg.llama:make --meta --target h100 --budget-gb 70 --seq-len 8192
                                                    build the model under torch.device("meta") (no weights:
                                                    a 70B Llama plans in under 1 GiB of host memory)

Then, in the training script:
  model = fxmem.optimize(model, plan=fxmem.Plan.load("gpt.plan.json"))

The budget bounds one training step (forward, loss, backward): parameters, gradients, saved
activations and temporaries, in GiB (2**30 bytes). The plan table lists the modules that keep or
recompute bytes (--all: every module) with a totals row and a legend; docs/cli.md reads it line by
line. Exit status: 0 on success, 2 on any error (one line on stderr).
"""
DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxmem-plan", description="Plan what to keep and what to recompute so a training step fits a "
        "memory budget, without running the model.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="zoo preset (see --list-models) or package.module:factory")
    p.add_argument("--budget-gb", type=float, help="memory budget of one training step, GiB")
    p.add_argument("--policy", help="plan under a named policy instead of a budget: speed, memory, every-layer, "
                   "every-N-layers (e.g. every-2-layers), sqrt (docs/policies.md); with --budget-gb, the policy's "
                   "plan where it fits, else an error naming its peak")
    p.add_argument("--batch-size", type=_positive, help="batch size (default: the preset's)")
    p.add_argument("--seq-len", type=_positive, help="sequence length, for sequence models (gpt-*; default: the preset's)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="plan the step under torch.autocast with this dtype (default fp32: no autocast); "
                        "train under the same autocast")
    p.add_argument("--target", default="cpu", help="device to price time for: cpu, a100, h100, h200, l4, "
                   "rtx4090 (default: cpu)")
    p.add_argument("--meta", action="store_true", help="build the model under torch.device('meta'): no "
                   "weights are made, so a model larger than this machine's memory can be planned (a factory "
                   "that builds on meta needs no flag); the plan applies to the model built with weights")
    p.add_argument("--offload", action="store_true", help="let the plan offload saved values to host memory, and with "
                   "--optimizer adam/adamw put optimizer state there (the table says what lives where)")
    p.add_argument("--stages", type=_positive, help="split the model into S pipeline stages")
    p.add_argument("--schedule", help="pipeline schedule, with --stages (e.g. gpipe, 1f1b)")
    p.add_argument("--microbatches", type=_positive, help="pipeline microbatches, with --stages")
    p.add_argument("--world-size", type=_positive, help="plan one rank of an FSDP2 job of N ranks (docs/fsdp.md)")
    p.add_argument("--solver", default="auto", help="auto (default: exact on small graphs, layered on repeated "
                   "layers, else cpsat), cpsat, exact, layered or greedy")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds (default 10)")
    p.add_argument("--by", choices=("module", "op"), default="module", help="group the plan table by")
    p.add_argument("--all", action="store_true", help="list every module (or op) in the plan table, also "
                   "those that keep and recompute nothing")
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--plot", help="write a PNG of live memory over the step (eager vs plan) here")
    p.add_argument("--estimate", action="store_true", help="print the memory breakdown of an eager step "
                   "(parameters, gradients, optimizer state, activations by module) and exit")
    p.add_argument("--policies", action="store_true", help="with --estimate: also every policy's predicted peak "
                   "and extra step time, beside the plan for --budget-gb when given")
    p.add_argument("--optimizer", choices=("none", *NAMED),
                   help="optimizer whose state is on the device for the whole step (with --offload, adam/adamw "
                        "state may go to the host), counted in --budget-gb "
                        "when given (default for a plan: none); --estimate and --world-size count adamw unless "
                        "told otherwise")
    p.add_argument("--max-batch", action="store_true", help="search the largest batch size that fits "
                   "--budget-gb, upward from --batch-size (default 1)")
    p.add_argument("--max-overhead", type=float, default=0.1,
                   help="with --max-batch: most predicted extra step time, fraction (default 0.1)")
    p.add_argument("--batch-multiple", type=_positive, default=1,
                   help="with --max-batch: only try multiples of this batch size (default 1)")
    p.add_argument("--global-batch", type=_positive, help="choose the micro-batch size (a divisor of N) and "
                   "gradient accumulation steps with the best predicted throughput under --budget-gb")
    p.add_argument("--check", metavar="PLAN_JSON", help="check that a saved plan applies to MODEL at this "
                   "batch/shape/dtype and torch version; print what differs")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    p.add_argument("--profile", action="store_true", help="print where the time went: capture, eager's meter, "
                   "the joint graph's trace, pricing, solving, simulating, rewriting, compiling")
    p.add_argument("--no-cache", action="store_true", help="plan afresh: neither read nor keep plans in the plan "
                   "cache (FXMEM_CACHE_DIR, default ~/.cache/fxmem; FXMEM_CACHE=0 does the same)")
    p.add_argument("--list-models", action="store_true", help="list the zoo presets and exit")
    return p


@contextlib.contextmanager
def precision(dtype: str, model: Any, target: str = "cpu") -> Iterator[None]:
    """torch.autocast on the model's device with `dtype` (a meta model: the device it is planned on
    for `target`), or nothing for fp32."""
    import torch

    from fxmem.price.cost import DeviceSpec
    from fxmem.trace.meta_device import is_meta_model, planning_device

    if DTYPES[dtype] is None:
        yield
        return
    device = next((p.device.type for p in model.parameters()), "cpu")
    if is_meta_model(model):
        device = planning_device(DeviceSpec.from_name(target)).type
    with torch.autocast(device, dtype=getattr(torch, DTYPES[dtype])):
        yield


# ---- commands --------------------------------------------------------------------------------
def _check_budget(budget_gb: float) -> None:
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise CliError(f"--budget-gb must be a positive, finite number of GiB (2**30 bytes), got {budget_gb}; "
                       "--estimate shows the memory of a step with nothing recomputed")


def _plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"device": args.target, "solver": args.solver, "time_limit_s": args.time_limit}
    extra = {"offload": True if args.offload else None, "num_stages": args.stages, "schedule": args.schedule,
             "n_microbatches": args.microbatches}
    kwargs.update({k: v for k, v in extra.items() if v is not None})
    if args.optimizer not in (None, "none"):
        kwargs["optimizer"] = args.optimizer  # its state counts in the budget, as fxmem.plan(optimizer=) counts it
    if args.stages is None:
        kwargs["eager_meter"] = True  # the table sets PyTorch eager's peak beside fxmem's keep-all step
    return kwargs


def _call_plan(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a planning function; a keyword this build's fxmem.plan does not take is a clear error."""
    flags = {"offload": "--offload", "num_stages": "--stages", "schedule": "--schedule",
             "n_microbatches": "--microbatches", "optimizer": "--optimizer"}
    try:
        return fn(*args, **kwargs)
    except TypeError as exc:
        named = [flag for key, flag in flags.items() if key in kwargs and f"'{key}'" in str(exc)]
        if named and "keyword argument" in str(exc):
            raise CliError(f"{named[0]} is not available in this build of fxmem (fxmem.plan does not take it)") \
                from None
        raise



def infeasible_message(exc: Any, what: str, offload: bool = False) -> str:
    """One line: the least feasible --budget-gb and its breakdown; --offload suggested unless `offload`
    (given already, or not available: pipeline stages)."""
    from fxmem.errors import fmt_bytes, gb_at_least, least_words

    if exc.min_budget_bytes <= exc.budget_bytes:  # not a minimum below this budget: the planner's own words
        return f"{exc} ({what})"
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in exc.breakdown.items())
    least = least_words(exc).replace("the minimum ", "the minimum feasible budget ")
    return (f"budget {fmt_bytes(exc.budget_bytes)} is below {least} for {what}" + (f" ({parts})" if parts else "")
            + f"; use --budget-gb {gb_at_least(exc.min_budget_bytes)} or more, "
            + ("" if exc.proven else "a longer --time-limit, ")
            + ("or a smaller --batch-size" if offload else "a smaller --batch-size, or --offload"))


def _estimate(args: argparse.Namespace, model: Any, inputs: tuple) -> None:
    import torch

    from fxmem.tools.estimate import estimate

    optimizer = None
    if args.optimizer != "none":
        kind, options = NAMED[args.optimizer or "adamw"]
        optimizer_class = {c.__name__.lower(): c for c in vars(torch.optim).values() if isinstance(c, type)}[kind]
        optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=0.1, **options)
    if args.policies:
        print(estimate(model, inputs, optimizer, policies=True, budget_gb=args.budget_gb,
                       time_limit_s=args.time_limit).table())
        return
    print(estimate(model, inputs, optimizer).table())


def _check(args: argparse.Namespace, model: Any, inputs: tuple) -> None:
    from fxmem.planner.plan import Plan
    from fxmem.tools.check_plan import check_plan

    plan = Plan.load(args.check)
    check_plan(model, inputs, plan)
    print(f"{args.check} applies to {plan.model} {plan.signature} (torch {plan.torch_version})")


def _write(args: argparse.Namespace, plan: Any) -> None:
    print(plan.table(by=args.by, all_rows=args.all))
    if args.out:
        plan.save(args.out)
        load = f"fxmem.Plan.load({args.out!r})"
        use = (f"fxmem.pipeline_stage(model, {load}, stage_index=rank, device=...) on each rank" if plan.pipeline
               else f"fxmem.optimize(model, plan={load})")
        print(f"\nplan written to {args.out}; use it with {use}")
    if args.plot:
        from fxmem.cli.plot import plot_timeline

        plot_timeline(plan, args.plot)
        print(f"memory timeline written to {args.plot}")


def run(args: argparse.Namespace) -> None:
    import fxmem
    from fxmem.cli.flags import refuse_unused
    from fxmem.progress import Progress

    if args.budget_gb is not None:
        _check_budget(args.budget_gb)
    if args.plot:  # before anything is planned: drawing is the last step, and planning may take minutes
        from fxmem.cli.plot import check_matplotlib

        check_matplotlib()
    if args.policies and not args.estimate:
        raise CliError("--policies goes with --estimate (fxmem-plan MODEL --estimate --policies); "
                       "to plan under one policy, use --policy NAME")
    try:
        refuse_unused(args, _parser())  # every flag is read by this run, or refused here, before any work
    except ValueError as exc:
        raise CliError(str(exc)) from None
    make = model_factory(args.model, args.seq_len, args.meta)
    model, inputs = make(args.batch_size)
    from fxmem.run.engine import signature_of  # after the model is built: a model too big is refused sooner
    with precision(args.dtype, model, args.target):
        what = f"{args.model} {signature_of(model, inputs, {})}"
        if args.estimate:
            with Progress(f"estimating {what}", quiet=args.quiet):
                return _estimate(args, model, inputs)
        if args.world_size:
            from fxmem.cli.fsdp import run_fsdp
            return run_fsdp(args, model, inputs)
        if args.check:
            return _check(args, model, inputs)
        if args.budget_gb is None and args.policy is None:
            raise CliError("give --budget-gb or --policy (or --estimate, --check); see the examples in --help")
        kwargs = _plan_kwargs(args)
        if args.policy is not None:
            if args.max_batch:
                raise CliError("--max-batch searches under --budget-gb; it does not take --policy")
            kwargs["policy"] = args.policy
        if args.max_batch:
            from fxmem.tools.capacity import batch_search

            start = args.batch_size or 1
            with Progress(f"searching the largest batch of {args.model} under {args.budget_gb} GiB",
                          time_limit_s=args.time_limit, quiet=args.quiet):
                found = _call_plan(batch_search, lambda b: make(b), args.budget_gb, args.max_overhead,
                                   min_batch=start, multiple_of=args.batch_multiple, **kwargs)
            print(found.table() + "\n")
            if found.plan is None:
                raise CliError(f"not even batch {start} fits {args.budget_gb} GiB at "
                               f"<= {100 * args.max_overhead:.0f}% overhead: {found.trials[0].reason}")
            return _write(args, found.plan)
        if args.global_batch:
            from fxmem.tools.batch_fit import fit_global_batch

            with Progress(f"weighing micro-batches of {args.model} under {args.budget_gb} GiB",
                          time_limit_s=args.time_limit, quiet=args.quiet):
                fit = _call_plan(fit_global_batch, make, args.global_batch, args.budget_gb, **kwargs)
            print(fit.table() + "\n")
            return _write(args, fit.plans[-1])
        under = " and ".join(([f"policy {args.policy}"] if args.policy else [])
                             + ([f"{args.budget_gb} GiB"] if args.budget_gb is not None else []))
        with Progress(f"planning {what} under {under}", time_limit_s=args.time_limit,
                      quiet=args.quiet):
            try:
                plan = _call_plan(fxmem.plan, model, inputs, args.budget_gb, **kwargs)
            except fxmem.InfeasibleBudgetError as exc:
                no_offload = bool(kwargs.get("offload")) or args.stages is not None
                raise CliError(infeasible_message(exc, what, offload=no_offload)) from None
        _write(args, plan)


def _profiled(args: argparse.Namespace) -> None:
    """`run`, then where its time went, stage by stage (`fxmem.stage_times`)."""
    import time

    from fxmem import stage_times

    start = time.perf_counter()
    with stage_times.recording() as seconds:
        run(args)
    print()
    print(stage_times.table(seconds, time.perf_counter() - start).replace("of planning", "of this command"))


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status: 0, 2 on an error (said in one line), 130 interrupted, 141 when the reader of
    the output left (`fxmem-plan --list-models | head`: stop quietly, as Unix tools do on SIGPIPE)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at exit, so that a reader gone is seen here
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 141


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list_models:
        from fxmem import models

        print("\n".join(f"{name:12s} batch {models.default_batch_size(name)}" for name in models.list_models()))
        return 0
    if args.model is None:
        parser.error("give a MODEL (see --list-models and the examples in --help)")
    from fxmem.errors import FxmemError

    if args.no_cache:
        os.environ["FXMEM_CACHE"] = "0"  # every plan this command makes, however it is reached
    try:
        if args.profile:
            _profiled(args)
        else:
            run(args)
    except BrokenPipeError:
        raise
    except (CliError, FxmemError, ValueError, KeyError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"fxmem-plan: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxmem-plan: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
