"""How many chunks of tokens the loss is computed in: a planner decision, priced like recompute.

Reads a captured graph, its loss sites (`passes/chunked_loss.py`) and the request's budget; plans the
step as it is (1 chunk) and, where that does not fit or fits only by recomputing more than the lm head
costs, plans it with the loss in chunks (each a fresh copy of the graph rewritten by `chunk_loss`):
where 1 chunk does not fit, the first of 8, 16, ... that fits (or the most worth making, once a count's least
shows that fewer cannot fit), then half as many while that fits with the decision of the count before and is
predicted faster (fewer ops; not tried where their overhead is under 2% of the step); where no
fewer count was faster, that plan recomputes more than the lm head costs (and, where 1 chunk fits, the loss
region is a tenth of the budget or more), twice as many chunks, and twice again, while each count is predicted
faster than half of it by 2% of the step (more chunks free more, so less is recomputed), keeping the fastest;
a count is not planned where the room it frees would let the decision before shed under 2% of the step
(`_more_may_gain`). A budget below the loss's floor as traced (`traced_floor`: parameters and the
log-softmax with its gradient) skips planning 1 chunk, as does a least named with chunks below that floor; but where that floor is under the
weights' (parameters and gradients: every plan's floor), 1 chunk is planned first, and a least within 1% of the
weights' is the least (Llama-3-8B's: one trace, not two). Chunking costs the lm head's
matmul once more in backward: the plan counts it in `extra_flops` and its step time. Applying a plan
rewrites the graph with the plan's `loss_chunks`. Only requests with `chunk_loss` (`fxmem.plan`,
`fxmem.optimize`) chunk: pipeline stages and device regions plan their graphs as traced. A model whose
other outputs are returned beside its `labels=` loss keeps its logits, which no chunking frees: its
refusal says `keep_outputs=False` lets the loss be chunked. Writes
`Plan.loss_chunks`, `Plan.loss_chunk_tokens` and `Plan.numerics`; nothing to disk.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch.fx

from fxmem.errors import InfeasibleBudgetError, PlanMismatchError, fmt_bytes
from fxmem.planner.fitting import recompute_saved_s, relax_seconds
from fxmem.planner.plan import graph_fingerprint
from fxmem.planner import shape_reuse
from fxmem.planner.shape_reuse import decision_key, keep_chunks, kept_chunks
from fxmem.trace.loss import DROP_OUTPUTS
from fxmem.passes.chunked_loss import LossSite, chunk_loss, loss_sites

log = logging.getLogger("fxmem")

START_CHUNKS = 8  # the first count planned where the loss as traced does not fit (fewer traces than bisecting from the most)
MAX_CHUNKS = 64  # more chunks lengthen the graph (each is ~20 ops a pass) for a few MiB less
OPS_PER_CHUNK = 40  # a chunk's ops, forward and backward (30 in GPT-2's traced joint graph): fewer chunks save their overhead
MIN_STEP_GAIN = 0.02  # a count is not planned where all it could save is under this share of the step (the step's
# prediction is no closer than that)
MIN_GAIN = 0.01  # chunking is not tried where the whole loss region is less than this share of the least budget
WORTH_TRYING = 0.1  # where as traced fits, more chunks are planned only if the region is this share of the budget
NUMERICS = ("loss and gradients of the lm head and cross-entropy summed chunk by chunk: equal to eager's "
            "to float reassociation")

PlanGraph = Callable[[torch.fx.GraphModule, Any], tuple[Any, Any]]


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own copy of `gm`'s graph and the same parameters, buffers and submodules."""
    import copy
    import warnings

    with warnings.catch_warnings():  # copying export's pytree specs warns of a deprecated spec class
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    fresh = torch.fx.GraphModule(gm, graph)
    fresh.meta = dict(gm.meta)
    return fresh


