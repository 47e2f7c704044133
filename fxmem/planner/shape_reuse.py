"""A decision made for one input shape, tried first on the next shape of the same step.

A run whose sequence length or batch varies (padding buckets, the last smaller batch) traces a joint graph
per shape, and these graphs differ only in sizes: the same nodes, names and ops. The planner keeps, per
process, the decision it chose (the values recomputed and offloaded, by node name) under the graph's
structure (`structure_key`: every node's name, op, target and dtype, no shape) and the request without its
input signature. For a new shape it simulates that decision on the new graph first: where the simulated
peak fits the budget less its margin, that decision is the plan (`Plan.solver` "reused"), with no solve;
where it does not, the planner solves as for any graph and keeps its answer in turn. The budget is
checked on the new sizes every time, so a reused plan keeps the same promise as a solved one; it may
recompute more than a plan solved for the smaller shape would (its slack is not spent).

The number of chunks the loss was computed in (`fxmem.planner.loss_chunks`) is kept the same way, under the
captured graph's structure: a new shape plans that count first and searches only where it does not fit. Within
one search over chunk counts (`one_step`), each count after the first starts from the decision of the count
before (the blocks' nodes keep their names), its slack spent, and is solved afresh only where that does not fit;
inside `seeds_only` it is not solved at all there (`SeedDoesNotFit`). A model's next graph of another structure (its
step with the outputs dropped, after the one that held them) starts from the model's last decision (`seeded_by`).

A chunk count refused with a least above the budget is kept too (`keep_refusal`): planned again at a budget below that
least, the count is refused at once (`known_refusal`), as searching would, without a trace (the step named its least,
and the next call, at that least, plans only the counts that may fit it).

Reads joint graphs and planner requests; writes nothing but the in-process memos (`MEMO_SIZE` entries each).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import torch.fx

from fxmem.errors import InfeasibleBudgetError
from fxmem.planner.fitting import spend_slack
from fxmem.planner.plan import graph_fingerprint
from fxmem.solve.problem import repair
from fxmem.solve.solution import Solution, make_solution

log = logging.getLogger("fxmem")

MEMO_SIZE = 64
_DECISIONS: OrderedDict[str, tuple[str, frozenset[str], frozenset[str]]] = OrderedDict()  # + the graph's fingerprint
_step = threading.local()  # .seed: names the last plan of the step planned now recomputes (`one_step`)
_CHUNKS: OrderedDict[str, tuple[str, int]] = OrderedDict()  # captured step -> (its fingerprint, the loss's chunk count)
_REFUSED: OrderedDict[tuple, Any] = OrderedDict()  # (captured step and request but its budget, chunks) -> refusal


class SeedDoesNotFit(Exception):
    """Inside `seeds_only`: the decision of the step's previous graph does not fit this one, which is not solved."""


def structure_key(gm: torch.fx.GraphModule) -> str:
    """Hash of (name, op, target, dtype) over every node: equal for the graphs of one step traced at other
    sizes."""
    return graph_fingerprint(gm, shapes=False)


def decision_key(gm: torch.fx.GraphModule, request: Any, extra: Any = None) -> str:
    """The memo's key: the graph's structure and every request field but those that change with the sizes: the
    input signature, the bytes the step's other graphs hold, and the loss's description."""
    fields = {f.name: repr(getattr(request, f.name)) for f in dataclasses.fields(request)
              if f.name not in ("signature", "held_bytes", "loss", "plan", "cache")}
    text = repr((structure_key(gm), sorted(fields.items()), extra))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def remember(key: str, fingerprint: str, nodes: Sequence[torch.fx.Node], recompute: frozenset[int],
             offloaded: frozenset[int]) -> None:
    """Keep the decision (candidate indices into `nodes`) by node name under `key`, made for the graph
    `fingerprint` (`fxmem.planner.plan.graph_fingerprint`)."""
    _DECISIONS[key] = (fingerprint, frozenset(nodes[i].name for i in recompute),
                       frozenset(nodes[i].name for i in offloaded))
    _DECISIONS.move_to_end(key)
    while len(_DECISIONS) > MEMO_SIZE:
        _DECISIONS.popitem(last=False)


def recall(key: str, fingerprint: str, nodes: Sequence[torch.fx.Node]) -> tuple[frozenset[int], frozenset[int]] | None:
    """The decision kept under `key` for another shape, as candidate indices into `nodes`; None where none is
    kept, where it was made for this very graph (`fingerprint`: planned again, it is solved again, as the
    first time), or where a name it holds is not a candidate here."""
    found = _DECISIONS.get(key)
    if found is None or found[0] == fingerprint:
        return None
    index = {node.name: i for i, node in enumerate(nodes)}
    _, recompute, offloaded = found
    if not (recompute | offloaded) <= index.keys():
        return None
    return frozenset(index[n] for n in recompute), frozenset(index[n] for n in offloaded)


def keep_chunks(key: str, fingerprint: str, chunks: int) -> None:
    """Keep the number of chunks the loss of the step under `key` was planned in, for the graph `fingerprint`."""
    _CHUNKS[key] = (fingerprint, chunks)
    _CHUNKS.move_to_end(key)
    while len(_CHUNKS) > MEMO_SIZE:
        _CHUNKS.popitem(last=False)


def kept_chunks(key: str, fingerprint: str) -> int | None:
    """The chunk count kept under `key` for another shape; None where none is, or it was for this very graph."""
    found = _CHUNKS.get(key)
    return None if found is None or found[0] == fingerprint else found[1]


