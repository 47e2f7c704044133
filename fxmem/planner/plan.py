"""The Plan: what to keep, recompute and offload, keyed by joint-graph node names, with its predictions.

One section per planner: the step (every plan: decisions per node as typed `NodeRow`s, predicted
peak and time), `pool` (arenas, when pooled), `pipeline` (stages, when split for
torch.distributed.pipelining) and `devices` (regions, when placed on several devices).
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
from fxmem.passes.pool import PoolStats
from fxmem.planner.report import format_plan

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
FXMEM_VERSION = "0.1.0"
DECISIONS = ("save", "offload", "recompute", "free")


@dataclass(frozen=True)
class NodeRow:
    """A forward value backward may need. `bytes`: storage it keeps when saved (0 for views);
    `decision`: "save" (kept on the device), "offload" (kept in host memory), "recompute", or "free"
    (backward does not need it)."""

    name: str
    op: str
    module: str
    bytes: int
    flops: int
    seconds: float
    decision: str

    @property
    def kept_on_device(self) -> bool:
        return self.decision == "save"


@dataclass(frozen=True)
class PoolSection:
    """The forward and backward graphs' arenas and the pooled step's simulated peak."""

    forward: PoolStats | None
    backward: PoolStats | None
    predicted_peak_bytes: int


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage: its units (module paths), the captured-graph nodes it runs, the parameters it
    holds, its predicted peak and time. `plan`: the stage's own recompute plan (a plan file's
    content) when it only fits with recompute. `peak_from`: "fxmem planner" or "stage model"."""

    index: int
    modules: tuple[str, ...]
    nodes: tuple[str, ...]
    parameters: tuple[str, ...]
    param_bytes: int
    activation_bytes: int
    in_flight: int
    predicted_peak_bytes: int
    time_s: float
    compute_s: float
    transfer_s: float
    sends: tuple[str, ...]
    recompute: bool
    plan: dict[str, Any] | None
    peak_from: str

    def stage_plan(self) -> "Plan | None":
        return Plan.from_dict(self.plan, source=f"stage {self.index}'s plan") if self.plan else None


@dataclass(frozen=True)
class PipelineSection:
    """Stages cut for `torch.distributed.pipelining`, and the per-unit costs they were solved from."""

    num_stages: int
    schedule: str
    n_microbatches: int
    optimizer: str | float | None
    stages: tuple[StageRow, ...]
    balance: float  # slowest stage / lower bound
    lower_bound_s: float
    slowest_s: float
    first_units: tuple[int, ...]
    num_units: int
    units: tuple[str, ...]
    graph_fingerprint: str
    inputs: tuple[dict[str, Any], ...]
    shared_parameters: tuple[str, ...]
    link_bytes_per_s: float
    unit_time_s: tuple[float, ...]
    unit_recompute_s: tuple[float, ...]
    unit_param_bytes: tuple[int, ...]
    unit_act_bytes: tuple[int, ...]
    unit_ckpt_bytes: tuple[int, ...]
    cut_bytes: tuple[int, ...]
    shared: tuple[tuple[int, tuple[int, ...]], ...]
    opt_bytes_per_param_byte: float
    budget_bytes: int | None


