"""Skyline search for buffer packing: build the packing bottom-up under an arena cap, backtracking.

Reads numpy arrays of lifetimes and sizes (alignment units); returns offsets or None. Torch-free.
The lowest (then earliest) point of the skyline is filled by a buffer starting exactly there whose
lifetime fits under the flat stretch (preferring one whose top comes flush with a neighbour), or raised
to its lower neighbour (wasted); a choice is refused when some unplaced buffer could no longer fit
under the cap, and the search backtracks. Limits are counted (`fxmem.solve.effort`, `NODE_US` per node),
never read off a clock.
"""
from __future__ import annotations

import numpy as np

from fxmem.solve.effort import Effort

BIG = 1 << 60
CHAIN_SECTIONS = 64
NODE_US = 60.0  # effort units per node of the search (45-65 measured, 50 to 1,500 buffers)


class _Skyline:
    def __init__(self, start: np.ndarray, end: np.ndarray, size: np.ndarray, cap: int, rng: np.random.Generator,
                 noise: float) -> None:
        times = np.unique(np.concatenate([start, end]))
        self.s, self.e = np.searchsorted(times, start), np.searchsorted(times, end)
        self.z, self.cap = size.astype(np.int64), cap
        k = len(times) - 1
        self.height = np.zeros(k + 1, dtype=np.int64)
        self.height[k] = BIG  # sentinel: nothing reaches past the last step
        delta = np.zeros(k + 1, dtype=np.int64)
        np.add.at(delta, self.s, self.z)
        np.add.at(delta, self.e, -self.z)
        self.rem = np.cumsum(delta)  # unplaced bytes alive at each section
        self.unplaced = self.z > 0
        length = (self.e - self.s).astype(np.float64)
        key = length + (rng.random(len(length)) * noise * length.max() if noise and len(length) else 0.0)
        self.by_start: list[list[int]] = [[] for _ in range(k)]
        for i in np.lexsort((-self.z, -key)):  # longest first, then largest
            if self.z[i] > 0:
                self.by_start[self.s[i]].append(int(i))
        self.offsets = np.zeros(len(self.z), dtype=np.int64)
        self.left = int(self.unplaced.sum())
        self.undo: list[tuple[int, int, int, int, int]] = []
        self.nodes = 0

    def fits_above(self, lo: int, hi: int, level: int, skip: int = -1) -> bool:
        """Every unplaced buffer alive in sections [lo, hi) still fits between `level` and the cap."""
        mask = self.unplaced & (self.s < hi) & (self.e > lo)
        if skip >= 0:
            mask[skip] = False
        return not mask.any() or int(self.z[mask].max()) + level <= self.cap

    def chains(self, k: int, run: int) -> list[bool]:
        """chained[x - k]: unplaced buffers can tile sections [x, run) end to end with no waste."""
        if run - k > CHAIN_SECTIONS:  # a long flat stretch: too costly to look ahead, and rarely decisive
            return [True] * (run - k + 1)
        chained = [False] * (run - k + 1)
        chained[run - k] = True
        for x in range(run - 1, k - 1, -1):
            for i in self.by_start[x]:
                if self.unplaced[i] and self.e[i] <= run and chained[self.e[i] - k]:
                    chained[x - k] = True
                    break
        return chained

    def alternatives(self) -> list[tuple[int, int, int, int, int]]:
        """(kind, buffer or new height, section, height, end section): placements, then raising sections."""
        height, z, cap = self.height, self.z, self.cap
        k = int(np.argmin(height))
        h = int(height[k])
        if h >= BIG:
            return []  # every section closed with buffers left: a dead end
        run = k + int(np.flatnonzero(height[k:] != h)[0])
        chained = self.chains(k, run)
        alts = [(0, i, k, h, k + 1) for i in self.by_start[k]
                if self.unplaced[i] and self.e[i] <= run and h + z[i] <= cap
                and self.fits_above(self.s[i], self.e[i], h + int(z[i]), skip=i)]
        # Stable sort, so the key order breaks ties: buffers that end where a chain of unplaced buffers can
        # fill the rest of the stretch first, then buffers whose top comes flush with a neighbour's height.
        flush_with = {int(height[k - 1]) if k > 0 else -1}
        alts.sort(key=lambda alt: (not chained[self.e[alt[1]] - k],
                                   h + int(z[alt[1]]) not in flush_with | {int(height[self.e[alt[1]]])}))
        # Waste: raise the flat stretch up to the next section where some buffer could start at h.
        stop = next((x for x in range(k + 1, run)
                     if any(self.unplaced[i] and self.e[i] <= run for i in self.by_start[x])), run)
        raised = min(int(height[k - 1]) if k > 0 else BIG, int(height[run]))
        if raised >= BIG:
            alts.append((1, BIG, k, h, stop))  # no unplaced buffer can reach these sections any more
        elif (raised + self.rem[k:stop] <= cap).all() and self.fits_above(k, stop, raised):
            alts.append((1, raised, k, h, stop))
        return alts

    def apply(self, alt: tuple[int, int, int, int, int]) -> None:
        kind, v, k, h, stop = alt
        self.undo.append(alt)
        if kind == 0:
            s, e = self.s[v], self.e[v]
            self.unplaced[v] = False
            self.left -= 1
            self.offsets[v] = h
            self.height[s:e] = h + self.z[v]
            self.rem[s:e] -= self.z[v]
        else:
            self.height[k:stop] = v

    def revert(self, to: int) -> None:
        while len(self.undo) > to:
            kind, v, k, h, stop = self.undo.pop()
            if kind == 0:
                s, e = self.s[v], self.e[v]
                self.unplaced[v] = True
                self.left += 1
                self.height[s:e] = h
                self.rem[s:e] += self.z[v]
            else:
                self.height[k:stop] = h

    def run(self, node_limit: int) -> np.ndarray | None:
        if (self.rem[:-1] > self.cap).any() or (self.z > self.cap).any():
            return None
        stack: list[list] = []
        while self.left:
            self.nodes += 1
            if self.nodes > node_limit:
                return None
            stack.append([len(self.undo), self.alternatives(), 0])
            while True:
                top = stack[-1]
                if top[2] < len(top[1]):
                    self.revert(top[0])
                    self.apply(top[1][top[2]])
                    top[2] += 1
                    break
                stack.pop()
                if not stack:
                    return None
        return self.offsets