def most_chunks(sites: list[LossSite]) -> int:
    """The most chunks worth making: a power of two at which one chunk's fp32 logits are no larger than
    the hidden states they are made from (at most `MAX_CHUNKS`, at least one token per chunk)."""
    return power_of_two_chunks(lambda k: any(site.vocab > k * site.hidden_size for site in sites),
                               min(site.tokens for site in sites), MAX_CHUNKS)


def power_of_two_chunks(too_large: Callable[[int], bool], rows: int, most: int) -> int:
    """The least power of two k (at least 2, at most `most`) for which `too_large(k)` is false, then
    halved until every chunk keeps at least one of `rows` rows."""
    k = 2
    while k < most and too_large(k):
        k *= 2
    while k > 2 and k > rows:
        k //= 2
    return k


def chunked_plan(plan: Any, sites: list[LossSite], chunks: int, device: Any) -> Any:
    """`plan` stating its chunk count, with the lm head's matmul done again in backward priced as extra
    work (its FLOPs and seconds are in the chunked graph's own step; the eager step has them once)."""
    if chunks <= 1:
        return plan
    flops = sum(site.lm_head_flops() for site in sites)
    seconds = sum(device.seconds(site.lm_head_flops(), 0, site.dtype) for site in sites)
    tokens = ", ".join(str(site.chunk_tokens(chunks)) for site in sites)
    return dataclasses.replace(
        plan, loss_chunks=chunks, loss_chunk_tokens=tokens, numerics=NUMERICS,
        extra_flops=plan.extra_flops + flops, total_flops=max(0, plan.total_flops - flops),
        baseline_step_s=max(0.0, plan.baseline_step_s - seconds))


def plan_with_loss_chunks(gm: torch.fx.GraphModule, request: Any, plan_graph: PlanGraph) -> tuple[Any, Any]:
    """(plan, step) for `gm` under `request`: `plan_graph(graph, request)` on the graph as captured or
    with its loss chunked, as the budget needs (see the module docstring)."""
    sites = loss_sites(gm)
    given = request.plan
    if given is not None:
        chunks = getattr(given, "loss_chunks", 1)
        if chunks > 1 and not sites:
            raise PlanMismatchError(
                f"this plan computes the loss in {chunks} chunks, but this model has no lm head -> cross-entropy "
                "whose logits nothing else reads; make a new plan with fxmem.plan(...) for this model")
        return plan_graph(chunk_loss(copy_graph(gm), chunks), request)
    if not sites or request.budget_bytes is None or not request.chunk_loss:
        try:
            return plan_graph(gm, request)
        except InfeasibleBudgetError as exc:
            if request.chunk_loss and DROP_OUTPUTS in (getattr(request, "loss", "") or ""):
                exc.args = (f"{exc.args[0]}; the model's other outputs (its logits) are returned and held to the "
                            f"step's end, so its loss cannot be computed in chunks of tokens: {DROP_OUTPUTS} and "
                            "lets fxmem chunk an lm head's cross-entropy",)
            raise

    planned_counts: dict[int, tuple[Any, Any] | InfeasibleBudgetError] = {}  # each count is planned once
    key, fingerprint = decision_key(gm, request), graph_fingerprint(gm)
    refusals = shape_reuse.refusal_key(gm, request, fingerprint)  # a count refused below its least: not traced again

    def chunked(chunks: int) -> tuple[Any, Any]:
        if chunks not in planned_counts:
            planned_counts[chunks] = shape_reuse.known_refusal(refusals, chunks, request.budget_bytes)
        if planned_counts[chunks] is None:
            try:
                plan, step = plan_graph(chunk_loss(copy_graph(gm), chunks), request)
                step.planner.plan = plan = chunked_plan(plan, sites, chunks, request.device)
                planned_counts[chunks] = plan, step
            except InfeasibleBudgetError as exc:
                planned_counts[chunks] = exc
                shape_reuse.keep_refusal(refusals, chunks, exc)
        found = planned_counts[chunks]
        if isinstance(found, InfeasibleBudgetError):
            raise found
        return found

    def as_traced() -> tuple[Any, Any] | InfeasibleBudgetError:
        try:
            return plan_graph(copy_graph(gm), request)
        except InfeasibleBudgetError as exc:
            return exc

    reused = _kept_count_fits(kept_chunks(key, fingerprint), chunked, as_traced)
    if reused is not None:
        return reused
    with shape_reuse.one_step():  # each count after the first starts from the decision before
        planned = _searched(gm, request, sites, chunked, as_traced)
    keep_chunks(key, fingerprint, getattr(planned[0], "loss_chunks", 1))
    return planned


