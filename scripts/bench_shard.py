#!/usr/bin/env python
"""Pipeline stage balance on the zoo: fxmem's split against equal layers and equal parameters.

Reads zoo presets; for each and each stage count S, plans the stages with fxmem (one microbatch,
fake tensors) and prices three splits of the same units with the same cost model: fxmem's, the
equal-layer split (torchtitan, DeepSpeed partition_method='uniform') and the equal-parameter split
(DeepSpeed's default). Balance = slowest stage / lower bound (1.0 is perfect). With --measure it also
runs 2 processes (gloo on 127.0.0.1, 1F1B) for fxmem's and the equal-layer split of a model whose
head is heavy, and reports the median measured step time, next to each stage's measured forward+backward
time on one microbatch (one process, one thread). Prints markdown tables (tabulate).

examples:
  python scripts/bench_shard.py --quick
  python scripts/bench_shard.py --models gpt-small resnet18 unet-small --stages 2 4 --measure
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem import models
from fxmem.dist.pipeline import baseline_cuts, problem_from_plan
from fxmem.solve.stages import evaluate

QUICK = ["gpt-tiny", "mlp-tiny", "resnet-tiny", "unet-tiny"]
FULL = ["gpt-small", "gpt2", "resnet18", "unet-small", "mlp-small"]
# a heavy head: vocabulary 8192 against 64-wide blocks (the embedding is tied to it)
UNEVEN = ("gpt-tiny", {"vocab_size": 8192, "n_layer": 4})


def microbatch(name: str, batch: int, **overrides) -> tuple:
    inputs = models.example_inputs(name, batch, **overrides)
    return inputs if name.startswith("gpt") else inputs[:-1]  # GPT returns its loss; others their logits


def balance_rows(name: str, stages: list[int], batch: int, n_micro: int, overrides: dict) -> list[list]:
    torch.manual_seed(0)
    model = models.from_name(name, **overrides)
    mb = microbatch(name, batch, **overrides)
    rows = []
    for S in stages:
        start = time.perf_counter()
        try:
            plan = fxmem.plan(model, mb, num_stages=S, n_microbatches=n_micro)
        except ValueError as exc:
            print(f"{name} S={S}: {exc}", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        problem = problem_from_plan(plan)
        others = {}
        for method in ("uniform", "parameters"):
            try:
                others[method] = evaluate(problem, baseline_cuts(plan, method))
            except ValueError:  # fewer layers than stages: the equal-layer split does not exist
                others[method] = None
        fmt = lambda split, f: "n/a" if split is None else f(split)  # noqa: E731
        label = name + "".join(f" {k}={v}" for k, v in overrides.items())
        cuts = ", ".join(problem.names[c] for c in plan.pipeline.first_units)
        rows.append([label, S, problem.num_units, f"{plan.pipeline.balance:.3f}",
                     fmt(others["uniform"], lambda x: f"{x.balance:.3f}"),
                     fmt(others["parameters"], lambda x: f"{x.balance:.3f}"), f"{plan.pipeline.slowest_s * 1e3:.3f}",
                     fmt(others["uniform"], lambda x: f"{x.slowest_s * 1e3:.3f}"), cuts, f"{seconds:.1f}"])
    return rows


# ---- measured: 2 processes ------------------------------------------------------------------------

def _worker(rank: int, port: int, out: str, name: str, overrides: dict, batch: int, n_micro: int,
            steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = models.from_name(name, **overrides)
        full = microbatch(name, batch * n_micro, **overrides)
        plan = fxmem.plan(model, tuple(x[:batch] for x in full), num_stages=2, n_microbatches=n_micro)
        splits = {"fxmem": plan.pipeline.first_units, "uniform": baseline_cuts(plan, "uniform")}
        times: dict[str, list[float]] = {k: [] for k in splits}
        stages = {}
        for key, cuts in splits.items():
            variant = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, first_units=tuple(cuts)))
            stage = fxmem.pipeline_stage(model, variant, rank, torch.device("cpu"))
            stages[key] = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=fxmem.dist.pipeline.output_is_loss)
        for step in range(steps + 2):  # interleaved, first two are warm-up
            for key, schedule in stages.items():
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    schedule.step(*full)
                else:
                    schedule.step(target=full[0], return_outputs=False)
                fxmem.dist.pipeline.sync_shared_grads(schedule._stage)
                dist.barrier()
                if step >= 2:
                    times[key].append(time.perf_counter() - start)
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                f.write(repr({k: statistics.median(v) for k, v in times.items()}))
    finally:
        dist.destroy_process_group()


def stage_seconds(batch: int, repeats: int = 7) -> dict[str, list[float]]:
    """Median forward+backward seconds of each stage module on one microbatch, one process, 1 thread."""
    from fxmem.dist.pipeline import stage_modules

    torch.set_num_threads(1)
    name, overrides = UNEVEN
    torch.manual_seed(0)
    model = models.from_name(name, **overrides)
    mb = microbatch(name, batch, **overrides)
    plan = fxmem.plan(model, mb, num_stages=2, n_microbatches=4)
    out = {}
    for key, cuts in {"fxmem": plan.pipeline.first_units, "uniform": baseline_cuts(plan, "uniform")}.items():
        variant = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, first_units=tuple(cuts)))
        x, out[key] = mb, []
        for module in stage_modules(model, variant):
            inputs = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in x)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                result = module(*inputs)
                floats = [o for o in (result if isinstance(result, tuple) else (result,)) if o.is_floating_point()]
                torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
                times.append(time.perf_counter() - start)
            out[key].append(statistics.median(times[2:]))
            with torch.no_grad():
                x = module(*inputs)
            x = x if isinstance(x, tuple) else (x,)
    return out


def measure(batch: int, n_micro: int, steps: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    name, overrides = UNEVEN
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.txt")
        mp.spawn(_worker, args=(port, out, name, overrides, batch, n_micro, steps), nprocs=2, join=True)
        with open(out, encoding="utf-8") as f:
            return eval(f.read())  # noqa: S307 - our own repr of a dict of floats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"zoo presets (default {' '.join(FULL)})")
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch-size", type=int, default=2, help="microbatch size")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--measure", action="store_true", help="also time 2 processes (gloo, 1F1B)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per split")
    parser.add_argument("--quick", action="store_true", help="tiny presets plus the uneven GPT, measured")
    args = parser.parse_args(argv)
    names = args.models or (QUICK if args.quick else FULL)
    rows = []
    for name in names:
        rows += balance_rows(name, args.stages, args.batch_size, args.microbatches, {})
    rows += balance_rows(UNEVEN[0], args.stages, args.batch_size, args.microbatches, UNEVEN[1])
    headers = ["model", "stages", "units", "balance fxmem", "balance equal layers", "balance equal params",
               "slowest ms fxmem", "slowest ms equal layers", "fxmem cuts before", "plan s"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    if args.measure or args.quick:
        name = UNEVEN[0] + "".join(f" {k}={v}" for k, v in UNEVEN[1].items())
        stages = stage_seconds(args.batch_size)
        times = measure(args.batch_size, args.microbatches, 3 if args.quick else args.steps)
        ms = lambda xs: " / ".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
        print()
        print(tabulate([[name, 2, ms(stages["fxmem"]), ms(stages["uniform"]), f"{times['fxmem'] * 1e3:.1f}",
                         f"{times['uniform'] * 1e3:.1f}", f"{times['uniform'] / times['fxmem']:.2f}x"]],
                       headers=["model", "stages", "stage ms fxmem split", "stage ms equal layers",
                                "2-process step ms fxmem", "2-process step ms equal layers", "step speed-up"],
                       tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
