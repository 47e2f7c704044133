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


@pytest.mark.parametrize("gradients", [False, True])
def test_least_count_leaves_at_most_the_room(gradients):
    """The fewest parameters on the host (their state, and with `gradients` their gradients too) that leave at most
    the room on the device: one fewer would not fit."""
    c = costs()
    least = c.least_count_with_gradients if gradients else c.least_count
    left = lambda k: c.device_bytes(k) + (sum(c.grads[k:]) if gradients else 0)  # noqa: E731
    for room in range(-1, 60):
        count = least(room)
        if room < 0:
            assert count is None
            continue
        assert left(count) <= room and (count == 0 or left(count - 1) > room)


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


def test_gradients_streamed_in_backward_hide_behind_it():
    """Copies issued as each gradient is made run beside the rest of backward: a long backward hides them all
    but the last one's tail; with no side stream (backward_s None) they are waited for whole."""
    c = costs()
    out, back = c.copy_seconds(3)
    update = c.update_seconds(3)
    assert c.host_gradient_seconds(3, None) == out + update + back
    assert c.streamed_seconds(3, 0.0) == out  # no backward to hide behind
    long = c.streamed_seconds(3, 100.0)
    assert long == pytest.approx(4 / 4.0)  # the last gradient, ready as backward ends, copied after it
    seconds = [c.streamed_seconds(3, b) for b in (0.0, 1.0, 4.0, 100.0)]
    assert seconds == sorted(seconds, reverse=True)
    assert c.host_gradient_seconds(3, 100.0) == long + update + back < c.exposed_seconds(3, 0.0)
