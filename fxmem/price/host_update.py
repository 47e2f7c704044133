"""The host CPU's optimizer update rate: parameter bytes per second an AdamW step on the CPU updates.

Reads the environment (`FXMEM_HOST_UPDATE_GBPS`: a rate in GB/s to use instead of measuring) and this
machine's CPU: times torch.optim.AdamW's step (fused or not, as the optimizer will run) on a 16 MiB fp32
parameter (fastest of a few), rounded to two significant digits, once per machine: the rate is kept on disk
with the kernel prices (`fxmem.price.price_record`; `FXMEM_CACHE=0` keeps none and measures once per process),
so plans made in two processes, on an idle or a busy machine, agree.
The rate is this machine's: a plan made here for a GPU server assumes that server's CPU updates as fast.
"""
from __future__ import annotations

import functools
import math
import os
import time

from fxmem.price import price_record

ENV = "FXMEM_HOST_UPDATE_GBPS"


def round_2(x: float) -> float:
    return round(x, 1 - int(math.floor(math.log10(x)))) if x > 0 else x


@functools.lru_cache(maxsize=2)
def host_update_bytes_per_s(fused: bool = False) -> float:
    """Parameter bytes per second an AdamW update on this machine's CPU runs at, torch's fused CPU kernel
    (`fused=True`, about ten times faster on a 2-core CPU) or its default per-tensor one (see the module's note)."""
    given = os.environ.get(ENV, "").strip()
    if given:
        try:
            rate = float(given) * 1e9
            if rate > 0:
                return rate
        except ValueError:
            pass
        raise ValueError(f"{ENV}={given!r}: expected a positive number of GB/s")
    kept = price_record.recorded("cpu", ("AdamW update bytes/s", bool(fused)))
    if kept is not None:
        return kept
    import torch

    p = torch.nn.Parameter(torch.zeros(1 << 22))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=bool(fused) or None)
    opt.step()  # the state's allocation is not the steady step
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    rate = round_2(p.numel() * p.element_size() / best)
    price_record.record("cpu", ("AdamW update bytes/s", bool(fused)), rate)
    price_record.flush()
    return rate
