"""One budget shared by the graphs Dynamo splits a training step into, so the least named is met.

Reads the planners of a probe of the step (`fxmem.run.dynamo.step.probe_step`: forward once more through
Dynamo, autograd on, no backward), which trace each graph's joint graph and price it with what the
rest of the step holds that no plan decides (other graphs' parameters, the tensors passed between
graphs, later graphs' gradients): its keep-all peak and saved bytes and, when keeping everything does not fit, its least peak and the
bytes its least plan keeps for backward. Returns the graphs at their least (`GraphShare`), which the
ledger uses to cap what each graph may keep for backward so that every later graph still fits its
least plan; refuses a budget below the least the graphs need together. Writes nothing.

While graph k runs, the graphs before it keep what they saved for their backward, so the step needs
max over k of (graph k's least peak + what graphs 0..k-1 keep at their least): the least budget found
for the step. Each graph's least is searched alone (not the pair of choices across graphs), so the
refusal says it is the least found, not proven. A graph planned for the budget may keep more than its
least plan does only while every later graph's least plan still fits on top (`saved_cap`). A graph a
loop calls once per layer (`fxmem.run.dynamo.layer_loops`) counts once per layer, its last run holding what its
earlier runs keep; it keeps its least plan, so that every run of it fits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from fxmem.errors import InfeasibleBudgetError, fmt_bytes, gb_at_least
from fxmem.planner.plan import Plan
from fxmem.planner.margin import Margin, margin_for
from fxmem.planner.planner import Planner


@dataclass(frozen=True)
class GraphShare:
    """One graph of the step at its least: its simulated peak with what the rest of the step holds but
    earlier graphs' saved values (`peak`), the bytes it keeps for backward (`saved`), the plan itself,
    and the least budget any plan of it could need, planning margin included (`lower_bound`)."""

    index: int
    where: str
    peak: int
    saved: int
    plan: Plan
    lower_bound: int
    runs: int = 1  # calls of this graph in the step that runs every layer (`fxmem.run.dynamo.layer_loops`)


def least_plan(planner: Planner, joint, fingerprint: str) -> tuple[Plan, int]:
    """The plan `planner` makes for `joint` at the least budget it names, and the least budget any plan of
    it could need (the proven bound, or that budget where lower)."""
    budget, bound = 1, 0
    for _ in range(3):
        try:
            plan = planner._plan_within(joint, fingerprint, budget)
        except InfeasibleBudgetError as exc:
            bound = exc.lower_bound_bytes or 0
            budget = max(budget + 1, exc.min_budget_bytes)
            continue
        return plan, min(bound, budget)
    raise RuntimeError(f"fxmem: {planner.request.capture} was refused at the least budget its planner named")


def need(peaks: Sequence[int], saved: Sequence[int], runs: Sequence[int] | None = None) -> tuple[int, int]:
    """(bytes, graph): the most the step holds while some graph runs at `peaks`, the graphs before it
    keeping `saved` per run; a graph run `runs` times in a row (a loop's layers) runs its last time
    with its earlier runs' saved values held too."""
    best, kept, worst = 0, 0, 0
    for k, (peak, keep) in enumerate(zip(peaks, saved)):
        times = runs[k] if runs is not None else 1
        if peak + kept + (times - 1) * keep > best:
            best, worst = peak + kept + (times - 1) * keep, k
        kept += times * keep
    return best, worst


def shares_for(planners: Sequence[Any], budget: int, eager_held: dict[int, int] | None = None,
               tail: tuple[int | None, int] = (None, 0)) -> list[GraphShare] | None:
    """None when every graph keeping everything fits `budget` (nothing to share); otherwise the graphs
    at their least, after checking the budget reaches what they need together. `eager_held`: per graph, what
    the eager code before it keeps for backward; `tail`: the last graph, and what the eager code after it adds
    at backward's start (`fxmem.run.dynamo.eager_held`), both beside each graph's peak."""
    def extra(index: int) -> int:
        return (eager_held or {}).get(index, 0) + (tail[1] if index == tail[0] else 0)

    eager = [p.plan for p in planners]
    margin = margin_for(eager[0].device)
    runs = [p.runs for p in planners]
    if need([e.predicted_peak_bytes + extra(p.record.index) for e, p in zip(eager, planners)],
            [e.saved_bytes for e in eager], runs)[0] + margin.bytes_for(budget) <= budget:
        return None
    shares = [p.least() for p in planners]
    shares = [dataclasses.replace(s, peak=s.peak + extra(s.index)) for s in shares]
    total, k = need([s.peak for s in shares], [s.saved for s in shares], runs)
    least = margin.least_budget(total)
    if budget < least:
        raise refusal(budget, shares, total, k)
    return shares


def refusal(budget: int, shares: Sequence[GraphShare], total: int, k: int) -> InfeasibleBudgetError:
    """The step's least found, graph by graph: says it is found graph by graph, not proven, and, where a
    graph runs once per layer, that it is planned for every layer running."""
    least = _margin(shares).least_budget(total)
    kept = sum(s.runs * s.saved for s in shares[:k]) + (shares[k].runs - 1) * shares[k].saved
    bound = max(s.lower_bound for s in shares)
    error = InfeasibleBudgetError(budget, least, {f"{shares[k].where} at its least": shares[k].peak,
                                                  "kept for backward by the graphs before it": kept,
                                                  "planning margin": least - total},
                                  lower_bound_bytes=bound, proven=False)
    error.args = (f"budget {fmt_bytes(budget)} is below the least budget found for this step's {len(shares)} graphs "
                  f"together, {fmt_bytes(least)} (proven >= {fmt_bytes(bound)}): {shares[k].where} needs "
                  f"{fmt_bytes(shares[k].peak)} at its least while the graphs before it keep {fmt_bytes(kept)} for "
                  f"backward, plus a planning margin of {fmt_bytes(least - total)}. Each graph's least is searched "
                  f"alone, so across graphs this is the least found, not proven; raise budget_gb to at least "
                  f"{gb_at_least(least)} (planned at that budget, every graph fits), lower the batch size, or "
                  "capture the model as one graph" + _looped(shares),)
    return error


def _looped(shares: Sequence[GraphShare]) -> str:
    """The sentence a refusal adds where a graph runs once per layer of a loop."""
    loops = [s for s in shares if s.runs > 1]
    if not loops:
        return ""
    return "; " + ", ".join(f"{s.where.split(',')[0]} runs up to {s.runs} times a step" for s in loops) + \
        " (once per layer of a loop: the least counts every layer running, as a step that skips none does)"


def saved_cap(shares: Sequence[GraphShare], index: int, budget: int, earlier: int) -> int | None:
    """The most graph `index` may keep for backward at `budget` (the graphs before it keeping
    `earlier`) so that every later graph's least plan still fits; None for the last graph."""
    later = shares[index + 1:]
    if not later:
        return None
    kept, most = 0, 0
    for share in later:
        most = max(most, share.peak + kept + (share.runs - 1) * share.saved)
        kept += share.runs * share.saved
    return (budget - _margin(shares).bytes_for(budget) - earlier - most) // shares[index].runs


def _margin(shares: Sequence[GraphShare]) -> Margin:
    """The planning margin of the device the graphs were planned for (the CPU's without a plan)."""
    plan = shares[0].plan if shares else None
    return margin_for(plan.device if plan is not None else "cpu")
