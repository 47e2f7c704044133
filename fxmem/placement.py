"""Multi-device placement: `fxmem.optimize(model, budget_gb=..., devices=[...])`.

Reads the model's keep-all plan (per forward value: module path, seconds, saved bytes) and its
parameters; cuts the model into units (`fxmem.units`: modules, opening containers and layer-list wrappers, so a
transformers decoder splits between its layers), places contiguous runs of units on the devices with `fxmem.solve.placement`, and runs
the captured graph with `passes/devices.py` moves. Per unit, memory is its parameters and their
gradients plus the activations it saves for backward (the keep-all step); time is three times its
forward estimate (forward plus a backward of about twice the work). The step runs the devices one
after another (model parallel in one process, no pipelining). Writes nothing to disk.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx

from fxmem.capture import capture, flat_graph_inputs, structure_outputs
from fxmem.cost import DeviceSpec, module_path
from fxmem.engine import plan_step, signature_of
from fxmem.errors import InfeasibleBudgetError
from fxmem.passes.devices import place
from fxmem.plan import DeviceRow, NodeRow, Plan
from fxmem.planner import PlanRequest
from fxmem.solve.placement import PlacementError, place_regions
from fxmem.units import unit_path
from fxmem.wrapper import ModelWrapper

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
    except PlacementError as error:
        raise InfeasibleBudgetError(min(b for b in budgets if b is not None), max(memory, default=0), {
            "parameters and gradients": 2 * sum(params), "saved activations": sum(saved)}) from error
    entries = []
    for k, device in enumerate(devices):
        entries.append(DeviceRow(
            device=str(device), modules=tuple(u for u, d in zip(order, placement.device) if d == k),
            parameter_bytes=sum(p for p, d in zip(params, placement.device) if d == k),
            peak_bytes=placement.memory[k], seconds=placement.seconds[k], budget_bytes=budgets[k]))
    limits = [b for b in budgets if b is not None]
    return dataclasses.replace(plan, devices=tuple(entries), budget_bytes=min(limits) if limits else plan.budget_bytes)


def node_devices(model: torch.nn.Module, gm: torch.fx.GraphModule, plan: Plan) -> dict[str, tuple[str, int]]:
    """(device, region) per node of a captured graph: its module's unit's; nodes outside any module
    run where the node before them ran."""
    where = {u: (e.device, k) for k, e in enumerate(plan.devices) for u in e.modules}
    devices: dict[str, tuple[str, int]] = {}
    current = (plan.devices[0].device, 0)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner = node.target.rpartition(".")[0]
            devices[node.name] = where.get(unit_path(model, owner), current) if owner else current
            continue
        path = module_path(node) if node.op != "call_module" else str(node.target)
        if path:
            current = where.get(unit_path(model, path), current)
        devices[node.name] = current
    return devices


class PlacedModule(ModelWrapper):
    """The model's own parameters and submodules, placed on several devices; trains like the model."""

    def __init__(self, model: torch.nn.Module, devices: Sequence[str], budgets: Sequence[int | None],
                 plan: Plan | None, device: DeviceSpec):
        super().__init__(model, _setup=(list(devices), list(budgets), plan, device), _graph=None, plan=plan)

    @property
    def plans(self) -> list[Plan]:
        return [self.plan] if self.plan is not None else []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._graph is None:
            self._build(args, kwargs)
        flat = flat_graph_inputs(self._graph, args, kwargs)
        raw = torch.fx.Interpreter(self._graph).run(*flat, enable_io_processing=False)
        return structure_outputs(self._graph, raw)

    def _build(self, args: tuple, kwargs: dict) -> None:
        devices, budgets, plan, device = self._setup
        model = self.fxmem_model
        if plan is None or not plan.devices:
            request = PlanRequest(device=device, model=getattr(model, "display_name", type(model).__qualname__),
                                  signature=signature_of(model, args, kwargs))
            plan = place_plan(model, plan_step(model, args, kwargs, request), devices, budgets)
        gm = capture(model, args, kwargs)
        place(gm, node_devices(model, gm, plan), str(plan.devices[0].device))
        object.__setattr__(self, "_graph", gm)
        object.__setattr__(self, "plan", plan)
