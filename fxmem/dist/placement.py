"""Multi-device placement: `fxmem.optimize(model, budget_gb=..., devices=[...])`.

Reads the model's captured step and its keep-all plan; `fxmem.dist.regions` places contiguous runs of
units (`fxmem.trace.units`: modules, opening containers and layer-list wrappers, so a transformers decoder
splits between its layers) on the devices and plans each device's region under its budget, recompute
included, with the engine's planner. `PlacedModule` runs the regions one after another (model
parallel in one process, no pipelining), moving what crosses a region boundary to the next device
(`passes/devices.py`'s `to_device`). The step is captured and planned where the model is before its
regions move (the inputs are moved there for planning: the caller puts them where the first region
runs), each region priced as its device. `place_plan` gives the keep-all placement of a plan, for
reports: per unit, its parameters and their gradients plus the activations it saves for backward.
Writes nothing to disk.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.trace.capture import flat_graph_inputs, structure_outputs
from fxmem.price.cost import DeviceSpec, preset_for
from fxmem.run.engine import OptimizedModule, signature_of
from fxmem.errors import InfeasibleBudgetError, PlanMismatchError
from fxmem.dist.pipeline import eager_plan_and_joint
from fxmem.planner.plan import DeviceRow, NodeRow, Plan
from fxmem.planner.planner import PlanRequest
from fxmem.dist.regions import Region, RegionPlanner, Units, place_and_plan, price_units, run_regions
from fxmem.solve.placement import PlacementError, place_regions
from fxmem.solve.stages import min_max_cuts
from fxmem.trace.units import unit_path
from fxmem.trace.wrapper import ModelWrapper

def check_devices(devices: Sequence[str]) -> list[str]:
    """The devices, if this torch build and machine have them all; otherwise a ValueError naming what is missing."""
    if not devices:
        raise ValueError("devices= needs at least one device, e.g. ['cuda:0', 'cuda:1']")
    for name in devices:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"devices={list(devices)}: {name!r} is not a device name (e.g. 'cuda:0', 'cpu')") from None
        if device.type in ("cpu", "meta"):
            continue
        backend = getattr(torch, device.type, None)
        count = backend.device_count() if backend is not None and backend.is_available() else 0
        if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
            why = f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch"
        elif count == 0:
            why = f"torch sees no {device.type} device on this machine"
        elif (device.index or 0) >= count:
            why = f"{name} does not exist: torch sees {count} {device.type} device{'s' if count > 1 else ''}"
        else:
            continue
        raise ValueError(f"devices={list(devices)}: {why}. Place on devices that are present (to try a placement "
                         "without them, devices=['cpu', 'cpu'])")
    return list(devices)


def _units(model: torch.nn.Module, rows: Sequence[NodeRow]) -> tuple[list[str], dict[str, list[NodeRow]]]:
    """Units in forward order; rows of root-level ops join the unit running before them."""
    order: list[str] = []
    members: dict[str, list[NodeRow]] = {}
    current = None
    for row in rows:
        unit = unit_path(model, row.module)
        if unit and unit not in members:  # a unit seen before (tied weights) does not start a new run
            order.append(unit)
            members[unit] = []
            current = unit
        members.setdefault("" if current is None else current, []).append(row)
    if not order:
        order, members = [""], {"": list(rows)}
    elif "" in members:
        members[order[0]] = members.pop("") + members[order[0]]
    return order, members


def _parameter_bytes(model: torch.nn.Module, unit: str) -> int:
    owner = model.get_submodule(unit) if unit else model
    seen = {id(p): p.numel() * p.element_size() for p in owner.parameters()}
    return sum(seen.values())


def place_plan(model: torch.nn.Module, plan: Plan, devices: Sequence[str], budgets: Sequence[int | None]) -> Plan:
    """`plan` (a keep-all plan of the model) with `devices` entries: which units run where."""
    order, members = _units(model, plan.nodes)
    params = [_parameter_bytes(model, u) for u in order]
    saved = [sum(r.bytes for r in members[u] if r.kept_on_device) for u in order]
    memory = [2 * p + a for p, a in zip(params, saved)]
    seconds = [3 * sum(r.seconds for r in members[u]) for u in order]
    try:
        placement = place_regions(seconds, memory, budgets)
    except PlacementError as error:  # the least per-device budget some placement keeping everything fits
        refused = min(b for b in budgets if b is not None)
        cuts = min_max_cuts(memory, len(devices)) if len(memory) >= len(devices) else range(1, len(memory))
        bounds = [0, *cuts, len(memory)]
        least = max(sum(memory[bounds[k]:bounds[k + 1]]) for k in range(len(bounds) - 1))
        raise InfeasibleBudgetError(refused, max(least, refused + 1), {
            "parameters and gradients": 2 * sum(params), "saved activations": sum(saved)}) from error
    entries = []
    for k, device in enumerate(devices):
        entries.append(DeviceRow(
            device=str(device), modules=tuple(u for u, d in zip(order, placement.device) if d == k),
            parameter_bytes=sum(p for p, d in zip(params, placement.device) if d == k),
            peak_bytes=placement.memory[k], seconds=placement.seconds[k], budget_bytes=budgets[k]))
    limits = [b for b in budgets if b is not None]
    return dataclasses.replace(plan, devices=tuple(entries), budget_bytes=min(limits) if limits else plan.budget_bytes)


class PlacedModule(ModelWrapper):
    """The model's own parameters and submodules, placed on several devices; trains like the model.

    Each device runs its region of the model (`fxmem.dist.regions`) as a step planned under its budget,
    recompute included; a region's parameters are moved to its device in place (they stay the model's)."""

    def __init__(self, model: torch.nn.Module, devices: Sequence[str], budgets: Sequence[int | None],
                 plan: Plan | None, device: DeviceSpec | None, solver: str = "auto", time_limit_s: float = 10.0):
        super().__init__(model, _setup=(list(devices), list(budgets), plan, device, solver, time_limit_s),
                         _graph=None, _regions=[], _runners=[], plan=plan)

    @property
    def plans(self) -> list[Plan]:
        return [self.plan] if self.plan is not None else []

    @property
    def region_plans(self) -> list[Plan | None]:
        """The plan of each device's region, in device order (None for a device without one)."""
        return [r.plan for r in self._regions]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._graph is None:
            self._build(args, kwargs)
        flat = flat_graph_inputs(self._graph, args, kwargs)
        raw = run_regions(self._regions, self._runners, self._graph, flat, self._regions[0].device)
        return structure_outputs(self._graph, raw)

    def _build(self, args: tuple, kwargs: dict) -> None:
        devices, budgets, given, device, solver, time_limit_s = self._setup
        model = self.fxmem_model
        args, kwargs = planning_inputs(model, args, kwargs)  # planned where the model is, before any region moves
        # each region priced as its device (the one given to optimize, else the device's own preset)
        specs = {d: device if device is not None else preset_for(d) for d in devices}
        request = PlanRequest(device=specs[devices[0]], model=getattr(model, "display_name", type(model).__qualname__),
                              signature=signature_of(model, args, kwargs), solver=solver, time_limit_s=time_limit_s)
        eager, joint, gm = eager_plan_and_joint(model, args, kwargs, request)
        units = price_units(model, args, kwargs, eager, joint, gm)
        fixed = _bounds_of(units, given) if given is not None and given.devices else None
        regions = place_and_plan(units, RegionPlanner(units, args, kwargs, request, specs), devices, budgets, fixed)
        runners = []
        for region in regions:
            if region.module is None:
                runners.append(None)
                continue
            for tensor in list(region.module.parameters()) + list(region.module.buffers()):
                if tensor.device != torch.device(region.device):  # in place: they stay the model's tensors
                    tensor.data = tensor.data.to(region.device)
            runners.append(_runner(region, specs[region.device]))
        object.__setattr__(self, "_graph", gm)
        object.__setattr__(self, "_regions", regions)
        object.__setattr__(self, "_runners", runners)
        object.__setattr__(self, "plan", _placed_plan(eager, units, regions))


