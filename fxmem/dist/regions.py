"""Device regions planned with recompute: `fxmem.optimize(model, budget_gb=..., devices=[...])`.

Reads the model's captured graph cut into units (`passes/shard.py`: `model.layers.3`, runs of
top-level ops), the keep-all step's seconds per unit (`fxmem.dist.stage_costs.unit_costs`) and the
parameters each unit reads. A placement gives each device a contiguous run of units (a region, possibly
empty); placements are tried fastest first (the least slowest region, keep-all seconds), and each
region is planned by the engine's `plan_step` on its own module (the region's units; it takes the
values crossing its first cut and returns those crossing its last) under its device's budget, priced
as that device (a GPU's allocator holds its cuBLAS workspaces and rounds its blocks), with
recompute where keeping everything does not fit. Placements that would read a parameter or buffer on
two different devices (tied weights in the first and last units) are not tried: a tensor lives on one
device. The first placement whose regions all fit is kept. When none does, the refusal names the least
budget per device found: over placements, the least of the largest least budget the planner names for
their regions, so planning at it succeeds. Writes nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.trace.capture import flat_graph_inputs
from fxmem.price.cost import DeviceSpec
from fxmem.run.engine import plan_step, signature_of
from fxmem.errors import InfeasibleBudgetError, fmt_bytes, gb_at_least
from fxmem.passes.devices import to_device
from fxmem.passes.shard import Unit, crossing, split_stages, tag_units
from fxmem.planner.plan import Plan
from fxmem.planner.planner import PlanRequest
from fxmem.dist.stage_costs import unit_costs
from fxmem.meta_keys import UNIT, tag, has_tag

DETACH = (torch.ops.aten.detach.default, torch.Tensor.detach, "detach")


@dataclass(frozen=True)
class Units:
    """The captured graph cut into units, with what each costs in the keep-all step."""

    gm: torch.fx.GraphModule
    units: tuple[Unit, ...]
    seconds: tuple[float, ...]  # forward + backward
    param_bytes: tuple[int, ...]  # parameters a unit is the first to read
    floor_bytes: tuple[int, ...]  # those parameters and the gradients of those that train: a region holds them
    grad_inputs: frozenset[str]  # captured-graph nodes whose value requires grad in the step
    reads: tuple[frozenset[int], ...]  # ids of the parameters and buffers each unit reads

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(u.label for u in self.units)


@dataclass
class Region:
    """Units `first` .. `last` - 1 on `device` under `budget`: their module and its plan."""

    device: str
    first: int
    last: int
    budget: int | None
    module: torch.fx.GraphModule | None = None
    plan: Plan | None = None


def price_units(model: torch.nn.Module, args: tuple, kwargs: dict, eager: Plan, joint: torch.fx.GraphModule,
                gm: torch.fx.GraphModule) -> Units:
    """`gm` (the captured step) cut into units, priced from the keep-all plan `eager` and its `joint` graph."""
    units = tag_units(gm, model)
    fwd, bwd, _ = unit_costs(joint, gm, len(units), eager.saved_bytes_by_node())
    first_reader: dict[int, tuple[int, int, bool]] = {}  # parameter -> (first unit reading it, bytes, trains)
    for node in gm.graph.nodes:
        value = getattr_path(gm, node.target) if node.op == "get_attr" else None
        readers = [tag(u, UNIT) for u in node.users if has_tag(u, UNIT)]
        if isinstance(value, torch.nn.Parameter) and readers:
            unit = min(readers + [first_reader.get(id(value), (len(units),))[0]])
            first_reader[id(value)] = (unit, value.numel() * value.element_size(), value.requires_grad)
    params, floor = [0] * len(units), [0] * len(units)
    for unit, nbytes, trains in first_reader.values():
        params[unit] += nbytes
        floor[unit] += nbytes * (2 if trains else 1)
    return Units(gm, tuple(units), tuple(f + b for f, b in zip(fwd, bwd)), tuple(params), tuple(floor),
                 frozenset(_requiring_grad(gm, args, kwargs)), unit_reads(gm, len(units)))


def unit_reads(gm: torch.fx.GraphModule, num_units: int) -> tuple[frozenset[int], ...]:
    """Per unit, the ids of the parameters and buffers it reads: through get_attr nodes (export) or
    the submodules it calls (symbolic_trace keeps `self.wte(idx)` as one call_module node)."""
    reads: list[set[int]] = [set() for _ in range(num_units)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr_path(gm, node.target)
            if isinstance(value, torch.Tensor):
                for user in node.users:
                    if has_tag(user, UNIT):
                        reads[tag(user, UNIT)].add(id(value))
        elif node.op == "call_module" and has_tag(node, UNIT):
            owner = gm.get_submodule(node.target)
            reads[tag(node, UNIT)].update(id(t) for t in [*owner.parameters(), *owner.buffers()])
    return tuple(frozenset(r) for r in reads)


def same_device(a: str, b: str) -> bool:
    """Whether two device names are one device ('cpu' and 'cpu:1' are; 'cuda' is 'cuda:0')."""
    x, y = torch.device(a), torch.device(b)
    return x.type == y.type and (x.type == "cpu" or (x.index or 0) == (y.index or 0))


def keeps_shared_together(reads: Sequence[frozenset[int]], devices: Sequence[str], bounds: tuple[int, ...]) -> bool:
    """Whether every parameter or buffer that several units read (`reads`, per unit; tied embeddings:
    `lm_head.weight is wte.weight`) is read on one device only under the placement `bounds`: a tensor
    lives on one device, and a region on another could not read it."""
    home: dict[int, str] = {}
    for k, device in enumerate(devices):
        for u in range(bounds[k], bounds[k + 1]):
            for tensor in reads[u]:
                if not same_device(home.setdefault(tensor, device), device):
                    return False
    return True


def getattr_path(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _requiring_grad(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> set[str]:
    """Nodes whose value requires grad when the step runs: floating values computed from a parameter
    or an input that requires grad (the exported graph's fake values do not say)."""
    flat = flat_graph_inputs(gm, args, kwargs)
    grads: set[str] = set()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, value in zip(placeholders, flat):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            grads.add(node.name)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr_path(gm, node.target)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                grads.add(node.name)
        elif node.op in ("call_function", "call_method", "call_module") and node.target not in DETACH:
            val = node.meta.get("val")
            floating = isinstance(val, torch.Tensor) and val.is_floating_point()
            owned = node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
            if floating and (owned or any(i.name in grads for i in node.all_input_nodes)):
                grads.add(node.name)
    return grads


def placements(num_units: int, num_devices: int) -> list[tuple[int, ...]]:
    """Every contiguous placement: the bounds (0, ..., num_units) of each device's run, runs possibly empty."""
    return [(0, *cuts, num_units) for cuts in itertools.combinations_with_replacement(range(num_units + 1),
                                                                                       num_devices - 1)]


class RegionPlanner:
    """Plans regions of `units` (memoized by units and budget): `fit` returns the region's plan, or
    the least budget the planner names for it."""

    def __init__(self, units: Units, args: tuple, kwargs: dict, request: PlanRequest,
                 specs: Mapping[str, DeviceSpec] | None = None):
        self.units, self.args, self.kwargs, self.request = units, args, kwargs, request
        self.specs = dict(specs or {})  # the device each device name is priced as (else the request's)
        self.cuts = crossing(units.gm, len(units.units))
        self.done: dict[tuple[int, int, int | None, DeviceSpec], Plan | InfeasibleBudgetError | None] = {}
        self.modules: dict[tuple[int, int], torch.fx.GraphModule] = {}

    def module(self, first: int, last: int) -> torch.fx.GraphModule:
        key = (first, last)
        if key not in self.modules:
            n = len(self.units.units)
            stages = split_stages(self.units.gm, [b for b in (first, last) if 0 < b < n], n)
            self.modules[key] = stages[1 if first > 0 else 0]
        return self.modules[key]

    def inputs(self, first: int) -> list[Any]:
        """Example inputs of a region starting at unit `first`, requiring grad as they will in the step."""
        if first == 0:
            return flat_graph_inputs(self.units.gm, self.args, self.kwargs)
        values = []
        for node in self.cuts[first - 1]:
            v = node.meta["val"]
            t = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
            values.append(t.requires_grad_(node.name in self.units.grad_inputs))
        return values

    def fit(self, first: int, last: int, budget: int | None, device: str | None = None
            ) -> Plan | InfeasibleBudgetError | None:
        """The plan of units `first` .. `last` - 1 on `device` under `budget` (see the class)."""
        spec = self.specs.get(device, self.request.device) if device is not None else self.request.device
        key = (first, last, budget, spec)
        if key not in self.done:
            module, inputs = self.module(first, last), self.inputs(first)
            request = PlanRequest(budget_bytes=budget, device=spec, solver=self.request.solver,
                                  time_limit_s=self.request.time_limit_s, model=type(module).__qualname__,
                                  signature=signature_of(module, inputs, {}))
            if not any(p.requires_grad for p in module.parameters()) and not any(
                    isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
                self.done[key] = None  # nothing here takes a gradient: it runs its forward as captured
            else:
                try:
                    self.done[key] = plan_step(module, inputs, {}, request)
                except InfeasibleBudgetError as exc:
                    self.done[key] = exc
        return self.done[key]


def place_and_plan(units: Units, planner: RegionPlanner, devices: Sequence[str], budgets: Sequence[int | None],
                   fixed: tuple[int, ...] | None = None) -> list[Region]:
    """The fastest placement whose regions all fit their device's budget, each region planned;
    `fixed`: the placement to use (a plan's). Raises InfeasibleBudgetError naming the least budget
    per device found when none fits."""
    n = len(units.units)
    seconds = lambda bounds: max(sum(units.seconds[bounds[k]:bounds[k + 1]]) for k in range(len(devices)))  # noqa: E731
    candidates = [fixed] if fixed is not None else sorted(
        (b for b in placements(n, len(devices)) if keeps_shared_together(units.reads, devices, b)), key=seconds)
    floor = lambda k, bounds: sum(units.floor_bytes[bounds[k]:bounds[k + 1]])  # noqa: E731
    for bounds in candidates:  # each region is planned once per budget, however many placements share it
        if any(b is not None and floor(k, bounds) > b for k, b in enumerate(budgets)):
            continue  # its parameters and their gradients alone exceed a device's budget
        regions = []
        for k, device in enumerate(devices):
            region = Region(str(device), bounds[k], bounds[k + 1], budgets[k])
            if region.first < region.last:
                made = planner.fit(region.first, region.last, region.budget, region.device)
                if isinstance(made, InfeasibleBudgetError):
                    break
                region.module, region.plan = planner.module(region.first, region.last), made
            regions.append(region)
        else:
            return regions
    raise least_refusal(units, planner, devices, budgets, candidates)


def least_refusal(units: Units, planner: RegionPlanner, devices: Sequence[str], budgets: Sequence[int | None],
                  candidates: Sequence[tuple[int, ...]]) -> InfeasibleBudgetError:
    """The least budget per device found: over placements, the least of the largest least budget the
    planner names for their regions (a region that fits its budget needs no more than that budget)."""
    refused = min(b for b in budgets if b is not None)
    best, best_bounds, parts = None, None, {}
    for bounds in candidates:
        worst, why = 0, {}
        for k in range(len(devices)):
            first, last = bounds[k], bounds[k + 1]
            if first == last:
                continue
            made = planner.fit(first, last, 1, str(devices[k]))  # its least, as the planner names it
            need = made.min_budget_bytes if isinstance(made, InfeasibleBudgetError) else 0
            if need > worst:
                worst, why = need, dict(made.breakdown) if isinstance(made, InfeasibleBudgetError) else {}
            if best is not None and worst >= best:
                break
        if best is None or worst < best:
            best, best_bounds, parts = worst, bounds, why
    least = max(best or 0, refused + 1)
    labels = units.labels
    span = lambda a, b: labels[a] if b - a == 1 else f"{labels[a]} .. {labels[b - 1]}"  # noqa: E731
    split = "; ".join(f"{d}: {span(best_bounds[k], best_bounds[k + 1])}"
                      for k, d in enumerate(devices) if best_bounds[k] < best_bounds[k + 1])
    error = InfeasibleBudgetError(refused, least, parts, proven=False)  # the least found over the candidates
    error.args = (f"budget {fmt_bytes(refused)} per device is below the least budget found for {len(devices)} devices, "
                  f"{fmt_bytes(least)} per device, with recompute inside each device's region ({split}"
                  + (f"; its largest region: {', '.join(f'{k} {fmt_bytes(v)}' for k, v in parts.items())}" if parts else "")
                  + f"); raise budget_gb to at least {gb_at_least(least)}, use more devices, or lower the batch size",)
    return error


def run_regions(regions: Sequence[Region], runners: Sequence[Callable[..., Any]], gm: torch.fx.GraphModule,
                flat: list[Any], output_device: str) -> Any:
    """Run each region on its device, moving what crosses into it there; the outputs go to `output_device`."""
    values = flat
    for region, runner in zip(regions, runners):
        if runner is None:
            continue
        out = runner(*[to_device(v, region.device) for v in values])
        values = list(out) if isinstance(out, (tuple, list)) else [out]
    spec = pytree.tree_structure(gm.graph.output_node().args[0])
    leaves = [to_device(v, output_device) for v in values]
    return pytree.tree_unflatten(leaves, spec)
