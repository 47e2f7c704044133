"""fxmem.dist.fsdp_search on synthetic block plans (no model): a block plan is worth to a rank of n blocks
(n - 1) x what it saves + its own peak, so a block plan that holds less in its own step but saves more loses to
whole-step in a deep rank and wins in a shallow one; above whole-step, the plan recomputing least that fits is
taken, and nothing over the budget is."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from fxmem.dist.fsdp_search import Search, rank_quantity
from fxmem.errors import InfeasibleBudgetError

BASE = 1000  # what the rank holds beside its blocks' plans


@dataclass(frozen=True)
class Block:
    predicted_peak_bytes: int
    saved_bytes: int
    extra_flops: int


@dataclass(frozen=True)
class Rank:
    predicted_peak_bytes: int


WHOLE = Block(200, 0, 100)  # saves nothing but its inputs, recomputes the most
LEAST = Block(120, 30, 80)  # the block's least own peak, saving more


def block_at(budget: int) -> Block:
    """Above the least, a block budget buys saved bytes and less recompute; below it, a refusal naming it."""
    if budget < LEAST.predicted_peak_bytes:
        raise InfeasibleBudgetError(budget, LEAST.predicted_peak_bytes)
    if budget < WHOLE.predicted_peak_bytes:
        return LEAST
    return Block(budget, (budget - 200) // 2, max(0, 100 - (budget - 200) // 4))


def search(blocks: int, budget: int, rounds: int = 5):
    calls = []

    def plan_block(block_budget: int) -> Block:
        calls.append(block_budget)
        return block_at(block_budget)
    return Search(blocks, budget, plan_block, lambda b: Rank(BASE + rank_quantity(b, blocks)), rounds), calls


@pytest.mark.parametrize("blocks, least_simulated", [(32, False), (2, True)])
def test_the_least_weighs_saved_bytes_by_the_blocks(blocks, least_simulated):
    found, calls = search(blocks, budget=1)
    assert found.run(WHOLE, lambda: 600, BASE + 600 * blocks) is None  # nothing fits one byte
    assert calls == [1, LEAST.predicted_peak_bytes]  # the refusal names the block's least, planned next
    simulated = [plan for plan, _ in found.ranks]
    assert simulated == ([WHOLE, LEAST] if least_simulated else [WHOLE])
    lowest = min(found.ranks, key=lambda pr: pr[1].predicted_peak_bytes)[0]
    assert lowest == (LEAST if blocks == 2 else WHOLE)


def test_above_whole_step_the_least_recompute_that_fits():
    blocks, budget = 8, BASE + 8 * 400
    found, calls = search(blocks, budget, rounds=4)
    chosen = found.run(WHOLE, lambda: 600, BASE + 600 * blocks)
    assert chosen is not None and chosen.extra_flops < WHOLE.extra_flops
    assert BASE + rank_quantity(chosen, blocks) <= budget
    assert all(r.predicted_peak_bytes <= budget or p is not chosen for p, r in found.ranks)
    assert len(calls) <= 4


def test_whole_step_that_fits_nothing_above_is_kept():
    blocks = 8
    budget = BASE + rank_quantity(WHOLE, blocks)  # whole-step exactly: every plan above saves more
    found, _ = search(blocks, budget, rounds=3)
    assert found.run(WHOLE, lambda: 600, BASE + 600 * blocks) == WHOLE
