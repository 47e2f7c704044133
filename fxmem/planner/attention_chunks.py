"""How many chunks of query rows naive attention is computed in: a planner decision, priced like recompute
and planned together with the loss's chunks (fxmem.planner.loss_chunks).

Reads a captured graph, its attention sites (`passes/chunked_attention.py`) and the request's budget;
plans the step with attention as traced (the loss chunked as `plan_with_loss_chunks` decides) and,
where that does not fit or fits only by recomputing more than the scores cost, plans it with attention
in chunks (each a fresh copy of the graph rewritten by `chunk_attention`): where as traced does not
fit, the most chunks worth making first (the loss's chunk count chosen there as fxmem.planner.loss_chunks
chooses it), then the fewest of 2, 4, 8, ... that fit with that loss chunk count, bisected; where it
fits by recomputing and the scores are a tenth of the budget or more, 2 chunks when that is predicted
faster. Chunking costs the q @ kt matmul once
more in backward: the plan counts it in `extra_flops` and its step time. Applying a plan rewrites the
graph with the plan's `attention_chunks` (and `loss_chunks`). Only requests with `chunk_loss`
(`fxmem.plan`, `fxmem.optimize`) chunk. Writes `Plan.attention_chunks`, `Plan.attention_chunk_rows` and
`Plan.numerics`; nothing to disk.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch.fx

from fxmem.errors import InfeasibleBudgetError, PlanMismatchError
from fxmem.planner.loss_chunks import (
    MIN_GAIN,
    WORTH_TRYING,
    PlanGraph,
    chunked_plan,
    copy_graph,
    fewest_fitting,
    plan_with_loss_chunks,
    power_of_two_chunks,
)
from fxmem.passes.chunked_attention import (
    AttentionSite,
    attention_sites,
    chunk_attention,
)
from fxmem.passes.chunked_loss import chunk_loss, loss_sites

log = logging.getLogger("fxmem")

MAX_CHUNKS = 32  # more chunks lengthen the graph (each is ~20 ops a site) for a few MiB less
NUMERICS = ("attention's key, value (and additive mask) gradients summed over query chunks: equal to eager's to "
            "float reassociation")


def rewrites_planned(gm: torch.fx.GraphModule, request: Any) -> bool:
    """Whether `request` rewrites `gm` (its loss or attention in chunks), so that it is planned on fake tensors."""
    given = request.plan
    if given is not None:
        return getattr(given, "loss_chunks", 1) > 1 or getattr(given, "attention_chunks", 1) > 1
    return bool(request.chunk_loss and request.budget_bytes is not None and (loss_sites(gm) or attention_sites(gm)))


def most_chunks(sites: list[AttentionSite]) -> int:
    """The most chunks worth making: a power of two at which one chunk's scores are no larger than the keys
    they are made from (at most `MAX_CHUNKS`, at least one query row per chunk)."""
    return power_of_two_chunks(lambda k: any(site.queries > k * site.head_dim for site in sites),
                               min(site.queries for site in sites), MAX_CHUNKS)


def attention_plan(plan: Any, sites: list[AttentionSite], chunks: int, device: Any) -> Any:
    """`plan` stating its attention chunk count, with the scores' matmul done again in backward priced as
    extra work (its FLOPs and seconds are in the chunked graph's own step; the eager step has them once)."""
    if chunks <= 1:
        return plan
    flops = sum(site.score_flops() for site in sites)
    seconds = sum(device.seconds(site.score_flops(), 0, site.dtype) for site in sites)
    rows = ", ".join(sorted({str(site.chunk_rows(chunks)) for site in sites}, key=int))
    return dataclasses.replace(
        plan, attention_chunks=chunks, attention_chunk_rows=f"{rows} rows in {len(sites)} sites",
        numerics="; ".join(filter(None, (plan.numerics, NUMERICS))),
        extra_flops=plan.extra_flops + flops, total_flops=max(0, plan.total_flops - flops),
        baseline_step_s=max(0.0, plan.baseline_step_s - seconds))


def plan_with_rewrites(gm: torch.fx.GraphModule, request: Any, plan_graph: PlanGraph) -> tuple[Any, Any]:
    """(plan, step) for `gm` under `request`: `plan_graph(graph, request)` on the graph as captured or
    with its attention and loss chunked, as the budget needs (see the module docstring)."""
    sites = attention_sites(gm)
    given = request.plan
    if given is not None:
        chunks = getattr(given, "attention_chunks", 1)
        if chunks > 1 and not sites:
            raise PlanMismatchError(
                f"this plan computes attention in {chunks} chunks of queries, but this model has no naive attention "
                "(q @ k^T -> softmax -> @ v) to chunk; make a new plan with fxmem.plan(...) for this model")
        return plan_with_loss_chunks(chunk_attention(copy_graph(gm), chunks) if chunks > 1 else gm, request,
                                     plan_graph)
    if not sites or request.budget_bytes is None or not request.chunk_loss:
        return plan_with_loss_chunks(gm, request, plan_graph)
    losses = loss_sites(gm)

    def chunked(chunks: int, loss: int | None = None) -> tuple[Any, Any]:
        graph = chunk_attention(copy_graph(gm), chunks)
        if loss is None:  # the loss's chunks chosen for this graph
            plan, step = plan_with_loss_chunks(graph, request, plan_graph)
        else:
            plan, step = plan_graph(chunk_loss(graph, loss), request)
            plan = chunked_plan(plan, losses, loss, request.device)
        step.planner.plan = plan = attention_plan(plan, sites, chunks, request.device)
        return plan, step

    try:
        traced = plan_with_loss_chunks(copy_graph(gm), request, plan_graph)
    except InfeasibleBudgetError as exc:
        if sum(site.region_bytes() for site in sites) < MIN_GAIN * exc.min_budget_bytes:
            raise  # the scores are less than chunking must gain: the floor is elsewhere
        return _fewest_chunks_that_fit(chunked, most_chunks(sites), exc)
    if traced[0].extra_flops <= sum(site.score_flops() for site in sites) \
            or sum(site.region_bytes() for site in sites) < WORTH_TRYING * request.budget_bytes:
        return traced  # chunking cannot be cheaper than what this plan recomputes, or frees too little to matter
    try:  # it fits, recomputing more than the scores cost: the fewest chunks may be faster
        two = chunked(2, traced[0].loss_chunks)
    except InfeasibleBudgetError:
        return traced
    return two if two[0].predicted_step_s < traced[0].predicted_step_s else traced


def _fewest_chunks_that_fit(chunked: Callable[..., tuple[Any, Any]], most: int,
                            refusal: InfeasibleBudgetError) -> tuple[Any, Any]:
    """The plan with the fewest attention chunks (a power of two up to `most`) that fits, where attention
    as traced does not (`refusal`): `most` first (choosing the loss's chunks), then a bisection of the
    powers of two between with that loss chunk count; raises the refusal naming the least budget with
    `most` chunks where even that does not fit."""
    try:
        best = chunked(most)
    except InfeasibleBudgetError as exc:
        raise _with_chunks(exc, most) if exc.min_budget_bytes < refusal.min_budget_bytes else refusal from None
    loss = best[0].loss_chunks
    best = fewest_fitting(lambda chunks: chunked(chunks, loss), most, best, "attention in %d chunks")
    log.info("fxmem: attention is computed in %d chunks of queries", best[0].attention_chunks)
    return best


def _with_chunks(exc: InfeasibleBudgetError, chunks: int) -> InfeasibleBudgetError:
    """`exc` saying the least budget it names has attention computed in `chunks` chunks."""
    exc.attention_chunks = chunks
    exc.args = (f"{exc.args[0]} (least with attention computed in {chunks} chunks of queries)",)
    return exc