def reused(key: str, fingerprint: str, lowered: Any, simulate: Callable[[frozenset[int], frozenset[int]], Any],
           target: int) -> tuple[Any, Solution, None] | None:
    """(candidate, solution, no least) for the decision kept under `key` for another shape, where
    `simulate(recompute, offloaded)`'s candidate peaks at most `target` bytes on this graph (`lowered`:
    `fxmem.price.joint_problem.Lowered`); else None."""
    found = recall(key, fingerprint, lowered.nodes)
    if found is None:
        return None
    started = time.perf_counter()
    candidate = simulate(*found)
    if candidate.timeline.peak > target:
        log.info("the decision kept from another shape peaks at %d bytes here: solving", candidate.timeline.peak)
        return None
    return candidate, make_solution(lowered.problem, found[0], "feasible", 0, started, "reused", found[1]), None


@contextlib.contextmanager
def one_step() -> Iterator[None]:
    """Plans made inside are of one step (the graphs of its loss in several chunk counts, `fxmem.planner.loss_chunks`):
    each after the first starts from the decision the one before chose (`seeded`)."""
    outer = getattr(_step, "seed", None)
    _step.seed = outer or frozenset()  # the first graph from the decision `seeded_by` gives, where one does
    try:
        yield
    finally:
        _step.seed = outer


@contextlib.contextmanager
def seeded_by(names: frozenset[str]) -> Iterator[None]:
    """Plans made inside start from the decision `names` (recomputed nodes, by name) as `one_step`'s later graphs
    do (`seeded`), where its names are candidates of theirs: the model's last plan, for a graph of another
    structure (the step that drops its outputs, once the loop is seen dropping them, after the one that held
    them; nodes keep their names). Nothing where `names` is empty."""
    if not names:
        yield
        return
    outer = getattr(_step, "seed", None)
    _step.seed = frozenset(names)
    try:
        yield
    finally:
        _step.seed = outer


@contextlib.contextmanager
def seeds_only() -> Iterator[None]:
    """Inside `one_step`, plans made inside take the previous graph's decision (`seeded`) or raise
    `SeedDoesNotFit`: for a graph whose plan can gain little over the one before (the loss in fewer chunks)."""
    _step.only = True
    try:
        yield
    finally:
        _step.only = False


def unseeded() -> None:
    """Raise `SeedDoesNotFit` inside `seeds_only` (the planner calls this before solving afresh)."""
    if getattr(_step, "only", False):
        raise SeedDoesNotFit


def keep_seed(nodes: Sequence[torch.fx.Node], recompute: frozenset[int]) -> None:
    """Inside `one_step`, keep the decision just chosen (by node name) for the step's next graph."""
    if getattr(_step, "seed", None) is not None:
        _step.seed = frozenset(nodes[i].name for i in recompute)


def seeded(lowered: Any, simulate: Callable[..., Any], target: int, relax_s: float) -> tuple[Any, Solution, None] | None:
    """(candidate, solution, no least) from the decision kept by `keep_seed` for another graph of this step: what
    it recomputes that this graph has (`repair`ed: what cannot be saved is recomputed with it), where its
    simulated peak is within `target`, then what it recomputes kept while the graphs stay within it
    (`fxmem.planner.fitting.spend_slack`); None outside `one_step`, before a decision, where offload is allowed
    (recompute only) or where it does not fit."""
    names = getattr(_step, "seed", None)
    problem = lowered.problem
    if not names or any(problem.can_offload):
        return None
    started = time.perf_counter()
    recompute = repair(problem, (i for i, node in enumerate(lowered.nodes) if node.name in names))
    candidate = simulate(recompute)
    if candidate.timeline.peak > target:
        return None
    solution = make_solution(problem, recompute, "feasible", 0, started, "seeded")
    return (*spend_slack(problem, candidate, solution, target, simulate, relax_s), None)


def refusal_key(gm: torch.fx.GraphModule, request: Any, fingerprint: str) -> tuple:
    """What a chunk count's refusal depends on: the captured graph (`fingerprint`, with its sizes) and the request
    but its budget."""
    unbudgeted = dataclasses.replace(request, budget_bytes=None)
    return decision_key(gm, unbudgeted, (request.signature, request.held_bytes)), fingerprint


def keep_refusal(key: tuple, chunks: int, refusal: Any) -> None:
    """Keep the refusal (an `InfeasibleBudgetError`) of the step under `key` (`refusal_key`) with its loss in `chunks`
    chunks: the least it names does not depend on the budget refused (the searches are deterministic)."""
    if type(refusal) is InfeasibleBudgetError and refusal.budget_bytes < refusal.min_budget_bytes \
            and not getattr(refusal, "bound_only", False):  # a least searched for, not a bound
        _REFUSED[(key, chunks)] = refusal
        _REFUSED.move_to_end((key, chunks))
        while len(_REFUSED) > MEMO_SIZE:
            _REFUSED.popitem(last=False)


def known_refusal(key: tuple, chunks: int, budget: int) -> Any:
    """The refusal of `budget` for the step under `key` in `chunks` chunks where one kept names a least above it (as
    planning it again would: the same least, the same parts, this budget), else None."""
    kept = _REFUSED.get((key, chunks))
    if kept is None or budget >= kept.min_budget_bytes:
        return None
    return InfeasibleBudgetError(budget, kept.min_budget_bytes, kept.breakdown, lower_bound_bytes=kept.lower_bound_bytes,
                                 proven=kept.proven)


def forget() -> None:
    """Drop every kept decision, chunk count and refusal (tests)."""
    _DECISIONS.clear()
    _CHUNKS.clear()
    _REFUSED.clear()
