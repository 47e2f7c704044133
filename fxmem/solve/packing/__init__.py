"""Offset planner: place buffers with known lifetimes in one arena so that buffers alive at the same
time never share a byte (dynamic storage allocation with known lifetimes).

Reads `(start, end, size)` triples (half-open lifetimes `[start, end)` in steps, sizes in bytes);
returns a frozen `Packing`. Torch-free: best-fit heuristics here; the same pipeline on blocks of merged
buffers (`fxmem.solve.packing.merge`: same-lifetime buffers stacked, same-size buffers chained), expanded
back; a skyline search (`fxmem.solve.packing.search`) per group of chained lifetimes; then OR-Tools CP-SAT
seeded with the best packing: on the whole packing (`fxmem.solve.packing.cpsat`) up to `LNS_ABOVE`
buffers, on windows of it (large-neighbourhood search, `fxmem.solve.packing.lns`) above, until the lower
bound is reached or the limit is spent. The limit is converted once into counted effort (`fxmem.solve.effort`:
`PLACE_US` per buffer placed, the skyline search's nodes, CP-SAT's deterministic time) that the stages share,
so the same buffers get the same offsets on every run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxmem.errors import PackingError
from fxmem.solve.effort import WORKERS, Effort
from fxmem.solve.packing.merge import components, merge_blocks

_BIG = np.int64(1) << 60
LNS_ABOVE = 150  # more sized buffers than this: windows re-solved by CP-SAT, not the whole packing
SKYLINE_SHARE = 0.6  # of the time limit, heuristics included, before CP-SAT
MERGED_SHARE = 0.6  # of the time limit, for packing merged blocks (`fxmem.solve.packing.merge`)
PLACE_US = 20.0  # effort units per buffer of one placement in an order (17-24 measured)


@dataclass(frozen=True)
class Packing:
    """Offsets (bytes, one per buffer, in input order) into an arena of `arena_bytes`.

    Sizes are rounded up to `alignment` before packing, so every offset is a multiple of it.
    `lower_bound_bytes` is the most (aligned) bytes alive at one time: no packing is smaller.
    `no_reuse_bytes` is what one allocation per buffer would take. `status` is "optimal" when the
    arena equals the bound (or CP-SAT proved it optimal), else "feasible"."""

    offsets: tuple[int, ...]
    arena_bytes: int
    lower_bound_bytes: int
    no_reuse_bytes: int
    alignment: int
    status: str
    method: str
    solve_time_s: float

    @property
    def gap(self) -> float:
        """How far the arena is above the lower bound, as a fraction of the bound."""
        return (self.arena_bytes - self.lower_bound_bytes) / self.lower_bound_bytes if self.lower_bound_bytes else 0.0


def _validate(buffers: Sequence[Sequence[int]], alignment: int, time_limit_s: float) -> np.ndarray:
    if isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer)) or alignment <= 0:
        raise PackingError(f"alignment must be a positive integer number of bytes, got {alignment!r}")
    if not isinstance(time_limit_s, (int, float)) or not time_limit_s >= 0:
        raise PackingError(f"time_limit_s must be a non-negative number of seconds, got {time_limit_s!r}")
    rows = []
    for i, buf in enumerate(buffers):
        try:
            start, end, size = buf
        except (TypeError, ValueError):
            raise PackingError(f"buffer {i} is {buf!r}; each buffer must be a (start, end, size) triple") from None
        for what, v in (("start", start), ("end", end), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise PackingError(f"buffer {i}: {what} must be an integer, got {v!r}")
        if size < 0:
            raise PackingError(f"buffer {i}: size {size} is negative; sizes are bytes >= 0")
        if end <= start:
            raise PackingError(f"buffer {i}: lifetime [{start}, {end}) is empty; lifetimes are half-open "
                               "[start, end) with end > start (a value used only where it is made has end = start + 1)")
        rows.append((int(start), int(end), int(size)))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def live_profile(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(times, live) where live[k] is the total size alive during [times[k], times[k+1])."""
    times = np.unique(np.concatenate([start, end]))
    delta = np.zeros(len(times) + 1, dtype=np.int64)
    np.add.at(delta, np.searchsorted(times, start), size)
    np.add.at(delta, np.searchsorted(times, end), -size)
    return times, np.cumsum(delta)[:-1]


