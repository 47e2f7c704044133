"""The planning margin: how far below the budget a plan aims, per device kind.

Measured, not guessed: the largest share by which a measured peak exceeded fxmem's prediction on the
models `scripts/margin.py` trains (MemTracker on CPU; `torch.cuda.max_memory_allocated` on a GPU),
plus a floor in bytes for what no prediction sees (autograd's seed gradient, a kernel's small
scratch). Reads and writes nothing; the planner takes the margin off the budget before it fits.
"""
from __future__ import annotations

from dataclasses import dataclass

FLOOR_BYTES = 64 * 1024


@dataclass(frozen=True)
class Margin:
    """The largest error seen where it was `measured`: measured - predicted, as a share of the
    prediction (`fraction`) where it grew with the step, else in bytes (`error_bytes`)."""

    fraction: float
    error_bytes: int
    measured: str

    def bytes_for(self, budget: int) -> int:
        """What a plan leaves free under `budget`."""
        return FLOOR_BYTES + self.error_bytes + int(budget * self.fraction)

    def least_budget(self, peak: int) -> int:
        """The least budget whose margin still leaves `peak` room."""
        budget = int((peak + FLOOR_BYTES + self.error_bytes) / (1 - self.fraction)) + 1
        while budget - self.bytes_for(budget) < peak:
            budget += 1
        while budget - 1 - self.bytes_for(budget - 1) >= peak:
            budget -= 1
        return budget

    def describe(self) -> str:
        error = " + ".join(([f"{self.fraction:.2%}"] if self.fraction else [])
                           + ([f"{self.error_bytes / 2**20:.2f} MiB"] if self.error_bytes else [])) or "0 B"
        return f"{FLOOR_BYTES // 1024} KiB + the largest error measured {self.measured}, {error}"


MARGINS = {
    # python scripts/margin.py, 25 plans on 11 models (the zoo's tiny presets, transformers with labels=) at
    # 0.9x and 0.6x eager's peak and at the least: largest measured - predicted +0.335% (unet-tiny, 0.9x)
    "cpu": Margin(0.0034, 0, "on CPU"),
    # scripts/bench.py on an H100, gpt-small b32, 9 plans from 789 to 1942 MiB: measured 1.31-2.06 MiB above
    # the prediction (../shared/gpu/h100/bench-gpt-small-b32.md); and on an H100 with torch 2.11
    # (BENCHMARKS.md, "On an H100"): gpt-small b8 +0.57% (1.49 MiB at 258.5), transformers GPT-2 124M at
    # 8x1024 with the loss in 16 chunks +0.48% (8.7 MiB at 1816.9: each block over 1 MiB the caching
    # allocator hands out may carry up to 1 MiB it did not split off, so the error grows with the step)
    "cuda": Margin(0.006, 2_170_000, "on an H100"),
}


def margin_for(device_name: str) -> Margin:
    """The margin of the device a plan is made for: a GPU preset's (cuda), or the CPU's."""
    return MARGINS["cpu" if device_name == "cpu" else "cuda"]