def _kept_count_fits(chunks: int | None, chunked: Callable[[int], tuple[Any, Any]],
                     as_traced: Callable[[], Any]) -> tuple[Any, Any] | None:
    """The plan with the loss in the chunk count kept for this step at other sizes (`fxmem.planner.shape_reuse`),
    where it fits; else None."""
    if chunks is None:
        return None
    if chunks == 1:
        planned = as_traced()
        return planned if isinstance(planned, tuple) else None
    try:
        return chunked(chunks)
    except InfeasibleBudgetError:
        return None


def _searched(gm: torch.fx.GraphModule, request: Any, sites: list[LossSite], chunked: Callable[[int], tuple[Any, Any]],
              as_traced: Callable[[], Any]) -> tuple[Any, Any]:
    """The searches of the module docstring: the count that fits, then the fastest."""
    lm_head_flops, most, floor = sum(site.lm_head_flops() for site in sites), most_chunks(sites), traced_floor(gm, sites)
    region = sum(site.region_bytes() for site in sites)
    unchunked = as_traced() if request.budget_bytes >= floor else None  # below the floor it cannot fit
    if isinstance(unchunked, tuple):
        if region < WORTH_TRYING * request.budget_bytes:
            return unchunked  # chunks free too little to matter (each is a whole plan: minutes under Inductor)
        return _fastest_chunks(chunked, unchunked, lm_head_flops, most)
    weights = _weights_floor(gm)
    if unchunked is None and floor <= weights and not getattr(request, "host_state", ()):  # below any plan's floor
        unchunked = as_traced()  # refused, naming its least
        if not isinstance(unchunked, tuple) and unchunked.min_budget_bytes <= (1 + MIN_GAIN) * weights:
            raise unchunked  # the weights' own: no count could lower it by MIN_GAIN (one trace, not two)
    if isinstance(unchunked, InfeasibleBudgetError) and region < MIN_GAIN * unchunked.min_budget_bytes:
        raise unchunked  # the whole loss region is less than chunking must gain: the floor is elsewhere
    try:
        fitting = _first_fitting(chunked, most, region, request.budget_bytes, weights)
    except InfeasibleBudgetError as exc:
        if unchunked is None and exc.min_budget_bytes >= floor:  # chunks may not go lower: compare
            unchunked = as_traced()
            if isinstance(unchunked, tuple):
                return unchunked
        if unchunked is None or exc.min_budget_bytes < unchunked.min_budget_bytes:
            raise _with_chunks(exc, most) from None
        raise unchunked from None
    best = _fewer_while_faster(chunked, fitting) if _fewer_may_gain(fitting[0], request.device) else fitting
    if best is fitting:
        best = _fastest_chunks(chunked, fitting, lm_head_flops, most,
                               lambda planned, chunks: _more_may_gain(planned, chunks, region, sites, request))
    log.info("fxmem: the loss is computed in %d chunks of tokens", best[0].loss_chunks)
    return best


def _weights_floor(gm: torch.fx.GraphModule) -> int:
    """A lower bound on any plan's peak: the parameters and, at backward's end, the trained ones' gradients."""
    return sum(p.numel() * p.element_size() * (1 + p.requires_grad) for p in gm.parameters())


