"""fxmem.pack_buffers: no two buffers alive together share a byte, alignment, the lower bound, bad input."""
from __future__ import annotations

import random

import pytest

import fxmem
from fxmem.errors import PackingError
from fxmem.solve.packing import check_packing
from tests.solve.pack_instances import hard_instance


def _no_overlap(buffers, packing, alignment):
    for i, (s1, e1, z1) in enumerate(buffers):
        o1 = packing.offsets[i]
        assert o1 % alignment == 0
        assert o1 + z1 <= packing.arena_bytes
        for j in range(i + 1, len(buffers)):
            s2, e2, z2 = buffers[j]
            o2 = packing.offsets[j]
            if s1 < e2 and s2 < e1 and z1 and z2:
                assert o1 + z1 <= o2 or o2 + z2 <= o1, f"buffers {i} and {j} overlap"


def _live_max(buffers, alignment):
    steps = sorted({t for s, e, _ in buffers for t in (s, e)})
    return max(sum(-(-z // alignment) * alignment for s, e, z in buffers if s <= t < e) for t in steps)


def _random(n, seed, horizon=50, max_size=5000):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randrange(horizon)
        out.append((s, s + rng.randint(1, 12), rng.randint(0, max_size)))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alignment", [1, 64, 512])
def test_random_buffers_never_overlap_and_respect_alignment(seed, alignment):
    buffers = _random(60, seed)
    packing = fxmem.pack_buffers(buffers, alignment=alignment, time_limit_s=1.0)
    assert len(packing.offsets) == len(buffers)
    _no_overlap(buffers, packing, alignment)
    assert packing.lower_bound_bytes == _live_max(buffers, alignment)
    assert packing.arena_bytes >= packing.lower_bound_bytes
    assert packing.no_reuse_bytes == sum(-(-z // alignment) * alignment for _, _, z in buffers)


def test_easy_instances_reach_the_lower_bound():
    chain = [(i, i + 2, 1000 * (1 + i % 3)) for i in range(20)]  # each value feeds the next
    packing = fxmem.pack_buffers(chain, time_limit_s=1.0)
    assert packing.arena_bytes == packing.lower_bound_bytes and packing.status == "optimal"
    _no_overlap(chain, packing, 64)


def test_disjoint_lifetimes_share_one_slot():
    buffers = [(0, 1, 4096), (1, 2, 4096), (2, 3, 100)]
    packing = fxmem.pack_buffers(buffers)
    assert packing.offsets == (0, 0, 0) and packing.arena_bytes == 4096


def test_hard_generator_has_a_tight_known_optimum():
    buffers = hard_instance(200, seed=3, height_units=500)
    packing = fxmem.pack_buffers(buffers, time_limit_s=0.0)  # heuristics only
    assert packing.lower_bound_bytes == 500 * 64  # the tiles fill every step
    _no_overlap(buffers, packing, 64)


def test_hard_instance_within_five_percent_of_the_bound():
    buffers = hard_instance(100, seed=1)
    heuristic = fxmem.pack_buffers(buffers, time_limit_s=0.0)
    assert heuristic.arena_bytes > 1.05 * heuristic.lower_bound_bytes, "the instance should be hard for best-fit"
    packing = fxmem.pack_buffers(buffers, time_limit_s=5.0)
    _no_overlap(buffers, packing, 64)
    assert packing.arena_bytes <= 1.05 * packing.lower_bound_bytes, packing


def test_empty_and_zero_size():
    assert fxmem.pack_buffers([]).arena_bytes == 0
    packing = fxmem.pack_buffers([(0, 3, 0), (1, 2, 10)])
    assert packing.arena_bytes == 64 and packing.offsets[1] == 0


@pytest.mark.parametrize("buffers, words", [
    ([(0, 2, -1)], "negative"),
    ([(3, 3, 10)], "empty"),
    ([(4, 2, 10)], "empty"),
    ([(0, 1)], "triple"),
    ([(0, 1.5, 8)], "integer"),
    (["abc"], "integer"),
])
def test_bad_buffers_are_refused_with_the_buffer_named(buffers, words):
    with pytest.raises(PackingError, match=words) as info:
        fxmem.pack_buffers(buffers)
    assert "buffer 0" in str(info.value)
    assert isinstance(info.value, fxmem.FxmemError)


@pytest.mark.parametrize("kwargs", [{"alignment": 0}, {"alignment": -64}, {"time_limit_s": -1}])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(PackingError):
        fxmem.pack_buffers([(0, 1, 8)], **kwargs)


def test_check_packing_catches_an_overlap():
    with pytest.raises(PackingError, match="overlap"):
        check_packing([0, 1], [2, 3], [10, 10], [0, 5])


def test_skyline_search_respects_its_cap():
    import numpy as np

    from fxmem.solve.packing import live_profile
    from fxmem.solve.packing.search import skyline_pack

    arr = np.asarray(hard_instance(80, seed=2), dtype=np.int64)
    start, end, size = arr[:, 0], arr[:, 1], arr[:, 2] // 64
    lower = int(live_profile(start, end, size)[1].max())
    free = skyline_pack(start, end, size)
    check_packing(start, end, size, free)
    assert skyline_pack(start, end, size, cap=lower - 1) is None  # below the bound: refused at once
    capped = skyline_pack(start, end, size, cap=int((free + size).max()), node_limit=10_000)
    assert capped is not None and (capped + size).max() <= (free + size).max()
    check_packing(start, end, size, capped)


def _hard_arrays(n, seed):
    import numpy as np

    from fxmem.solve.packing import live_profile

    arr = np.asarray(hard_instance(n, seed=seed), dtype=np.int64)
    start, end, size = arr[:, 0], arr[:, 1], arr[:, 2] // 64
    return start, end, size, int(live_profile(start, end, size)[1].max())


@pytest.mark.parametrize("limit", [0.3, 2.0])
def test_lns_keeps_a_valid_packing_no_worse_than_its_start_within_its_time(limit):
    import time

    from fxmem.solve.packing import arena_of, best_heuristic
    from fxmem.solve.packing.lns import lns_improve

    start, end, size, lower = _hard_arrays(300, 1)
    seeded, _ = best_heuristic(start, end, size, time_limit_s=0.0)
    before = seeded.copy()
    began = time.process_time()  # CPU seconds: its limit is counted work, which a loaded machine only stretches
    found = lns_improve(start, end, size, seeded, lower, limit)
    assert time.process_time() - began <= 1.5 * limit + 0.3
    assert (seeded == before).all(), "the starting packing is not modified in place"
    check_packing(start, end, size, found)
    assert arena_of(found, size) <= arena_of(seeded, size)
    if limit >= 2.0:
        assert arena_of(found, size) < arena_of(seeded, size), "two seconds of windows should lower a best-fit arena"


def test_lns_move_never_raises_its_column():
    import numpy as np

    from fxmem.solve.packing import arena_of, best_heuristic
    from fxmem.solve.packing.lns import _column, resolve_window

    start, end, size, lower = _hard_arrays(300, 2)
    offsets, _ = best_heuristic(start, end, size, time_limit_s=0.0)
    free = _column(int(end.max()) // 2, start, end, size, 60)
    assert len(free) == 60 and (size[free] > 0).all()
    found, _ = resolve_window(start, end, size, offsets, free, arena_of(offsets, size), 0.3)
    assert found is not None
    trial = offsets.copy()
    trial[free] = found
    check_packing(start, end, size, trial)
    assert (trial + size)[free].max() <= (offsets + size)[free].max()
    assert np.array_equal(np.delete(trial, free), np.delete(offsets, free)), "only the window's buffers move"


def test_300_buffer_hard_instance_within_ten_percent_in_three_seconds():
    import time

    buffers = hard_instance(300, seed=2)
    began = time.process_time()  # CPU seconds: its limit is counted work, which a loaded machine only stretches
    packing = fxmem.pack_buffers(buffers, time_limit_s=3.0)
    assert time.process_time() - began <= 4.5
    _no_overlap(buffers, packing, 64)
    assert packing.gap <= 0.10, packing.gap  # best-fit alone: 30% and more
    assert packing.status == "optimal" or packing.method.startswith("lns"), packing.method


def test_skyline_search_tiles_a_500_buffer_hard_instance_exactly():
    # Preferring buffers whose top comes flush with a neighbour is what gets this one to the bound (5.6% without).
    from fxmem.solve.packing import arena_of, best_heuristic
    from fxmem.solve.packing.search import skyline_search

    start, end, size, lower = _hard_arrays(500, 0)
    seeded, _ = best_heuristic(start, end, size, time_limit_s=0.0)
    found = skyline_search(start, end, size, lower, seeded, time_limit_s=4.0)
    check_packing(start, end, size, found)
    assert arena_of(found, size) == lower


@pytest.mark.parametrize("n, seed", [(60, 0), (300, 1), (1000, 2)])
def test_merged_blocks_expand_to_valid_packings_with_the_same_bound(n, seed):
    import numpy as np

    from fxmem.solve.packing import best_heuristic, live_profile
    from fxmem.solve.packing.merge import merge_blocks

    if n == 60:  # random lifetimes and sizes, some of size 0
        arr = np.asarray(_random(n, seed), dtype=np.int64)
        start, end, size = arr[:, 0], arr[:, 1], -(-arr[:, 2] // 64)
        lower = int(live_profile(start, end, size)[1].max())
    else:
        start, end, size, lower = _hard_arrays(n, seed)
    for pairs, stack_first in ((False, False), (True, False), (False, True), (True, True)):
        blocks = merge_blocks(start, end, size, pairs=pairs, stack_first=stack_first)
        assert ((blocks.block >= 0) == (size > 0)).all(), "every sized buffer in one block, no other"
        assert len(blocks.size) <= int((size > 0).sum())
        assert int(live_profile(blocks.start, blocks.end, blocks.size)[1].max(initial=0)) == lower
        sized = blocks.block >= 0
        b = blocks.block[sized]
        assert (blocks.start[b] <= start[sized]).all() and (blocks.end[b] >= end[sized]).all()
        assert (blocks.inner[sized] >= 0).all() and (blocks.inner[sized] + size[sized] <= blocks.size[b]).all()
        placed, _ = best_heuristic(blocks.start, blocks.end, blocks.size, time_limit_s=0.0)
        check_packing(start, end, size, blocks.expand(placed))


def test_merging_never_makes_the_packing_larger_and_packs_1000_hard_buffers_near_the_bound():
    from fxmem.solve.packing import arena_of, best_heuristic

    start, end, size, lower = _hard_arrays(1000, 3)
    buffers = hard_instance(1000, seed=3)
    heuristic, _ = best_heuristic(start, end, size, time_limit_s=0.0)
    packing = fxmem.pack_buffers(buffers, time_limit_s=10.0)
    _no_overlap(buffers, packing, 64)
    assert packing.arena_bytes <= arena_of(heuristic, size) * 64
    assert packing.gap <= 0.05, (packing.gap, packing.method)


def test_merge_blocks_stacks_shared_lifetimes_and_chains_same_sizes():
    import numpy as np

    from fxmem.solve.packing.merge import merge_blocks

    arr = lambda *xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    # Chained (same size, one ends where the other starts), then stacked with the third (same lifetime).
    chained = merge_blocks(arr(0, 2, 0), arr(2, 5, 5), arr(4, 4, 1))
    assert (list(chained.start), list(chained.end), list(chained.size)) == ([0], [5], [5])
    assert list(chained.inner) == [0, 0, 4]
    alone = merge_blocks(arr(0, 2), arr(2, 5), arr(4, 4))  # nothing alive across step 2: two groups, kept apart
    assert len(alone.size) == 2
    stacked = merge_blocks(arr(0, 0), arr(3, 3), arr(2, 5))
    assert list(stacked.size) == [7] and sorted(stacked.inner) == [0, 5]
    apart = merge_blocks(arr(0, 2), arr(2, 4), arr(4, 3))  # different sizes: nothing to merge
    assert len(apart.size) == 2
    empty = merge_blocks(arr(), arr(), arr())
    assert len(empty.size) == 0 and len(empty.expand(np.zeros(0, dtype=np.int64))) == 0
