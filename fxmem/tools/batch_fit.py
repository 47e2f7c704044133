"""Micro-batch size, accumulation steps and plan chosen together: the configuration of a global batch
with the best predicted throughput (samples per second) under a memory budget.

Reads a model and one example global batch; plans every micro-batch size that divides it on fake
tensors (`fxmem.plan`: nothing runs), the first micro-batch with every `.grad` None and the later ones
with the gradients resident (`accumulating=True`, `fxmem.price.accumulation`). Returns a frozen `BatchFit`
with the optimized module and the micro-batch split; prints the candidates weighed. Writes nothing else.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from fxmem.api import OPTIMIZE_SPELLINGS, model_device, optimize
from fxmem.api import plan as make_plan
from fxmem.errors import InfeasibleBudgetError, fmt_bytes
from fxmem.planner.plan import Plan

log = logging.getLogger("fxmem")
MAX_CANDIDATES = 12  # micro-batch sizes planned at most (the largest divisors first)


@dataclass(frozen=True)
class Candidate:
    """One micro-batch size weighed: its plans' predicted peak (the larger of the first and the
    accumulating micro-batch) and time per sample, or why it was not chosen."""

    micro_batch: int
    steps: int
    fits: bool
    peak_bytes: int | None
    seconds_per_sample: float | None
    note: str


@dataclass(frozen=True)
class BatchFit:
    """The chosen configuration: call `module` on each micro-batch of `split(...)`, backward each loss
    (divided by `steps` for the mean over the global batch), then step the optimizer once."""

    module: torch.nn.Module
    micro_batch: int
    steps: int
    global_batch: int
    plans: tuple[Plan, ...]  # the first micro-batch's plan, then the accumulating one's (steps > 1)
    candidates: tuple[Candidate, ...]
    budget_bytes: int

    def split(self, *args: Any, **kwargs: Any) -> list[tuple[tuple, dict]]:
        """(args, kwargs) per micro-batch: every tensor whose first dimension is the global batch is cut
        into `steps` consecutive slices along it (views: no copy); everything else is passed whole."""
        return [micro_slice((tuple(args), dict(kwargs)), self.global_batch, i * self.micro_batch, self.micro_batch)
                for i in range(self.steps)]

    @property
    def predicted_seconds_per_sample(self) -> float:
        return next(c.seconds_per_sample for c in self.candidates if c.micro_batch == self.micro_batch)

    def table(self) -> str:
        from tabulate import tabulate

        rows = [[c.micro_batch, c.steps, fmt_bytes(c.peak_bytes) if c.peak_bytes is not None else "-",
                 "-" if c.seconds_per_sample is None else f"{c.seconds_per_sample * 1e3:.3f}",
                 "chosen" if c.micro_batch == self.micro_batch else c.note] for c in self.candidates]
        body = tabulate(rows, headers=["micro-batch", "steps", "predicted peak", "ms per sample (predicted)", ""],
                        tablefmt="simple")
        return (f"{body}\n\nglobal batch {self.global_batch} = {self.steps} x {self.micro_batch} under "
                f"{fmt_bytes(self.budget_bytes)} (peaks: the larger of the first and an accumulating micro-batch)")


def micro_slice(tree: Any, global_batch: int, start: int, size: int) -> Any:
    """`tree` with every tensor of first dimension `global_batch` sliced to [start, start + size)."""
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == global_batch:
            return x[start:start + size]
        return x
    return pytree.tree_map(cut, tree)


def _global_batch(args: tuple, kwargs: dict, given: int | None) -> int:
    sizes = [x.shape[0] for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    batch = given if given is not None else (sizes[0] if sizes else 0)
    if batch < 1 or batch not in sizes:
        raise ValueError(f"global_batch {batch} is not the first dimension of any example input "
                         f"(first dimensions: {sorted(set(sizes))}); pass the whole global batch as the example")
    return batch


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_batch(model: torch.nn.Module, example_inputs: Sequence[Any], budget_gb: float, *,
              example_kwargs: dict[str, Any] | None = None, global_batch: int | None = None,
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, example_target: Any = None,
              optimizer: Any = None, time_limit_s: float = 5.0, calibrate: bool | None = None, quiet: bool = False,
              **plan_kwargs: Any) -> BatchFit:
    """The micro-batch size and accumulation steps (`global_batch = steps x micro_batch`) whose plans fit
    `budget_gb` at the least predicted time per sample, and a module planned for them.

    `example_inputs` / `example_kwargs` (and `example_target` with `loss_fn`) are one global batch
    (`global_batch`: their first dimension). Every divisor of it is a candidate micro-batch (largest
    first; smaller ones are skipped once a larger one fits without recompute: they are predicted no
    faster); each is planned for its first micro-batch and, with more than one step, for the later ones
    with the gradients resident. `optimizer` counts its state in the budget (see `fxmem.plan`);
    `plan_kwargs` go to `fxmem.plan` and `fxmem.optimize` (device, solver, offload, ...). `calibrate` (default:
    unless the model is on the meta device) prices with this machine's measured kernels and per-step costs,
    which decide between many small micro-batches and fewer large ones (`fxmem.run.step_timer`). Prints the
    candidates weighed unless `quiet`; raises InfeasibleBudgetError when no micro-batch fits."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    batch = _global_batch(args, {**kwargs, "target": example_target}, global_batch)
    if calibrate is None:
        calibrate = model_device(model).type != "meta"
    options = dict(loss_fn=loss_fn, optimizer=optimizer, time_limit_s=time_limit_s, calibrate=calibrate, **plan_kwargs)
    candidates, best, refusals = [], None, []
    sizes = sorted(divisors(batch), reverse=True)[:MAX_CANDIDATES]
    for size in sizes:
        steps = batch // size
        if best is not None and not best[1][-1].recompute and not best[1][0].recompute:
            candidates.append(Candidate(size, steps, False, None, None, f"not planned: {best[0].micro_batch} fits "
                                        "without recompute, and smaller micro-batches are predicted slower"))
            continue
        micro_args, micro_kwargs = micro_slice((args, kwargs), batch, 0, size)
        target = micro_slice(example_target, batch, 0, size)
        extra = {"example_target": target} if loss_fn is not None else {}
        try:
            plans = [make_plan(model, micro_args, budget_gb, example_kwargs=micro_kwargs, **extra, **options)]
            if steps > 1:
                plans.append(make_plan(model, micro_args, budget_gb, example_kwargs=micro_kwargs, accumulating=True,
                                       **extra, **options))
        except InfeasibleBudgetError as exc:
            refusals.append(exc)
            candidates.append(Candidate(size, steps, False, None, None,
                                        f"does not fit: needs at least {fmt_bytes(exc.min_budget_bytes)}"))
            continue
        seconds = (plans[0].predicted_step_s + (steps - 1) * plans[-1].predicted_step_s) / batch
        recomputed = sum(len(p.recompute) for p in plans)
        candidate = Candidate(size, steps, True, max(p.predicted_peak_bytes for p in plans), seconds,
                              f"recomputes {recomputed} values" if recomputed else "no recompute")
        candidates.append(candidate)
        if best is None or seconds < best[0].seconds_per_sample:
            best = (candidate, plans)
    if best is None:
        raise min(refusals, key=lambda e: e.min_budget_bytes)  # the smallest micro-batch's: the least budget
    chosen, plans = best
    accepted = set(inspect.signature(optimize).parameters) | set(OPTIMIZE_SPELLINGS)  # loss_fn=, time_limit_s=, ...
    module = optimize(model, budget_gb=budget_gb, **{k: v for k, v in options.items() if k in accepted})
    fit = BatchFit(module, chosen.micro_batch, chosen.steps, batch, tuple(plans),
                   tuple(sorted(candidates, key=lambda c: c.micro_batch)), plans[0].budget_bytes)
    if not quiet:
        print(fit.table())
    return fit


def fit_global_batch(make: Callable[[int], tuple[torch.nn.Module, Sequence[Any]]], global_batch: int,
                     budget_gb: float, **plan_kwargs: Any) -> BatchFit:
    """`fit_batch` for `fxmem-plan --global-batch`: the model and example inputs built by
    `make(global_batch)`, planned quietly (the caller prints the table)."""
    plan_kwargs.pop("eager_meter", None)
    model, inputs = make(global_batch)
    return fit_batch(model, inputs, budget_gb, global_batch=global_batch, quiet=True, **plan_kwargs)
