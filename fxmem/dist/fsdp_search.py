"""The block plan of an FSDP2 rank chosen for the rank's peak, not one block's.

Reads block plans (`fxmem.planner.plan.Plan`: one block's peak and the bytes it saves for backward) and the
rank figures a simulation gives, both through callables that `fxmem.fsdp.plan_fsdp` hands in; writes nothing.
A rank of `n` blocks holds, at backward's start, every block's saved bytes and then one block's own step, so
a block plan is worth, to the rank, about `rank_quantity` = (n - 1) x its saved bytes + its peak: a byte saved
costs the rank n - 1 bytes, a byte of the block's own step one. The search ranks block plans by that quantity
and simulates (the truth) only the ones the quantity puts in reach of the budget:

- whole-step (`policy="whole-step"`: only the block's inputs saved) first: the least any block plan saves.
- where its rank fits, block budgets below the block's keep-all peak, the first placed by the rank's overshoot
  shared by about half the blocks, then on the line through the nearest rank peaks on either side of the budget, each
  simulated where its quantity is near the budget (a plan recomputing less that still fits is taken);
- where it does not (or for the least), block budgets below its peak, down to the block's least: a plan
  that holds less in its own step may save a little more and still hold less as a rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fxmem.errors import InfeasibleBudgetError

CLOSE = 0.01  # a plan within 1% below the budget is taken


def rank_quantity(block_plan: Any, blocks: int) -> int:
    """What a block plan adds to a rank of `blocks` blocks, about: its saved bytes held by every block but the
    one running, and that one's step peak (its saved bytes among them)."""
    return (blocks - 1) * block_plan.saved_bytes + block_plan.predicted_peak_bytes


@dataclass
class Search:
    """One rank's block search. `plan_block(budget_bytes)` plans one block under a block budget (raising
    InfeasibleBudgetError naming the block's least); `simulate(block_plan)` returns the rank it gives (an
    object with `predicted_peak_bytes`), cached by the caller; `rounds` bounds the block plans solved."""
    blocks: int
    budget: int
    plan_block: Callable[[int], Any]
    simulate: Callable[[Any], Any]
    rounds: int
    ranks: list = field(default_factory=list)  # (block plan, its simulated rank), in the order simulated

    def _rank(self, block_plan: Any) -> Any:
        rank = self.simulate(block_plan)
        self.ranks.append((block_plan, rank))
        return rank

    def run(self, whole: Any, keep_peak: Callable[[], int], keep_rank: int) -> Any | None:
        """The block plan whose simulated rank fits the budget with the least extra compute, or None; `whole`
        the block's whole-step plan, `keep_peak()`/`keep_rank` the block's and the rank's peak keeping all."""
        base = self._rank(whole)
        if base.predicted_peak_bytes > self.budget:
            self._below(whole)
            fitting = [(p, r) for p, r in self.ranks if r.predicted_peak_bytes <= self.budget]
            return min(fitting, key=lambda pr: pr[0].extra_flops)[0] if fitting else None
        return self._above(whole, base.predicted_peak_bytes, keep_peak(), keep_rank)

    def _above(self, whole: Any, whole_rank: int, keep_peak: int, keep_rank: int) -> Any:
        """Whole-step fits: block budgets up to the keep-all peak (which does not fit), for the plan that fits
        with the least extra compute. The first is the keep-all peak less the rank's overshoot over the slope
        `_between` assumes."""
        best, low, high = whole, 0, keep_peak
        points = [(keep_peak, keep_rank)]
        known = {_key(whole): whole_rank}  # decision -> its rank peak, simulated or (over the budget) its quantity
        for _ in range(self.rounds):
            target = _between(points, self.budget, low, high, self.blocks)
            if target is None:
                break
            try:
                block_plan = self.plan_block(target)
            except InfeasibleBudgetError as exc:  # below the block's least: raise the floor
                low = max(low, exc.min_budget_bytes - 1)
                continue
            key = _key(block_plan)  # the same decision at another block budget is not simulated again
            if key not in known:
                quantity = rank_quantity(block_plan, self.blocks) - rank_quantity(whole, self.blocks) + whole_rank
                over = quantity > self.budget + CLOSE * self.budget  # not worth simulating: over by the quantity
                known[key] = quantity if over else self._rank(block_plan).predicted_peak_bytes
                if known[key] <= self.budget and block_plan.extra_flops < best.extra_flops:
                    best = block_plan
            peak = known[key]
            points.append((target, peak))
            if peak <= self.budget:
                low = max(low, target)
                if self.budget - peak <= CLOSE * self.budget:
                    break
            else:
                high = min(high, target)
        return best

    def _below(self, whole: Any) -> None:
        """The block's least plan (the least its own step holds), simulated where its rank quantity is below
        whole-step's: a block whose own step holds less may hold less as a rank though it saves more."""
        if self.rounds < 1:
            return
        try:
            try:
                block_plan = self.plan_block(1)
            except InfeasibleBudgetError as exc:  # the block's least, named by the refusal
                block_plan = self.plan_block(exc.min_budget_bytes)
        except InfeasibleBudgetError:  # the least named, not met again (a solver's limit): whole-step stays
            return
        if rank_quantity(block_plan, self.blocks) < rank_quantity(whole, self.blocks):
            self._rank(block_plan)


def _key(block_plan: Any) -> tuple:
    return block_plan.predicted_peak_bytes, block_plan.extra_flops, block_plan.saved_bytes


def _between(points: list[tuple[int, int]], budget: int, low: int, high: int, blocks: int) -> int | None:
    """The block budget whose rank meets `budget` on the line through the points (block budget, rank peak)
    nearest it on either side, kept strictly inside (`low`, `high`); None where that span is within 1% of the
    budget. With one side only, the slope is (blocks + 1) / 2 rank bytes per block byte: a byte less of block
    budget is a byte less of the block's own peak and between none and a byte less saved by every other block."""
    if high - low <= CLOSE * budget:
        return None
    under, over = [p for p in points if p[1] <= budget], [p for p in points if p[1] > budget]
    (b1, r1), slope = (max(under) if under else min(over)), (blocks + 1) / 2
    if under and over:
        b2, r2 = min(over)
        slope = (r2 - r1) / (b2 - b1) if b1 != b2 and r1 != r2 else slope
    guess = b1 + (budget - r1) / max(slope, 1e-3)
    if not low < guess < high:
        guess = (low + high) / 2
    return int(guess)