def place(order: Sequence[int], start: np.ndarray, end: np.ndarray, size: np.ndarray, rule: str = "best"
          ) -> np.ndarray:
    """Place buffers one by one in `order`, each in a gap left by the already placed buffers alive at the
    same time: the smallest gap it fits ("best") or the lowest ("first"); above them all if none fits."""
    n = len(start)
    offsets = np.zeros(n, dtype=np.int64)
    ps, pe, po, pz = (np.empty(n, dtype=np.int64) for _ in range(4))
    k = 0
    for i in order:
        z = size[i]
        if z == 0:
            continue
        mask = (ps[:k] < end[i]) & (pe[:k] > start[i])
        lo = po[:k][mask]
        if lo.size:
            hi = lo + pz[:k][mask]
            idx = np.argsort(lo, kind="stable")
            lo, hi = lo[idx], hi[idx]
            gap_lo = np.concatenate(([0], np.maximum.accumulate(hi)))
            room = np.concatenate((lo, [_BIG])) - gap_lo
            fits = np.flatnonzero(room >= z)
            j = fits[np.argmin(room[fits])] if rule == "best" else fits[0]
            offsets[i] = gap_lo[j]
        ps[k], pe[k], po[k], pz[k] = start[i], end[i], offsets[i], z
        k += 1
    return offsets


def arena_of(offsets: np.ndarray, size: np.ndarray) -> int:
    return int((offsets + size).max(initial=0))


