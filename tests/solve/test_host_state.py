"""The host-state choice as numbers: what each count of parameters on the host leaves and costs."""
import pytest

from fxmem.solve.host_state import HostStateCosts


def costs(**kw):
    base = dict(state=(8, 16, 8), grads=(4, 8, 4), values=(4, 8, 4), link_bytes_per_s=4.0, link_latency_s=0.0,
                update_bytes_per_s=2.0)
    return HostStateCosts(**{**base, **kw})


def test_bytes_by_count():
    c = costs()
    assert [c.host_bytes(k) for k in range(4)] == [0, 8, 24, 32]
    assert [c.device_bytes(k) for k in range(4)] == [32, 24, 8, 0]


def test_least_count_leaves_at_most_the_room():
    c = costs()
    for room in range(-1, 40):
        count = c.least_count(room)
        if room < 0:
            assert count is None
            continue
        assert c.device_bytes(count) <= room
        assert count == 0 or c.device_bytes(count - 1) > room  # one fewer would not fit


def test_copies_overlap_backward_update_and_copy_back_do_not():
    c = costs(link_latency_s=0.5)
    out, back = c.copy_seconds(2)
    assert (out, back) == (12 / 4 + 1.0, 12 / 4 + 1.0)
    assert c.update_seconds(2) == 12 / 2
    assert c.exposed_seconds(2, overlap_s=100.0) == back + c.update_seconds(2)
    assert c.exposed_seconds(2, overlap_s=1.0) == out - 1.0 + back + c.update_seconds(2)
    seconds = [c.exposed_seconds(k, 1.0) for k in range(4)]
    assert seconds == sorted(seconds) and seconds[0] == 0.0


def test_refuses_inconsistent_input():
    with pytest.raises(ValueError, match="one entry per parameter"):
        costs(grads=(1,))
    with pytest.raises(ValueError, match="positive"):
        costs(update_bytes_per_s=0.0)
