"""The contiguous-partition programme (fxmem/solve/partition.py) against brute force."""
from __future__ import annotations

import itertools
import random

import pytest

from fxmem.solve.partition import min_max_partition


def _brute(n, parts, cost, allow_empty):
    best = None
    least = 0 if allow_empty else 1
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = [0, *cuts, n]
        runs = list(zip(bounds, bounds[1:]))
        if any(stop - first < least for first, stop in runs):
            continue
        costs = [cost(f, s, k) for k, (f, s) in enumerate(runs)]
        if any(c is None for c in costs):
            continue
        if best is None or max(costs) < best:
            best = max(costs)
    return best


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("allow_empty", [False, True])
def test_least_costliest_run_equals_brute_force(seed, allow_empty):
    rng = random.Random(seed)
    n, parts = rng.randint(1, 7), rng.randint(1, 4)
    w = [rng.randint(1, 9) for _ in range(n)]
    caps = [rng.randint(5, 25) for _ in range(parts)]

    def cost(first, stop, k):  # a run's weight, and a per-part capacity
        total = sum(w[first:stop])
        return total if total <= caps[k] else None

    runs = min_max_partition(n, parts, cost, allow_empty=allow_empty)
    want = _brute(n, parts, cost, allow_empty)
    if want is None:
        assert runs is None
        return
    assert [r[0] for r in runs][0] == 0 and runs[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert max(cost(f, s, k) for k, (f, s) in enumerate(runs)) == want


def test_ties_go_to_the_earliest_or_latest_cut():
    flat = lambda first, stop, k: 1.0  # noqa: E731 - every run costs the same
    assert min_max_partition(4, 2, flat) == [(0, 1), (1, 4)]
    assert min_max_partition(4, 2, flat, prefer_late_cuts=True) == [(0, 3), (3, 4)]
    assert min_max_partition(2, 3, flat) is None