def heuristic_orders(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> dict[str, np.ndarray]:
    """Placement orders worth trying: largest first, longest-lived first, largest area first,
    earliest first; ties broken by the other keys."""
    length = end - start
    return {
        "largest-first": np.lexsort((start, -length, -size)),
        "longest-first": np.lexsort((start, -size, -length)),
        "area-first": np.lexsort((start, -size, -size * length)),
        "earliest-first": np.lexsort((-size, -length, start)),
    }


def best_heuristic(start: np.ndarray, end: np.ndarray, size: np.ndarray, time_limit_s: float | Effort = 1.0,
                   seed: int = 0) -> tuple[np.ndarray, str]:
    """The smallest arena over the named orders and both gap rules, then over random perturbations of the
    best order for about `time_limit_s` seconds. Returns (offsets, name of the winning order and rule)."""
    effort = Effort.of(time_limit_s)
    best: tuple[int, np.ndarray, str, np.ndarray] | None = None
    target = int(live_profile(start, end, size)[1].max(initial=0))
    for name, order in heuristic_orders(start, end, size).items():
        for rule in ("best", "first"):
            offsets = place(order, start, end, size, rule)
            arena = arena_of(offsets, size)
            if best is None or arena < best[0]:
                best = (arena, offsets, f"{name} {rule}-fit", order)
            if best[0] <= target:
                return best[1], best[2]
    assert best is not None
    rng = np.random.default_rng(seed)
    # Perturb the best order: random keys blended with its ranks (a cheap iterated greedy).
    while not effort.done() and best[0] > target:
        effort.spend(PLACE_US * len(start))
        ranks = np.empty(len(start), dtype=np.float64)
        ranks[best[3]] = np.arange(len(start))
        order = np.argsort(ranks + rng.normal(0, max(1.0, 0.05 * len(start)), len(start)), kind="stable")
        offsets = place(order, start, end, size, "best")
        arena = arena_of(offsets, size)
        if arena < best[0]:
            best = (arena, offsets, best[2].split(" +")[0] + " +perturbed", order)
    return best[1], best[2]


def check_packing(start: Sequence[int], end: Sequence[int], size: Sequence[int], offsets: Sequence[int]) -> None:
    """Raise PackingError naming two buffers alive at the same time whose byte ranges overlap."""
    s, e, z, o = (np.asarray(a, dtype=np.int64) for a in (start, end, size, offsets))
    if (o < 0).any():
        raise PackingError(f"buffer {int(np.flatnonzero(o < 0)[0])} has a negative offset")
    for i in range(len(s)):
        j = np.arange(i + 1, len(s))
        clash = (s[j] < e[i]) & (e[j] > s[i]) & (o[j] < o[i] + z[i]) & (o[j] + z[j] > o[i]) & (z[j] > 0) & (z[i] > 0)
        if clash.any():
            k = int(j[clash][0])
            raise PackingError(f"buffers {i} and {k} are alive at the same time and overlap in memory: "
                               f"[{o[i]}, {o[i] + z[i]}) and [{o[k]}, {o[k] + z[k]})")


def _skyline_by_group(start: np.ndarray, end: np.ndarray, size: np.ndarray, lower: int, offsets: np.ndarray,
                      groups: list[np.ndarray], effort: Effort, seed: int) -> np.ndarray:
    """Skyline search on each group of buffers (lifetimes chained together) on its own, highest arena first,
    in slices of the effort proportional to its buffers, until every group is at most `lower` (the bound of
    them all: a group with less alive at its peak has slack) or the effort is spent."""
    from fxmem.solve.packing.search import skyline_search

    offsets = offsets.copy()
    tried: set[int] = set()
    while True:
        over = [g for g, grp in enumerate(groups) if arena_of(offsets[grp], size[grp]) > lower]
        if not over or (effort.done() and tried):
            return offsets
        g = max(over, key=lambda g: arena_of(offsets[groups[g]], size[groups[g]]))
        grp = groups[g]
        share = len(grp) / sum(len(groups[h]) for h in over)
        part = effort.part(share if g not in tried else max(share, 0.5))
        tried.add(g)
        offsets[grp] = skyline_search(start[grp], end[grp], size[grp], lower, offsets[grp], part,
                                      seed + len(tried))


# (pairs, stack_first, rounds) of `merge_blocks`
MERGE_WAYS = ((False, False, 1 << 30), (False, True, 1 << 30), (True, False, 1 << 30), (True, True, 1 << 30),
              (True, False, 3))


def _merged(start: np.ndarray, end: np.ndarray, size: np.ndarray, lower: int, offsets: np.ndarray, method: str,
            effort: Effort, num_workers: int, seed: int) -> tuple[np.ndarray, str]:
    """`offsets` bettered group by group (of chained lifetimes) with packings of blocks merged in the ways
    of `MERGE_WAYS` (each goes wrong where another does not), each way given an even part of the effort
    left, less when merging hardly shrinks the instance."""
    offsets = offsets.copy()
    groups = components(start, end)
    seen: set[tuple[bool, bool, int]] = set()
    for n, (pairs, stack_first, rounds) in enumerate(MERGE_WAYS):
        over = [grp for grp in groups if arena_of(offsets[grp], size[grp]) > lower]
        if not over:
            break
        idx = np.concatenate(over)  # only the groups still above the bound
        blocks = merge_blocks(start[idx], end[idx], size[idx], rounds=rounds, pairs=pairs, stack_first=stack_first)
        kept = len(blocks.size) / max(1, int((size[idx] > 0).sum()))
        if kept >= 1 or (pairs, stack_first, len(blocks.size)) in seen:
            continue
        seen.add((pairs, stack_first, len(blocks.size)))
        part = effort.until(min(1.0, 2 * (1 - kept))).part(1 / (len(MERGE_WAYS) - n))
        found, how, _ = _pack_units(blocks.start, blocks.end, blocks.size, lower, part, num_workers, seed,
                                    merge=False)
        trial = offsets.copy()
        trial[idx] = blocks.expand(found)
        for grp in over:
            if arena_of(trial[grp], size[grp]) < arena_of(offsets[grp], size[grp]):
                offsets[grp] = trial[grp]
                method = f"merged blocks, {how}"
    return offsets, method


def _pack_units(start: np.ndarray, end: np.ndarray, size: np.ndarray, lower: int, effort: Effort,
                num_workers: int, seed: int, merge: bool = True) -> tuple[np.ndarray, str, bool]:
    """(offsets, method, proved optimal) for sizes in units, within `effort`: heuristics, then (with
    `merge`) the whole pipeline on merged blocks, then skyline search and CP-SAT."""
    given = effort.limit > 0
    offsets, method = best_heuristic(start, end, size, 0.0, seed)  # the named orders only: quick
    if merge and arena_of(offsets, size) > lower and given:
        offsets, method = _merged(start, end, size, lower, offsets, method, effort.until(MERGED_SHARE),
                                  num_workers, seed)
    if arena_of(offsets, size) > lower and not method.startswith("merged"):  # perturbed orders: a second
        found, how = best_heuristic(start, end, size, effort.child(min(1.0, effort.seconds / 10)), seed)
        if arena_of(found, size) < arena_of(offsets, size):
            offsets, method = found, how
    groups = components(start, end)
    if arena_of(offsets, size) > lower and given:
        found = _skyline_by_group(start, end, size, lower, offsets, groups, effort.until(SKYLINE_SHARE), seed)
        if arena_of(found, size) < arena_of(offsets, size):
            offsets, method = found, "skyline search"
    proved: set[int] = set()  # groups CP-SAT proved optimal
    if arena_of(offsets, size) > lower and given and int((size > 0).sum()) > LNS_ABOVE:
        from fxmem.solve.packing.lns import lns_improve

        found = lns_improve(start, end, size, offsets, lower, effort.part(), num_workers=num_workers, seed=seed)
        if arena_of(found, size) < arena_of(offsets, size):
            offsets, method = found, f"lns (seeded with {method})"
    elif arena_of(offsets, size) > lower and given:
        from fxmem.solve.packing.cpsat import improve

        for g, group in enumerate(groups):
            if arena_of(offsets[group], size[group]) <= lower or effort.done():
                continue
            found, optimal = improve(start[group], end[group], size[group], offsets[group], target=lower,
                                     time_limit_s=effort.part(), num_workers=num_workers, seed=seed)
            if optimal:
                proved.add(g)
            if found is not None and arena_of(found, size[group]) < arena_of(offsets[group], size[group]):
                offsets[group] = found
                method = method if method.startswith("cpsat") else f"cpsat (seeded with {method})"
    arena = arena_of(offsets, size)
    return offsets, method, arena <= lower or any(g in proved and arena_of(offsets[grp], size[grp]) == arena
                                                  for g, grp in enumerate(groups))


def pack_buffers(buffers: Sequence[Sequence[int]], *, alignment: int = 64, time_limit_s: float = 10.0,
                 num_workers: int = WORKERS, seed: int = 0) -> Packing:
    """Offsets for `(start, end, size)` buffers (half-open lifetimes) in one arena, as small as found
    within about `time_limit_s`: best-fit heuristics first, then the whole pipeline on merged blocks
    (up to `MERGED_SHARE` of the time, less when merging hardly shrinks the instance), then a capped
    skyline search with backtracking (`fxmem.solve.packing.search`, up to `SKYLINE_SHARE` of the time),
    then CP-SAT seeded with the best packing (whole, or window by window above `LNS_ABOVE` buffers), each
    stopping as soon as the arena equals the lower bound. With `time_limit_s=0`, heuristics only. The limit
    is counted, not timed (`fxmem.solve.effort`): the same buffers get the same offsets on every run."""
    started = time.perf_counter()
    rows = _validate(buffers, alignment, time_limit_s)
    start, end, raw = rows[:, 0], rows[:, 1], rows[:, 2]
    units = -(-raw // alignment)  # sizes in alignment units, rounded up
    scale = int(np.gcd.reduce(units[units > 0])) if (units > 0).any() else 1
    size = units // scale
    lower = int(live_profile(start, end, size)[1].max(initial=0))
    offsets, method, optimal = _pack_units(start, end, size, lower, Effort.of(time_limit_s), num_workers, seed)
    arena = arena_of(offsets, size)
    status = "optimal" if optimal or arena <= lower else "feasible"
    check_packing(start, end, size, offsets)
    unit = alignment * scale
    return Packing(offsets=tuple(int(o) * unit for o in offsets), arena_bytes=arena * unit,
                   lower_bound_bytes=lower * unit, no_reuse_bytes=int(size.sum()) * unit, alignment=alignment,
                   status=status, method=method, solve_time_s=time.perf_counter() - started)