@dataclass(frozen=True)
class DeviceRow:
    """One device of a placed model: the units (module paths) it runs and what they need."""

    device: str
    modules: tuple[str, ...]
    parameter_bytes: int
    peak_bytes: int
    seconds: float
    budget_bytes: int | None


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
    nodes: tuple[NodeRow, ...] = ()
    offload: tuple[str, ...] = ()  # saved values copied to host memory and back
    offloaded_bytes: int = 0
    exposed_transfer_s: float = 0.0  # part of predicted_step_s spent waiting on the host link
    host_link: str = ""
    timing: str = ""  # where the step's times come from: the device's roofline, or measured kernels
    graph_device: str = ""  # the device type of the fake tensors the graph was traced on ("cpu", "cuda")
    optimizer_state_bytes: int = 0  # on the device for the whole step (counted in the peaks and the budget)
    resident_gradient_bytes: int = 0  # gradients existing when the step starts (accumulation), counted so too
    resident_gradients: str = ""  # what they are: "" (every .grad None), "accumulating", zeros (fxmem.price.accumulation)
    host_state_bytes: int = 0  # optimizer state in host memory (fxmem.planner.host_state), not in the peaks
    host_parameters: tuple[str, ...] = ()  # the parameters whose state is there
    host_update_s: float = 0.0  # their update on the host CPU (in predicted_step_s)
    host_copy_s: float = 0.0  # their gradients out, values back over the host link (exposed: in exposed_transfer_s)
    host_options: tuple[dict, ...] = ()  # the mixes considered (fxmem.planner.host_state): one dict each
    host_gradients: tuple[str, ...] = ()  # parameters whose gradients backward moves to the host (passes/host_gradients.py)
    host_gradient_bytes: int = 0  # those gradients' bytes: in host memory, not in the peaks
    eager_peak_bytes: int | None = None  # PyTorch eager's step, MemTracker on fake tensors (fxmem.trace.eager_meter)
    capture: str = ""  # how the step was captured: one graph (and by which tracer) or Dynamo's graph k of n
    loss: str = ""  # where the step's loss is: in the plan (loss_fn, the model's own) or outside it
    loss_chunks: int = 1  # the loss computed in this many chunks of tokens (passes/chunked_loss.py); 1: as traced
    loss_chunk_tokens: str = ""  # tokens per chunk, per loss site
    attention_chunks: int = 1  # naive attention computed in this many chunks of queries (passes/chunked_attention.py)
    attention_chunk_rows: str = ""  # query rows per chunk, and how many attention sites
    numerics: str = ""  # how a rewrite changes the results' rounding against eager's (empty: it does not)
    policy: str = ""  # the named policy that decided the plan, and what it did (fxmem.planner.policies); "" for a budget's
    inner: str = ""  # what runs the planned graphs: "aot_eager" (eager kernels) or "inductor"; "" in older files
    runs_eagerly: bool = False  # PyTorch's own step, which fits the budget below fxmem's keep-all (fxmem.run.eager_step)
    fallback_ops: tuple[str, ...] = ()  # ops with no FLOP formula, priced by memory traffic (no FLOPs counted)
    priced_as: dict[str, str] = field(default_factory=dict)  # graph op -> the target GPU's kernel priced for it
    pool: PoolSection | None = None
    pipeline: PipelineSection | None = None
    devices: tuple[DeviceRow, ...] = ()
    fxmem_version: str = FXMEM_VERSION
    schema_version: int = SCHEMA_VERSION
    # Simulated live bytes over the step, {"eager": MemoryTimeline, "plan": MemoryTimeline}, for
    # pictures; kept in memory only (not written to JSON, not compared).
    timelines: Any = field(default=None, compare=False, repr=False)

    def device_of(self, module_path: str) -> str | None:
        """The device a module (dotted path, "" for the root) runs on under a multi-device plan;
        None for a single-device plan. A module not named in the plan lives where its parent does."""
        if not self.devices:
            return None
        best, depth = self.devices[0].device, -1
        for entry in self.devices:
            for prefix in entry.modules:
                inside = prefix == "" or module_path == prefix or module_path.startswith(prefix + ".")
                if inside and prefix.count(".") + (prefix != "") > depth:
                    best, depth = entry.device, prefix.count(".") + (prefix != "")
        return best

    @property
    def saved_bytes(self) -> int:
        """Bytes of the values kept on the device from forward to backward."""
        return sum(r.bytes for r in self.nodes if r.kept_on_device)

    def saved_bytes_by_node(self) -> dict[str, int]:
        return {r.name: r.bytes for r in self.nodes if r.kept_on_device}

    @property
    def extra_flops_pct(self) -> float:
        return 100.0 * self.extra_flops / self.total_flops if self.total_flops else 0.0

    @property
    def activation_reduction_pct(self) -> float:
        """Share of the eager step's memory above parameters, gradients, inputs (and BLAS workspaces)
        that the plan removes."""
        floor = sum(self.breakdown.get(k, 0) for k in ("parameters, buffers and inputs", "gradients", "BLAS workspaces"))
        above = self.baseline_peak_bytes - floor
        return 100.0 * (self.baseline_peak_bytes - self.predicted_peak_bytes) / above if above > 0 else 0.0

    def table(self, by: str = "module", all_rows: bool = False, width: int = 120) -> str:
        """The plan as text: per module (or op) what is kept and recomputed, with totals, then a summary.
        Modules that keep and recompute nothing are left out unless `all_rows`. Lines fit in `width` columns
        (long op lists and module paths abbreviated, long summary values wrapped)."""
        return format_plan(self, by=by, all_rows=all_rows, width=width)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, timelines=None))
        data.pop("timelines")
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{source} is not a plan file (invalid JSON: {exc})") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> "Plan":
        if not isinstance(data, dict) or "schema_version" not in data:
            raise PlanMismatchError(f"{source} is not an fxmem plan file (no schema_version)")
        if data["schema_version"] not in READABLE_SCHEMAS:
            raise PlanMismatchError(
                f"{source} uses plan schema {data['schema_version']}, this fxmem reads schemas "
                f"{', '.join(map(str, READABLE_SCHEMAS))}; make the plan again with this version")
        data = _upgrade(dict(data))
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "timelines"}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise PlanMismatchError(f"{source} has fields this fxmem does not know: {unknown}")
        missing = sorted(name for name, f in fields.items() if name not in data
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise PlanMismatchError(f"{source} is an incomplete plan file: it lacks {', '.join(missing)}; "
                                    "make the plan again with fxmem.plan(...) or fxmem-plan --out")
        try:
            return cls(**_typed(data))
        except (TypeError, KeyError, ValueError) as exc:
            raise PlanMismatchError(f"{source} is a damaged plan file ({type(exc).__name__}: {exc}); "
                                    "make the plan again") from None

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


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 file's fields in schema 2: stages and their balance moved into the pipeline section,
    the pool's step peak into the pool section."""
    if data["schema_version"] == 1:
        stages, balance = data.pop("stages", ()), data.pop("stage_balance", None)
        if data.get("pipeline"):
            data["pipeline"] = {**data["pipeline"], "stages": stages, "balance": balance}
        else:
            data["pipeline"] = None
        pool = data.get("pool")
        if pool:
            data["pool"] = {"forward": pool.get("forward"), "backward": pool.get("backward"),
                            "predicted_peak_bytes": pool.get("step", {}).get("predicted_peak_bytes", 0)}
        data["schema_version"] = SCHEMA_VERSION
    return data


def _typed(data: dict[str, Any]) -> dict[str, Any]:
    """JSON values as the Plan's field types: tuples for sequences, rows and sections as dataclasses."""
    data = dict(data)
    for key in ("recompute", "saved", "offload", "fallback_ops", "host_parameters", "host_gradients"):
        data[key] = tuple(data.get(key, ()))
    data["host_options"] = tuple(dict(row) for row in data.get("host_options", ()))
    data["nodes"] = tuple(NodeRow(**row) for row in data.get("nodes", ()))
    data["devices"] = tuple(DeviceRow(**{**row, "modules": tuple(row["modules"])}) for row in data.get("devices", ()))
    pool = data.get("pool")
    if pool:
        data["pool"] = PoolSection(*(PoolStats(**pool[g]) if pool.get(g) else None for g in ("forward", "backward")),
                                   pool["predicted_peak_bytes"])
    pipe = data.get("pipeline")
    if pipe:
        stages = tuple(StageRow(**{**s, **{k: tuple(s[k]) for k in ("modules", "nodes", "parameters", "sends")}})
                       for s in pipe["stages"])
        tuples = ("first_units", "units", "inputs", "shared_parameters", "unit_time_s", "unit_recompute_s",
                  "unit_param_bytes", "unit_act_bytes", "unit_ckpt_bytes", "cut_bytes")
        data["pipeline"] = PipelineSection(**{**pipe, **{k: tuple(pipe[k]) for k in tuples}, "stages": stages,
                                              "shared": tuple((size, tuple(users)) for size, users in pipe["shared"])})
    return data


def graph_fingerprint(gm: Any, shapes: bool = True) -> str:
    """Hash of (name, op, target, shape, dtype) over every node of an fx graph, the same in every
    process: targets by qualified name (a function's repr holds its address). Without `shapes`, equal for
    the graphs of one step traced at other sizes (`fxmem.planner.shape_reuse`)."""
    from torch.fx.node import _get_qualified_name  # only when fingerprinting: plan files load without torch

    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else _get_qualified_name(node.target)
        val = node.meta.get("val")
        shape = tuple(getattr(val, "shape", ())) if val is not None else None
        dtype = str(getattr(val, "dtype", ""))
        digest.update((f"{node.name}|{node.op}|{target}|{shape}|{dtype}\n" if shapes else
                       f"{node.name}|{node.op}|{target}|{dtype}\n").encode())
    return digest.hexdigest()[:32]
