"""Memory timeline picture: live bytes over one training step, fxmem's keep-all step against the plan.

Reads a Plan's in-memory `timelines` (the simulator's MemoryTimeline for the keep-all step, nothing
recomputed, and for the plan, kept by the planner), PyTorch eager's measured peak where the plan has it,
and its recompute (and offload, when present) node names; writes a PNG with matplotlib (imported here
only, with a clear error if it is missing).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

from fxmem.errors import FxmemError

MIB = 2**20


NEEDS_MATPLOTLIB = ("drawing the memory timeline needs matplotlib: pip install 'fxmem[plot]' "
                    "(or pip install matplotlib)")


def check_matplotlib() -> None:
    """Raise FxmemError (one line) where matplotlib cannot be imported, without importing it."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out package
        found = False
    if not found:
        raise FxmemError(NEEDS_MATPLOTLIB)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise FxmemError(NEEDS_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _spans(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) index ranges where `flags` is True."""
    spans, start = [], None
    for i, flag in enumerate(flags + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def plot_timeline(plan: Any, path: str | os.PathLike, *, title: str | None = None) -> str:
    """Draw live MiB per op of the keep-all step and of `plan`, the budget, PyTorch eager's peak (where the
    plan has it: `eager_meter=True`, as fxmem-plan plans), and where the plan recomputes (or offloads)
    values; save a PNG at `path` and return the path. The two peaks are the plan table's, by its names."""
    timelines = getattr(plan, "timelines", None)
    if not timelines or "eager" not in timelines or "plan" not in timelines:
        raise FxmemError("this plan has no memory timelines (a plan loaded from JSON or applied, not made, "
                         "has none); make it with fxmem.plan(...) to draw it")
    plt = _pyplot()
    eager, planned = timelines["eager"], timelines["plan"]
    unit, scale = ("GiB", 2**30) if max(eager.peak, plan.budget_bytes, plan.eager_peak_bytes or 0) >= 2 * 2**30 \
        else ("MiB", MIB)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    ax.plot(range(len(eager.live)), [b / scale for b in eager.live], color="tab:gray", lw=1.2,
            label=f"keep-all step: fxmem's, nothing recomputed (peak {eager.peak / scale:,.2f} {unit})")
    if plan.eager_peak_bytes:  # the plan table's "PyTorch eager's peak": measured, so a level, not a timeline
        ax.axhline(plan.eager_peak_bytes / scale, color="tab:gray", ls="-.", lw=1,
                   label=f"PyTorch eager's peak {plan.eager_peak_bytes / scale:,.2f} {unit} (MemTracker on fake tensors)")
    ax.plot(range(len(planned.live)), [b / scale for b in planned.live], color="tab:blue", lw=1.4,
            label=f"plan (peak {planned.peak / scale:,.2f} {unit})")
    ax.axhline(plan.budget_bytes / scale, color="tab:red", ls="--", lw=1,
               label=f"budget {plan.budget_bytes / scale:,.2f} {unit}")
    ax.axhline(planned.static / scale, color="tab:green", ls=":", lw=1, label="parameters, buffers, inputs")
    marks = (("recompute", set(plan.recompute), "tab:orange", "recomputed"),
             ("offload", set(getattr(plan, "offload", ()) or ()), "tab:purple", "offloaded"))
    for _, names, color, label in marks:
        flags = [phase == "backward" and name in names for name, phase in zip(planned.names, planned.phases)]
        for k, (start, end) in enumerate(_spans(flags)):
            ax.axvspan(start - 0.5, end - 0.5, color=color, alpha=0.25, lw=0, label=label if k == 0 else None)
    boundary = next((i for i, phase in enumerate(planned.phases) if phase == "backward"), None)
    if boundary is not None:
        ax.axvline(boundary - 0.5, color="black", lw=0.6, alpha=0.5)
        ax.text(boundary, ax.get_ylim()[1] * 0.98, " backward", va="top", fontsize=8)
    ax.set_xlabel("op in the training step (forward, then backward)")
    ax.set_ylabel(f"live memory, {unit}")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"{plan.model} {plan.signature}: {plan.extra_flops_pct:.1f}% extra FLOPs", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return str(path)
