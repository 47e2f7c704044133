"""Contiguous partition: split units 0..n-1, in order, into a fixed number of runs so that the costliest
run is as cheap as it can be. Pipeline stages (`fxmem.solve.stages`) and device placement
(`fxmem.solve.placement`) are both this programme with their own run cost.

Reads a cost function over runs; returns the runs. Plain Python, exact, O(parts * n^2) cost calls.
"""
from __future__ import annotations

import math
from typing import Callable

RunCost = Callable[[int, int, int], "float | None"]  # (first, stop, part) -> cost, None where the run can't be


def min_max_partition(n: int, parts: int, cost: RunCost, *, allow_empty: bool = False,
                      prefer_late_cuts: bool = False) -> list[tuple[int, int]] | None:
    """Runs [first, stop) for parts 0..parts-1 covering 0..n-1 in order, minimising the largest
    `cost(first, stop, part)`; None when no split has a cost for every run. Without `allow_empty`
    every run holds at least one unit. Ties go to the earliest cut, or with `prefer_late_cuts` to
    the latest (fewer units on later parts)."""
    if parts <= 0 or (not allow_empty and parts > n):
        return None
    inf = math.inf
    # best[k][j]: least max cost putting units [0, j) on parts 0..k; start[k][j]: where part k begins
    best = [[inf] * (n + 1) for _ in range(parts)]
    start = [[-1] * (n + 1) for _ in range(parts)]
    least = 0 if allow_empty else 1
    for j in range(least, n + 1):
        c = cost(0, j, 0)
        if c is not None:
            best[0][j], start[0][j] = c, 0
    for k in range(1, parts):
        for j in range(n + 1):
            firsts = range(j - least, -1, -1) if prefer_late_cuts else range(0, j - least + 1)
            for i in firsts:
                if best[k - 1][i] == inf:
                    continue
                c = cost(i, j, k)
                if c is None:
                    continue
                value = max(best[k - 1][i], c)
                if value < best[k][j]:
                    best[k][j], start[k][j] = value, i
    if best[parts - 1][n] == inf:
        return None
    runs, j = [], n
    for k in range(parts - 1, -1, -1):
        i = start[k][j]
        runs.append((i, j))
        j = i
    return runs[::-1]