def planning_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs, on the device of the model's parameters (and buffers) for planning: the regions are
    captured and planned before they move to their devices, so the inputs (which the caller put where
    the first region runs, e.g. CUDA ids for a CPU embedding) go to where the model still is."""
    home = next(itertools.chain(model.parameters(), model.buffers()), None)
    if home is None:
        return args, kwargs
    move = lambda t: t if t.device == home.device else t.to(home.device)  # noqa: E731
    return pytree.tree_map_only(torch.Tensor, move, (tuple(args), dict(kwargs)))


def _runner(region: Region, spec: DeviceSpec) -> torch.nn.Module:
    """The region's module running its plan (the engine's compiled step), priced as `spec`; as captured
    where nothing in it takes a gradient."""
    module, plan = region.module, region.plan
    if plan is None:
        return module
    return OptimizedModule(module, lambda _, args, kwargs: PlanRequest(
        budget_bytes=plan.budget_bytes, plan=plan, model=type(module).__qualname__,
        signature=signature_of(module, args, kwargs), device=spec), loss_options=None, fixed_plan=True)


def _bounds_of(units: Units, plan: Plan) -> tuple[int, ...]:
    """The placement a plan made earlier records: each device's units, by label."""
    bounds, labels = [0], units.labels
    for entry in plan.devices:
        taken = [labels.index(m) for m in entry.modules if m in labels]
        bounds.append(max(taken) + 1 if taken else bounds[-1])
    if bounds[-1] != len(labels) or sorted(bounds) != bounds:
        raise PlanMismatchError("the plan's device placement names other units than this model has; make the plan "
                                "again for this model with fxmem.optimize(model, budget_gb=..., devices=[...])")
    return tuple(bounds)


def _placed_plan(eager: Plan, units: Units, regions: Sequence[Region]) -> Plan:
    """The keep-all plan of the whole step with one entry per device: its units, parameters, the
    predicted peak of its region's plan, and its budget."""
    entries = []
    for region in regions:
        span = range(region.first, region.last)
        entries.append(DeviceRow(
            device=region.device, modules=tuple(units.labels[u] for u in span),
            parameter_bytes=sum(units.param_bytes[u] for u in span),
            peak_bytes=region.plan.predicted_peak_bytes if region.plan is not None else 0,
            seconds=sum(units.seconds[u] for u in span), budget_bytes=region.budget))
    limits = [r.budget for r in regions if r.budget is not None]
    return dataclasses.replace(eager, devices=tuple(entries), budget_bytes=min(limits) if limits else eager.budget_bytes,
                               predicted_peak_bytes=max(e.peak_bytes for e in entries))