def _first_fitting(chunked: Callable[[int], tuple[Any, Any]], most: int, region: int, budget: int,
                   floor: int) -> tuple[Any, Any]:
    """The plan of the first count that fits among `START_CHUNKS`, twice it, ... up to `most`; after a count
    whose least, less all the loss `region` more chunks could still free, is above `budget`, `most` next, and
    `most` first where the budget is below the weights' `floor`. Raises `most`'s InfeasibleBudgetError where
    none fits."""
    chunks = most if budget < floor else min(START_CHUNKS, most)
    while True:
        try:
            return chunked(chunks)
        except InfeasibleBudgetError as exc:
            if chunks >= most:
                raise
            hopeless = exc.min_budget_bytes - region * (1 / chunks - 1 / most) > budget
            log.info("fxmem: loss in %d chunks: least budget %s", chunks, fmt_bytes(exc.min_budget_bytes))
            chunks = most if hopeless else 2 * chunks


def _fewer_may_gain(plan: Any, device: Any) -> bool:
    """Whether the loss in fewer chunks than `plan`'s may be predicted faster by `MIN_STEP_GAIN` of its step: fewer
    chunks save only their ops' per-op overhead (the same FLOPs and bytes in fewer, larger ops; the larger
    loss region leaves no less to recompute), at most `OPS_PER_CHUNK` for each chunk down to 2. Each count
    tried is a whole trace and plan: seconds to minutes, where the gain can be a fraction of a millisecond."""
    saved_s = (plan.loss_chunks - 2) * OPS_PER_CHUNK * device.op_overhead_s
    if saved_s >= MIN_STEP_GAIN * plan.predicted_step_s:
        return True
    log.info("fxmem: fewer loss chunks than %d save at most %.2f ms of a %.1f ms step: not planned",
             plan.loss_chunks, 1e3 * saved_s, 1e3 * plan.predicted_step_s)
    return False


def _more_may_gain(planned: tuple[Any, Any], chunks: int, region: int, sites: list[LossSite], request: Any) -> bool:
    """Whether the loss in `chunks` chunks may be predicted faster than `planned` by `MIN_STEP_GAIN` of its step:
    what its plan's decision would stop recomputing with the room more chunks free (`region` shrinks as 1/chunks)
    at every step (`fitting.recompute_saved_s`, an estimate from above), less the ops the chunks add (and the lm
    head's matmul once more, from 1 chunk). Always where the planner kept no decision to estimate from, and under
    Inductor (whose fused step frees more than the planner's graphs show)."""
    plan, step = planned
    decided = getattr(getattr(step, "planner", None), "decided", None)
    if decided is None or request.inner == "inductor":
        return True
    had = getattr(plan, "loss_chunks", 1) or 1
    added_s = (chunks - had) * OPS_PER_CHUNK * request.device.op_overhead_s
    if had == 1:
        added_s += sum(request.device.seconds(site.lm_head_flops(), 0, site.dtype) for site in sites)
    room = int(region * (1 / had - 1 / chunks))
    saved_s = recompute_saved_s(*decided, room, relax_seconds(request.time_limit_s))
    if saved_s - added_s >= MIN_STEP_GAIN * plan.predicted_step_s:
        return True
    log.info("fxmem: the loss in %d chunks would save at most %.2f ms of a %.1f ms step: not planned", chunks,
             1e3 * (saved_s - added_s), 1e3 * plan.predicted_step_s)
    return False


