"""Placement of a model's regions on several devices: contiguous runs of units, in order.

Reads per-unit times and memory and per-device budgets (plain numbers, no torch); returns which
device each unit goes to. Exact dynamic program over split points (`fxmem.solve.partition`): device k takes units
[cut[k], cut[k+1]) (possibly none), the memory of each device stays within its budget, and the
slowest device is as fast as it can be (ties: the fewest units moved to later devices).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from fxmem.solve.partition import min_max_partition


@dataclass(frozen=True)
class Placement:
    """`device[u]`: device index of unit u; per device: total time and memory of its units."""

    device: tuple[int, ...]
    seconds: tuple[float, ...]
    memory: tuple[int, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.seconds, default=0.0)


class PlacementError(ValueError):
    """No contiguous placement fits the budgets."""


def place_regions(seconds: Sequence[float], memory: Sequence[int], budgets: Sequence[int | None]) -> Placement:
    """Assign units (in order) to devices (in order) in contiguous runs, each device's memory within its
    budget (None: no limit), minimising the largest per-device time. Raises PlacementError when nothing fits."""
    n, d = len(seconds), len(budgets)
    if len(memory) != n:
        raise ValueError(f"{len(memory)} memory entries for {n} units")
    if d == 0:
        raise ValueError("no devices to place on")
    t = [0.0, *accumulate(seconds)]
    m = [0, *accumulate(memory)]

    def run_cost(first: int, stop: int, k: int) -> float | None:
        fits = budgets[k] is None or m[stop] - m[first] <= budgets[k]
        return t[stop] - t[first] if fits else None

    runs = min_max_partition(n, d, run_cost, allow_empty=True, prefer_late_cuts=True)
    if runs is None:
        largest = max(memory, default=0)
        raise PlacementError(
            f"the model does not fit on {d} device(s) with budgets {list(budgets)} bytes: its regions need "
            f"{m[n]} bytes in all, the largest single region {largest}; raise budget_gb, add devices, or "
            "lower the batch size")
    device = [k for k, (first, stop) in enumerate(runs) for _ in range(first, stop)]
    per_time = tuple(sum(s for s, dev in zip(seconds, device) if dev == k) for k in range(d))
    per_mem = tuple(sum(b for b, dev in zip(memory, device) if dev == k) for k in range(d))
    return Placement(tuple(device), per_time, per_mem)
