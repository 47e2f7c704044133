"""Large-neighbourhood search for buffer packing: re-solve windows of buffers with CP-SAT, the rest fixed.

Reads numpy arrays of lifetimes, sizes (alignment units) and a feasible packing; returns offsets
whose arena is never larger. Torch-free. Each step frees the buffers nearest in time to a buffer at
the top of the arena (a column of the packing, every address), keeps the other buffers that share
their lifetimes as fixed obstacles, and asks CP-SAT for the free buffers' offsets under the current
arena with the column's highest top as small as it can get in a short time. Moves that do not raise
the column's top are kept; windows grow when the column cannot be lowered and shrink when CP-SAT
runs out of its limit. Limits are counted (`fxmem.solve.effort`: CP-SAT's deterministic time, and
`STEP_US` per buffer for each column chosen and modelled), so the same packing comes back on every run.
"""
from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

from fxmem.solve.effort import PACKING_DTIME_PER_S, WORKERS, Effort

STEP_US = 20.0  # effort units per buffer of the instance, for each column chosen and modelled


def _column(center: int, start: np.ndarray, end: np.ndarray, size: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` sized buffers whose lifetimes come nearest to time `center`."""
    distance = np.maximum(0, np.maximum(start - center, center + 1 - end)).astype(np.float64)
    distance[size == 0] = np.inf
    count = min(count, int(np.isfinite(distance).sum()))
    return np.argpartition(distance, count - 1)[:count] if count else np.zeros(0, dtype=np.int64)


def resolve_window(start: np.ndarray, end: np.ndarray, size: np.ndarray, offsets: np.ndarray, free: np.ndarray,
                   cap: int, time_limit_s: float | Effort, num_workers: int = WORKERS, seed: int = 0
                   ) -> tuple[np.ndarray | None, bool]:
    """New offsets for the sized buffers `free` (the others stay where `offsets` puts them) with every
    top at most `cap` and the highest top among them no higher than now, as low as CP-SAT gets it in
    about `time_limit_s` seconds, hinted with the current offsets.
    Returns (offsets for `free` in its order, or None if CP-SAT found nothing; proved optimal)."""
    is_free = np.zeros(len(start), dtype=bool)
    is_free[free] = True
    fs, fe = start[free], end[free]
    # Fixed buffers sharing some step with some free buffer are the obstacles.
    touching = ((start[:, None] < fe[None, :]) & (end[:, None] > fs[None, :])).any(axis=1)
    obstacles = np.flatnonzero(touching & ~is_free & (size > 0))
    model = cp_model.CpModel()
    current_top = int((offsets[free] + size[free]).max())
    highest = model.new_int_var(int(size[free].max()), min(cap, current_top), "highest")
    xs, ys, ys_free = [], [], []
    for i in free:
        z = int(size[i])
        y = model.new_int_var(0, cap - z, f"y{i}")
        ys_free.append(y)
        model.add_hint(y, int(offsets[i]))
        xs.append(model.new_fixed_size_interval_var(int(start[i]), int(end[i] - start[i]), f"t{i}"))
        ys.append(model.new_fixed_size_interval_var(y, z, f"m{i}"))
        model.add(highest >= y + z)
    for j in obstacles:
        xs.append(model.new_fixed_size_interval_var(int(start[j]), int(end[j] - start[j]), f"t{j}"))
        ys.append(model.new_fixed_size_interval_var(int(offsets[j]), int(size[j]), f"m{j}"))
    model.add_no_overlap_2d(xs, ys)
    model.add_hint(highest, current_top)
    model.minimize(highest)
    solver = cp_model.CpSolver()
    code = Effort.of(time_limit_s).run_cpsat(solver, model, PACKING_DTIME_PER_S, num_workers, 0.01, seed)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False
    return np.asarray([solver.value(y) for y in ys_free], dtype=np.int64), code == cp_model.OPTIMAL


def lns_improve(start: np.ndarray, end: np.ndarray, size: np.ndarray, offsets: np.ndarray, lower: int,
                time_limit_s: float | Effort, *, window: int = 80, step_time_s: float = 0.3,
                num_workers: int = WORKERS, seed: int = 0) -> np.ndarray:
    """Lower the arena of `offsets` towards `lower` by re-solving columns around buffers at the arena's
    top until it reaches `lower` or its limit (about `time_limit_s` seconds) is spent. Returns new offsets,
    never a larger arena: a move is kept only when its column's highest top does not rise (and no top
    passes the arena)."""
    effort = Effort.of(time_limit_s)
    offsets = offsets.copy()
    rng = np.random.default_rng(seed)
    sized = int((size > 0).sum())
    smallest = min(20, sized)
    count = min(window, sized)
    while sized:
        tops = offsets + size
        arena = int(tops.max())
        if arena <= lower or effort.left_s < 0.02:
            break
        effort.spend(STEP_US * len(start))
        at_top = int(rng.choice(np.flatnonzero(tops == arena)))
        free = _column(int(rng.integers(start[at_top], end[at_top])), start, end, size, count)
        found, optimal = resolve_window(start, end, size, offsets, free, arena, effort.part(most_s=step_time_s),
                                        num_workers, int(rng.integers(1 << 31)))
        if found is None:  # not even the hint back in time: smaller columns
            count = max(smallest, int(count * 0.8))
            continue
        before, after = int(tops[free].max()), int((found + size[free]).max())
        if after <= before:
            offsets[free] = found
        if after == before:
            # Proved stuck: look wider. Out of time without gain: look narrower.
            count = min(sized, int(count * 1.25) + 1) if optimal else max(smallest, int(count * 0.9))
    return offsets