def _fewer_while_faster(chunked: Callable[[int], tuple[Any, Any]], fitting: tuple[Any, Any]) -> tuple[Any, Any]:
    """From `fitting`, half its chunks, and half again, while each fits with the decision of the count before (its
    slack spent, `shape_reuse.seeds_only`) and is predicted faster; the fastest. Fewer chunks save only their own
    ops: a count that needs more recomputed than the count before is hardly ever faster, and is not solved (a
    whole solve, most of a plan's time, for a few ops)."""
    best, chunks = fitting, fitting[0].loss_chunks // 2
    while chunks >= 2:
        try:
            with shape_reuse.seeds_only():
                candidate = chunked(chunks)
        except (InfeasibleBudgetError, shape_reuse.SeedDoesNotFit):
            break
        if candidate[0].predicted_step_s >= best[0].predicted_step_s:
            break
        best, chunks = candidate, chunks // 2
    return best


def traced_floor(gm: torch.fx.GraphModule, sites: list[LossSite]) -> int:
    """A lower bound on the peak of any plan with the loss as traced: the parameters, held for the whole
    step, and a site's log-softmax output and its gradient (tokens x vocab each), alive together in its
    backward whatever is kept or recomputed. Where a budget is below it, the loss as traced is not
    planned; where chunks name a least below it, it is not planned to compare."""
    params = sum(p.numel() * p.element_size() for p in gm.parameters())
    return params + max(2 * site.tokens * site.vocab * site.dtype.itemsize for site in sites)


def _fastest_chunks(chunked: Callable[[int], tuple[Any, Any]], fitting: tuple[Any, Any], lm_head_flops: int,
                    most: int, may_gain: Callable[[tuple[Any, Any], int], bool] = lambda planned, chunks: True
                    ) -> tuple[Any, Any]:
    """From the plan of the fewest chunks that fits (`fitting`, 1 where the loss as traced fits), the
    fastest predicted of it and twice, four times, ... its chunks (up to `most`): each count frees more
    of the loss region, so that less is recomputed, while chunking's own cost (the lm head's matmul once
    more) is the same at every count. Doubling stops where a count does not fit, where a count above 2
    is not faster than half of it by `MIN_STEP_GAIN` of the step (the next count frees half as much room),
    after a plan that recomputes no more than the lm head's matmul (no count can then be faster), or before
    a count that `may_gain(planned, chunks)` says cannot be faster."""
    best = previous = fitting
    chunks = 2 * getattr(fitting[0], "loss_chunks", 1)
    while previous[0].extra_flops > lm_head_flops and chunks <= most and may_gain(previous, chunks):
        try:  # (a chunked plan's extra_flops count the lm head's)
            candidate = chunked(chunks)
        except InfeasibleBudgetError:
            break
        if candidate[0].predicted_step_s < best[0].predicted_step_s:
            best = candidate
        if chunks > 2 and previous[0].predicted_step_s - candidate[0].predicted_step_s < \
                MIN_STEP_GAIN * previous[0].predicted_step_s:
            break  # twice as many free half as much again: gaining under 2% here, they would gain less
        previous, chunks = candidate, chunks * 2
    return best


def fewest_fitting(chunked: Callable[[int], tuple[Any, Any]], most: int, best: tuple[Any, Any],
                   what: str) -> tuple[Any, Any]:
    """The plan of the fewest chunks among the powers of two below `most` that `chunked` plans without
    raising InfeasibleBudgetError, bisected; `best` (planned at `most`) where none does. `what` % chunks
    names a refused count in the log."""
    low, high = 0, most.bit_length() - 1  # exponents: 2**low does not fit, 2**high does
    while high - low > 1:
        middle = (low + high) // 2
        try:
            best, high = chunked(2 ** middle), middle
        except InfeasibleBudgetError as exc:
            log.info("fxmem: %s: least budget %s", what % 2 ** middle, fmt_bytes(exc.min_budget_bytes))
            low = middle
    return best


def _with_chunks(exc: InfeasibleBudgetError, chunks: int) -> InfeasibleBudgetError:
    """`exc` saying the least budget it names has the loss computed in `chunks` chunks."""
    exc.loss_chunks = chunks
    exc.args = (f"{exc.args[0]} (least with the loss computed in {chunks} chunks of tokens)",)
    return exc
