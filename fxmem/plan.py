"""The Plan: what to keep and recompute, keyed by joint-graph node names, with its predictions.

Reads and writes JSON files (sorted keys, a schema version, never pickle). A plan carries a
fingerprint of the graph it was made for, checked before it is applied.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from fxmem.errors import PlanMismatchError

SCHEMA_VERSION = 1
FXMEM_VERSION = "0.1.0"


@dataclass(frozen=True)
class Plan:
    """A memory plan for one model and input signature. Sizes in bytes, times in seconds."""

    budget_bytes: int
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    min_budget_bytes: int | None
    extra_flops: int
    total_flops: int
    predicted_step_s: float
    baseline_step_s: float
    recompute: tuple[str, ...]
    saved: tuple[str, ...]
    solver: str
    solver_status: str
    solver_gap: float
    solve_time_s: float
    device: str
    model: str
    signature: str
    fingerprint: str
    torch_version: str
    breakdown: dict[str, int] = field(default_factory=dict)
    nodes: tuple[dict[str, Any], ...] = ()
    pool: dict[str, dict[str, Any]] | None = None  # per graph ("forward", "backward"): passes.pool.PoolStats
    stages: tuple[dict[str, Any], ...] = ()  # pipeline stages (fxmem.pipeline); empty for one device
    stage_balance: float | None = None  # slowest stage / lower bound
    pipeline: dict[str, Any] = field(default_factory=dict)  # cuts, schedule, inputs, graph fingerprint
    fxmem_version: str = FXMEM_VERSION
    schema_version: int = SCHEMA_VERSION
    offload: tuple[str, ...] = ()  # saved values copied to host memory and back
    offloaded_bytes: int = 0
    exposed_transfer_s: float = 0.0  # part of predicted_step_s spent waiting on the host link
    host_link: str = ""
    devices: tuple[dict[str, Any], ...] = ()  # per device: modules, parameter bytes, peak, seconds
    # Simulated live bytes over the step, {"eager": MemoryTimeline, "plan": MemoryTimeline}, for
    # pictures; kept in memory only (not written to JSON, not compared).
    timelines: Any = field(default=None, compare=False, repr=False)

    def device_of(self, module_path: str) -> str | None:
        """The device a module (dotted path, "" for the root) runs on under a multi-device plan;
        None for a single-device plan. A module not named in the plan lives where its parent does."""
        if not self.devices:
            return None
        best, depth = self.devices[0]["device"], -1
        for entry in self.devices:
            for prefix in entry.get("modules", ()):
                inside = prefix == "" or module_path == prefix or module_path.startswith(prefix + ".")
                if inside and prefix.count(".") + (prefix != "") > depth:
                    best, depth = entry["device"], prefix.count(".") + (prefix != "")
        return best

    @property
    def extra_flops_pct(self) -> float:
        return 100.0 * self.extra_flops / self.total_flops if self.total_flops else 0.0

    @property
    def activation_reduction_pct(self) -> float:
        """Share of the eager step's memory above parameters, gradients and inputs that the plan removes."""
        floor = self.breakdown.get("parameters, buffers and inputs", 0) + self.breakdown.get("gradients", 0)
        above = self.baseline_peak_bytes - floor
        return 100.0 * (self.baseline_peak_bytes - self.predicted_peak_bytes) / above if above > 0 else 0.0

    def table(self, by: str = "module") -> str:
        from fxmem.report import format_plan

        return format_plan(self, by=by)

    # ---- files -------------------------------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(dataclasses.replace(self, timelines=None))
        data.pop("timelines")
        return json.dumps(data, sort_keys=True, indent=1)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{source} is not a plan file (invalid JSON: {exc})") from None
        if not isinstance(data, dict) or "schema_version" not in data:
            raise PlanMismatchError(f"{source} is not an fxmem plan file (no schema_version)")
        if data["schema_version"] != SCHEMA_VERSION:
            raise PlanMismatchError(
                f"{source} uses plan schema {data['schema_version']}, this fxmem reads schema {SCHEMA_VERSION}; "
                "make the plan again with this version")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise PlanMismatchError(f"{source} has fields this fxmem does not know: {sorted(unknown)}")
        for key in ("recompute", "saved", "nodes", "offload", "devices", "stages"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read(), source=str(path))

    # ---- applying ----------------------------------------------------------------------------
    def check_applies(self, *, model: str, signature: str, fingerprint: str, torch_version: str) -> None:
        """Raise PlanMismatchError naming what differs between this plan and the graph at hand."""
        diffs = []
        if model != self.model:
            diffs.append(f"model: plan is for {self.model}, got {model}")
        if signature != self.signature:
            diffs.append(f"inputs: plan is for {self.signature}, got {signature}")
        if torch_version != self.torch_version:
            diffs.append(f"torch: plan made with {self.torch_version}, running {torch_version}")
        if fingerprint != self.fingerprint and not diffs:
            diffs.append("graph: same model class and inputs but a different traced graph "
                         "(changed config, training/eval mode, or code)")
        if diffs:
            raise PlanMismatchError("this plan was made for another model or input signature: "
                                    + "; ".join(diffs) + ". Make a new plan with fxmem.plan(...) for this one.")


def graph_fingerprint(gm: Any) -> str:
    """Hash of (name, op, target, shape, dtype) over every node of an fx graph, the same in every
    process: targets by qualified name (a function's repr holds its address)."""
    from torch.fx.node import _get_qualified_name

    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else _get_qualified_name(node.target)
        val = node.meta.get("val")
        shape = tuple(getattr(val, "shape", ())) if val is not None else None
        dtype = str(getattr(val, "dtype", ""))
        digest.update(f"{node.name}|{node.op}|{target}|{shape}|{dtype}\n".encode())
    return digest.hexdigest()[:32]