def skyline_pack(start: np.ndarray, end: np.ndarray, size: np.ndarray, *, cap: int = BIG // 4,
                 node_limit: int = BIG, noise: float = 0.0, seed: int = 0,
                 effort: Effort | None = None) -> np.ndarray | None:
    """Offsets with every buffer's top at most `cap`, or None if the search gave up or proved none;
    its nodes are charged to `effort`."""
    search = _Skyline(start, end, size, cap, np.random.default_rng(seed), noise)
    try:
        return search.run(node_limit)
    finally:
        if effort is not None:
            effort.spend(NODE_US * search.nodes)


def skyline_search(start: np.ndarray, end: np.ndarray, size: np.ndarray, lower: int, best: np.ndarray,
                   time_limit_s: float | Effort, seed: int = 0) -> np.ndarray:
    """Lower the arena of `best` until it reaches `lower` or its limit (about `time_limit_s` seconds) is
    spent, alternating uncapped skyline runs with random tie-breaks (cheap, high variance: some land on the
    bound) and capped searches with backtracking between the bound and the best arena so far; returns the
    best offsets found."""
    effort = Effort.of(time_limit_s)
    top = lambda off: int((off + size).max(initial=0))  # noqa: E731
    rng = np.random.default_rng(seed)
    tries = 0
    while tries == 0 or (not effort.done() and top(best) > lower):
        ub = top(best)
        if tries % 2 == 0:
            found = skyline_pack(start, end, size, noise=0.0 if tries == 0 else 1.0, seed=int(rng.integers(1 << 31)),
                                 effort=effort)
        else:
            cap = (lower + ub) // 2 if tries % 4 == 1 else lower + (ub - lower) * 3 // 4
            found = skyline_pack(start, end, size, cap=max(lower, min(cap, ub - 1)), node_limit=2 * len(start) + 200,
                                 noise=0.3, seed=int(rng.integers(1 << 31)), effort=effort)
        tries += 1
        if found is not None and top(found) < ub:
            best = found
    return best
