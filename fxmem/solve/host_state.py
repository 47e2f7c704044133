"""Which parameters' optimizer state lives in host memory: the choice as numbers, free of torch.

Reads per trainable parameter, in the order backward produces their gradients, the bytes of its optimizer
state, of its gradient and of its values, and the host link's and the host CPU's rates; writes nothing.
A choice is a count: the state of the first `count` parameters in that order lives on the host (those
whose gradients are ready first, so their copies could overlap most of backward). Its time:

- each gradient copied to the host over the link, overlapped with whatever backward work remains after the
  gradient is ready (`overlap_s`: 0 where backward hands every gradient over at its end, as a planned
  backward graph does): exposed where the copies take longer;
- the update on the host CPU, and the new values copied back before the next forward: exposed whole
  (the device waits for them, as torchao's CPUOffloadOptimizer and ZeRO-Offload without overlap do).

With the gradients on the host too (passes/host_gradients.py: each copied out inside the backward graph as it
is made, then freed there), the copies are issued as each gradient is ready: on a target with a side stream
(a GPU) they run beside the rest of backward and only what outlasts it is exposed (`streamed_seconds`: gradient
i taken ready once backward has made the share of all gradients' bytes up to it); without one, whole.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class HostStateCosts:
    """The parameters, in gradient order: `state` bytes (optimizer state), `grads` and `values` bytes;
    the link's bytes/s per direction and fixed cost per copy, the host's update rate in parameter bytes/s."""

    state: tuple[int, ...]
    grads: tuple[int, ...]
    values: tuple[int, ...]
    link_bytes_per_s: float
    link_latency_s: float
    update_bytes_per_s: float

    def __post_init__(self):
        if not len(self.state) == len(self.grads) == len(self.values):
            raise ValueError("state, grads and values must have one entry per parameter")
        if self.link_bytes_per_s <= 0 or self.update_bytes_per_s <= 0:
            raise ValueError("the link's and the host update's rates must be positive")

    @property
    def count(self) -> int:
        return len(self.state)

    @property
    def total_state(self) -> int:
        return sum(self.state)

    def host_bytes(self, count: int) -> int:
        """State bytes on the host with the first `count` parameters' state there."""
        return sum(self.state[:count])

    def device_bytes(self, count: int) -> int:
        return self.total_state - self.host_bytes(count)

    def copy_seconds(self, count: int) -> tuple[float, float]:
        """(gradients to the host, values back to the device) for the first `count` parameters."""
        out = sum(self.grads[:count]) / self.link_bytes_per_s + count * self.link_latency_s
        back = sum(self.values[:count]) / self.link_bytes_per_s + count * self.link_latency_s
        return out, back

    def update_seconds(self, count: int) -> float:
        return sum(self.values[:count]) / self.update_bytes_per_s

    def exposed_seconds(self, count: int, overlap_s: float) -> float:
        """What the step waits for: gradient copies beyond `overlap_s` of backward, the host update, the copy back."""
        out, back = self.copy_seconds(count)
        return max(0.0, out - overlap_s) + self.update_seconds(count) + back

    def streamed_seconds(self, count: int, backward_s: float) -> float:
        """What the first `count` gradients' copies, each issued as backward makes it and run one after another
        on a side stream, take beyond the end of backward (`backward_s`)."""
        total = sum(self.grads) or 1
        made, done = 0, 0.0
        for grad in self.grads[:count]:
            made += grad
            done = max(done, backward_s * made / total) + grad / self.link_bytes_per_s + self.link_latency_s
        return max(0.0, done - backward_s)

    def host_gradient_seconds(self, count: int, backward_s: float | None) -> float:
        """What the step waits for with the first `count` parameters' state and gradients on the host: the
        gradients' copies beyond backward (`backward_s` None: no side stream, whole), the update, the copy back."""
        out, back = self.copy_seconds(count)
        streamed = out if backward_s is None else self.streamed_seconds(count, backward_s)
        return streamed + self.update_seconds(count) + back

    def least_count_with_gradients(self, device_room: int) -> int | None:
        """The fewest parameters whose state and gradients on the host leave at most `device_room` bytes of both
        on the device (None: not even all of them on the host does)."""
        left = list(accumulate(s + g for s, g in zip(reversed(self.state), reversed(self.grads))))[::-1] + [0]
        return next((count for count, on_device in enumerate(left) if on_device <= device_room), None)

    def least_count(self, device_room: int) -> int | None:
        """The fewest parameters whose state on the host leaves at most `device_room` bytes of state on the
        device (None: not even all of it on the host does)."""
        if device_room < 0:
            return None
        hosted = [0, *accumulate(self.state)]  # bytes on the host after each count, non-decreasing
        count = bisect.bisect_left(hosted, self.total_state - device_room)
        return count if count <= self.count else None
