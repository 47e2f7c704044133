"""A memory profile under range additions: O(log T) add, global max and its step.

Reads and writes nothing; used by the greedy solver to price moves incrementally.
"""
from __future__ import annotations

_NEG = -(1 << 62)


class ProfileTree:
    """Lazy max segment tree over live bytes per step (pending adds stay at internal nodes)."""

    def __init__(self, values: list[int]) -> None:
        values = values or [0]
        self.h = max(1, (len(values) - 1).bit_length())
        self.n = n = 1 << self.h
        self.t = [_NEG] * n + list(values) + [_NEG] * (n - len(values))
        self.d = [0] * n
        for p in range(n - 1, 0, -1):
            self.t[p] = max(self.t[2 * p], self.t[2 * p + 1])

    def _apply(self, p: int, v: int) -> None:
        self.t[p] += v
        if p < self.n:
            self.d[p] += v

    def _pull(self, p: int) -> None:
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            t[p] = max(t[2 * p], t[2 * p + 1]) + d[p]

    def add(self, first: int, last: int, v: int) -> None:
        """Add v to every step in [first, last] (inclusive; nothing when first > last)."""
        if first > last or not v:
            return
        lo, hi = first + self.n, last + 1 + self.n
        l, r = lo, hi
        while l < r:
            if l & 1:
                self._apply(l, v)
                l += 1
            if r & 1:
                r -= 1
                self._apply(r, v)
            l >>= 1
            r >>= 1
        self._pull(lo)
        self._pull(hi - 1)

    def at(self, i: int) -> int:
        """Bytes at step i."""
        p = i + self.n
        value = self.t[p]
        while p > 1:
            p >>= 1
            value += self.d[p]
        return value

    def top(self) -> int:
        return self.t[1]

    def argmax(self) -> int:
        p = 1
        while p < self.n:
            p = 2 * p if self.t[2 * p] == self.t[p] - self.d[p] else 2 * p + 1
        return p - self.n
