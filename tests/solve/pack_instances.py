"""Hard packing instances with a known optimum, for tests and benchmarks of `pack_buffers`.

Writes nothing; returns `(start, end, size)` triples. A rectangle of `steps` x `height` (time x
bytes) is cut at random into `n` tiles; each tile is a buffer. The tiles fill the rectangle, so
at every step exactly `height` bytes are alive: the lower bound is `height` and is reachable (the
cutting itself is a packing), but any placement mistake costs arena above it.
"""
from __future__ import annotations

import heapq
import random

# Largest-first best-fit lands well above the bound on these tilings (measured by scripts/bench_pool.py).


def hard_instance(n: int, *, seed: int = 0, alignment: int = 64, height_units: int | None = None,
                  steps: int | None = None) -> list[tuple[int, int, int]]:
    """`n` buffers tiling a `steps` x `height_units * alignment` rectangle with no slack.

    Cuts alternate at random between time (split a lifetime) and memory (split a size), at
    20-80% of the piece, always cutting the largest piece left, so sizes and lifetimes are mixed."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    rng = random.Random(seed)
    steps = steps or 4 * n
    height = height_units or 16 * n
    heap = [(-steps * height, 0, steps, 0, height)]  # (-area, t0, t1, m0, m1)
    stuck: list[tuple[int, int, int, int, int]] = []
    while heap and len(heap) + len(stuck) < n:
        _, t0, t1, m0, m1 = heapq.heappop(heap)
        width, tall = t1 - t0, m1 - m0
        can_time, can_mem = width >= 2, tall >= 2
        if not (can_time or can_mem):
            stuck.append((0, t0, t1, m0, m1))
            continue
        in_time = can_time and (not can_mem or rng.random() < width / steps / (width / steps + tall / height))
        lo, hi = (t0, t1) if in_time else (m0, m1)
        cut = rng.randint(lo + max(1, (hi - lo) // 5), hi - max(1, (hi - lo) // 5)) if hi - lo >= 5 \
            else rng.randint(lo + 1, hi - 1)
        parts = [(t0, cut, m0, m1), (cut, t1, m0, m1)] if in_time else [(t0, t1, m0, cut), (t0, t1, cut, m1)]
        for a0, a1, b0, b1 in parts:
            heapq.heappush(heap, (-(a1 - a0) * (b1 - b0), a0, a1, b0, b1))
    tiles = [(t0, t1, (m1 - m0) * alignment) for _, t0, t1, m0, m1 in heap + stuck]
    rng.shuffle(tiles)
    return tiles
