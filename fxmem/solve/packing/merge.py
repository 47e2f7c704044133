"""Merge buffers into blocks before packing: a smaller instance whose packings expand to packings of the
buffers.

Reads numpy arrays of lifetimes and sizes (alignment units); returns blocks (lifetimes, sizes) and, per
buffer, its block and its offset inside the block; writes nothing. Torch-free. Two merges, repeated
until none applies: blocks with the same lifetime are stacked into one (sizes add up), and a block
ending exactly when another block of the same size starts is chained with it (one slot reused).
Blocks never overlap inside, so any packing of the blocks is a packing of the buffers. Merging can
lose the optimum (it fixes who sits next to whom), so the result is a candidate to compare, not the
answer; on instances cut from a rectangle (`tests/solve/pack_instances.py`) it rebuilds most of the cutting.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np



def components(start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
    """Groups of buffers whose lifetimes chain together; groups never overlap in time."""
    order = np.argsort(start, kind="stable")
    groups, current, reach = [], [], None
    for i in order:
        if current and start[i] >= reach:
            groups.append(np.asarray(current))
            current, reach = [], None
        current.append(i)
        reach = end[i] if reach is None else max(reach, end[i])
    if current:
        groups.append(np.asarray(current))
    return groups


@dataclass(frozen=True)
class Blocks:
    """`start`, `end`, `size`: one entry per block. `block[i]`, `inner[i]`: buffer i's block and its
    offset inside it (buffers of size 0 are left out: block -1)."""

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    block: np.ndarray
    inner: np.ndarray

    def expand(self, offsets: np.ndarray) -> np.ndarray:
        """Offsets of the buffers from offsets of the blocks."""
        sized = self.block >= 0
        out = np.zeros(len(self.block), dtype=np.int64)
        out[sized] = offsets[self.block[sized]] + self.inner[sized]
        return out


def _stack(same: list) -> list:
    """One block of `same` (blocks sharing a lifetime) stacked, largest lowest."""
    same = sorted(same, key=lambda b: -b[2])
    members, base = [], 0
    for b in same:
        members.extend((i, o + base) for i, o in b[3])
        base += b[2]
    return [same[0][0], same[0][1], base, members, same[0][4]]


def _chain(blocks: list, pairs: bool = False) -> list:
    """Blocks with each run of same-size blocks, each ending where the next starts, chained into one
    (with `pairs`, at most two blocks to a run)."""
    by_head: dict[tuple[int, int], list] = {}
    ordered = sorted(blocks, key=lambda b: b[0])
    for b in ordered:
        by_head.setdefault((b[0], b[2], b[4]), []).append(b)
    taken: set[int] = set()
    merged = []
    for b in ordered:
        if id(b) in taken:
            continue
        taken.add(id(b))
        chain = [b]
        while not pairs or len(chain) < 2:
            nxt = next((c for c in by_head.get((chain[-1][1], b[2], b[4]), ()) if id(c) not in taken), None)
            if nxt is None:
                break
            taken.add(id(nxt))
            chain.append(nxt)
        merged.append(b if len(chain) == 1 else [b[0], chain[-1][1], b[2], [m for c in chain for m in c[3]], b[4]])
    return merged


def _stacked(blocks: list) -> list:
    """Blocks with every group sharing a lifetime stacked into one."""
    by_life: dict[tuple[int, int], list] = {}
    for b in blocks:
        by_life.setdefault((b[0], b[1]), []).append(b)
    return [same[0] if len(same) == 1 else _stack(same) for same in by_life.values()]


def merge_blocks(start: np.ndarray, end: np.ndarray, size: np.ndarray, rounds: int = 1 << 30,
                 pairs: bool = False, stack_first: bool = False) -> Blocks:
    """Chain same-size blocks end to start (with `pairs`, two at most to a chain in one round), then stack
    blocks sharing a lifetime (largest lowest), or the other way round with `stack_first`, until neither
    changes anything or after `rounds` rounds."""
    # A block: [start, end, size, members as a list of (buffer, offset inside), group of chained lifetimes].
    # Blocks of two groups are never chained: the groups stay apart, to be packed one by one.
    group = np.zeros(len(start), dtype=np.int64)
    for g, members in enumerate(components(start, end)):
        group[members] = g
    blocks = [[int(start[i]), int(end[i]), int(size[i]), [(i, 0)], int(group[i])]
              for i in range(len(start)) if size[i] > 0]
    for _ in range(rounds):
        count = len(blocks)
        blocks = _chain(_stacked(blocks), pairs) if stack_first else _stacked(_chain(blocks, pairs))
        if len(blocks) == count:
            break
    block = np.full(len(start), -1, dtype=np.int64)
    inner = np.zeros(len(start), dtype=np.int64)
    for j, b in enumerate(blocks):
        for i, o in b[3]:
            block[i], inner[i] = j, o
    arr = np.asarray([b[:3] for b in blocks], dtype=np.int64).reshape(-1, 3)
    return Blocks(arr[:, 0], arr[:, 1], arr[:, 2], block, inner)
