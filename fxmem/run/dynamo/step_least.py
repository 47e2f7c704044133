"""The least budget of a step that `torch.compile(model, backend="fxmem")` splits into graphs, named for the
graphs together, and met by the next compile.

The backend plans a step graph by graph, as Dynamo hands them over, with no model to probe for the graphs still
to come (`fxmem.optimize`'s Dynamo path probes first: `fxmem.run.dynamo.step`). So a graph whose least is above
the budget, where Dynamo ended it at a graph break (more graphs follow), is not refused at once: it is planned at
its least, and the refusal waits for the graph that ends the frame. Then every graph's least is known (each
planner kept its joint graph), and the least the step needs is theirs together (`shared_budget.need`): a budget
below it is refused, naming it; the graphs at their least are kept in memory under the first graph's
fingerprint and the compile settings, so that the next compile of the same step (at the least named, or above)
plans each graph with the share that leaves the later graphs room (`RecordingPlanner`), as the probed path does.
Where the budget reaches what the graphs need together but a graph planned alone kept the room a later one needs,
the error says to compile again (after `torch._dynamo.reset()`), which plans them together at that budget.

Reads the ledger's records; writes the in-process memo (`MEMO_SIZE` steps).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fxmem.errors import FxmemError, fmt_bytes
from fxmem.planner.margin import margin_for
from fxmem.run.dynamo.ledger import GraphRecord, Ledger
from fxmem.run.dynamo.shared_budget import GraphShare, least_plan, need, refusal

MEMO_SIZE = 16
_SHARES: OrderedDict[tuple, list[GraphShare]] = OrderedDict()


def _key(fingerprint: str, settings: Any) -> tuple:
    return fingerprint, settings.inner, repr(settings.device), settings.solver


def waits(ledger: Ledger, record: GraphRecord) -> bool:
    """Whether a refusal of `record`'s graph is settled for the step's graphs together: on the backend's own path
    (no probe of the step: no survey), where more graphs follow (Dynamo ended it at a graph break) or graphs came
    before it."""
    return ledger.survey is None and (record.breaks or any(r is not record for r in ledger.latest()))


def pending(ledger: Ledger, record: GraphRecord) -> bool:
    """Whether `record`'s graph ends a frame in which a graph's refusal waits (its own included)."""
    return ledger.survey is None and not record.breaks and (record.refused or any(r.refused for r in ledger.latest()))


def settle(ledger: Ledger, last: GraphRecord, settings: Any) -> None:
    """At the graph that ends the frame (`last`, planned, not yet recorded) where some graph's least was above the
    budget: every graph's least, kept for the next compile; raises the step's refusal where the budget is below
    what they need together, else an error saying to compile again (they are then planned together)."""
    records = [r for r in ledger.latest() if r is not last and r.planner is not None] + [last]
    shares = [_share(ledger, r) for r in records]
    key = _key(records[0].planner.fingerprint, settings)
    _SHARES[key] = shares
    _SHARES.move_to_end(key)
    while len(_SHARES) > MEMO_SIZE:
        _SHARES.popitem(last=False)
    budget, (least, total, k) = ledger.budget_bytes, _least(shares)
    if budget < least:
        raise refusal(budget, shares, total, k)
    raise FxmemError(f"budget {fmt_bytes(budget)} reaches the least this step's {len(shares)} graphs need together, "
                     f"{fmt_bytes(least)}, but they were planned one by one and an earlier graph kept the room a later "
                     "one needs; call torch._dynamo.reset() and compile again: the graphs are then planned together "
                     "at this budget")


def remembered(fingerprint: str, settings: Any, budget: int) -> list[GraphShare] | None:
    """The graphs at their least kept for a step whose first graph is `fingerprint`, where `budget` reaches
    what they need together (else None: the step is planned, and refused, as before)."""
    shares = _SHARES.get(_key(fingerprint, settings))
    return shares if shares is not None and budget >= _least(shares)[0] else None


def _least(shares: list[GraphShare]) -> tuple[int, int, int]:
    """(least budget, the bytes the graphs need together, the graph where they peak), margin included in the first."""
    total, k = need([s.peak for s in shares], [s.saved for s in shares])
    return margin_for(shares[0].plan.device).least_budget(total), total, k


def _share(ledger: Ledger, record: GraphRecord) -> GraphShare:
    """`record`'s graph at its least: its peak less what the graphs before it keep, as `need` adds them."""
    planner = record.planner
    with unset_fake_temporarily(), torch._guards.tracing(None):  # an earlier graph's fakes are of its own mode
        plan, bound = least_plan(planner, planner.joint, planner.fingerprint)
    return GraphShare(record.index, planner.request.capture, plan.predicted_peak_bytes - ledger.earlier_saved(record),
                      plan.saved_bytes, plan, bound)


def forget() -> None:
    """Drop every kept step (tests)."""
    _SHARES.clear()
