"""Where planning's time goes: seconds per stage (capture, the joint graph's trace, pricing, solving,
simulating, rewriting, compiling, eager's meter), each stage's own time without the stages inside it.

    with stage_times.recording() as seconds:
        fxmem.plan(...)
    print(stage_times.table(seconds))

`stage(name)` marks a stage; outside `recording()` it costs one check. Reads and writes nothing else.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

STAGES = ("capture", "eager meter", "trace joint", "price", "solve", "simulate", "rewrite", "compile")
_local = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Record the stages run inside, on this thread: the dict holds each stage's own seconds."""
    outer = getattr(_local, "seconds", None)
    _local.seconds, _local.stack = {}, []
    try:
        yield _local.seconds
    finally:
        _local.seconds, _local.stack = outer, []


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the time inside as `name`'s, less the stages nested in it (counted as their own)."""
    seconds = getattr(_local, "seconds", None)
    if seconds is None:
        yield
        return
    frame = [time.perf_counter(), 0.0]  # start, seconds of the stages inside
    _local.stack.append(frame)
    try:
        yield
    finally:
        _local.stack.pop()
        spent = time.perf_counter() - frame[0]
        seconds[name] = seconds.get(name, 0.0) + spent - frame[1]
        if _local.stack:
            _local.stack[-1][1] += spent


def table(seconds: dict[str, float], total: float | None = None) -> str:
    """One line per stage that ran, in pipeline order, with its share of `total` (the plan call's seconds)."""
    total = total if total is not None else sum(seconds.values())
    names = [n for n in STAGES if n in seconds] + sorted(set(seconds) - set(STAGES))
    lines = [f"  {name:<12} {seconds[name]:7.2f} s  {100 * seconds[name] / total:5.1f}%" for name in names]
    rest = total - sum(seconds.values())
    if rest > 0.005:
        lines.append(f"  {'the rest':<12} {rest:7.2f} s  {100 * rest / total:5.1f}%")
    return "\n".join([f"where the {total:.2f} s of planning went:"] + lines)
