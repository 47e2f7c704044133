"""Optimizer state in host memory as the planner's decision, jointly with the activations' plan.

Reads the request's trainable parameters (name, optimizer-state bytes, value bytes, in the order backward
produces their gradients), the target's host link and the host CPU's update rate (`fxmem.price.host_update`),
and a function that plans the step's graphs with a given number of state bytes on the device and the named
parameters' gradients moved to the host inside backward (passes/host_gradients.py; raising
`InfeasibleBudgetError` where nothing fits). Writes nothing; returns the chosen Plan, its `host_*` fields
and `host_options` filled (the mixes considered, for the table).

The mixes considered (`fxmem.solve.host_state` prices each). Where the backward graph can move gradients
(`streams_gradients`): all the state and gradients on the host (planned first: where it does not fit,
nothing does, and its refusal names the least of all), and the least state and gradients on the host beside
the graphs at their least (the other gradients, back on the device, counted at their bytes). With the
gradients on the device: all the state on the host; that plan's activations with the least state on the host
that still fits them; the keep-all step (nothing recomputed or offloaded) with the least state on the host
that fits it; all the state on the device; and, where that does not fit, the least state on the host that
the graphs fit beside at their least budget (recomputing what they must; that least found by one more
refused plan where not known). The one of least predicted step time (its exposed copies and host update
counted) is chosen, ties to the gradients on the device, then to less state on the host. Mixes between
these are not searched. Gradients returned by backward are copied after it, whole (`OVERLAP_S`); those moved
inside it beside the rest of backward on a GPU (`BACKWARD_SHARE`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from fxmem.errors import InfeasibleBudgetError
from fxmem.passes.host_gradients import to_host
from fxmem.planner.plan import Plan
from fxmem.planner.resident import LABEL
from fxmem.solve.host_state import HostStateCosts

# The planned backward is one graph that returns every gradient at its end, so the gradients' hooks fire, and
# their copies start, once backward is over: no backward time hides them. Gradients moved to the host inside
# the backward graph (passes/host_gradients.py) are copied as each is made: on a GPU beside the rest of
# backward, taken as this share of the step's compute (a matmul's backward is two of its three matmuls).
OVERLAP_S = 0.0
BACKWARD_SHARE = 2 / 3
ALL_HOST, FITTED, KEEP_ALL, ALL_DEVICE = ("all on the host", "the plan's activations, least state on the host",
                                          "keep-all, least state on the host", "all on the device")
ALL_HOST_GRADS, MOST_DEVICE_GRADS = ("all on the host, gradients too",
                                     "least state and gradients on the host, recomputing what that needs")
MOST_DEVICE = "least state on the host, recomputing what that needs"


def host_costs(request) -> HostStateCosts:
    """The request's parameters priced over its device's host link at its host update rate."""
    link = request.device.host_link
    sizes = request.host_state
    return HostStateCosts(state=tuple(s for _, s, _ in sizes), grads=tuple(v for _, _, v in sizes),
                          values=tuple(v for _, _, v in sizes), link_bytes_per_s=link.bytes_per_s,
                          link_latency_s=link.latency_s, update_bytes_per_s=request.host_update_bytes_per_s)


def restated(plan: Plan, device_state: int) -> Plan:
    """`plan` with `device_state` bytes of optimizer state on the device instead of what it was made with."""
    change = device_state - plan.optimizer_state_bytes
    parts = {k: v for k, v in plan.breakdown.items() if k != LABEL}
    return dataclasses.replace(plan, optimizer_state_bytes=device_state,
                               breakdown={**({LABEL: device_state} if device_state else {}), **parts},
                               baseline_peak_bytes=plan.baseline_peak_bytes + change,
                               predicted_peak_bytes=plan.predicted_peak_bytes + change)


def with_host_state(plan: Plan, costs: HostStateCosts, count: int, names: tuple[str, ...], options: tuple,
                    grads: int = 0, backward_s: float | None = None, calls_s: float = 0.0) -> Plan:
    """`plan` with the first `count` parameters' state on the host (and the first `grads` ones' gradients, moved
    out inside backward, `backward_s` long where copies run beside it, their calls `calls_s` in all: a planned
    step's per-parameter cost, which a plan with their gradients returned by backward counts): their state off
    the device, the copies' and the update's exposed time in the step."""
    plan = restated(plan, costs.device_bytes(count))
    out, back = costs.copy_seconds(count)
    update = costs.update_seconds(count)
    exposed_copies = _waited(costs, count, grads, backward_s) + calls_s - update
    return dataclasses.replace(
        plan, host_state_bytes=costs.host_bytes(count), host_parameters=names[:count], host_update_s=update,
        host_copy_s=out + back, predicted_step_s=plan.predicted_step_s + exposed_copies + update,
        exposed_transfer_s=plan.exposed_transfer_s + exposed_copies, host_options=options,
        host_link=plan.host_link or "", host_gradients=names[:grads], host_gradient_bytes=sum(costs.grads[:grads]),
        fallback_ops=tuple(op for op in plan.fallback_ops if op != to_host.__name__))  # no FLOPs: its copy is priced here


def streams_gradients(request) -> bool:
    """Whether the step's backward graph can move gradients to the host (passes/host_gradients.py): eager's
    kernels run it (Inductor compiles its own graphs) and its parameter inputs are known by name."""
    return request.inner == "aot_eager" and bool(request.primal_names)


def _backward_s(request, plan: Plan) -> float | None:
    """Backward's time, beside which the gradients' copies run (a GPU's side stream); None without one."""
    return plan.baseline_step_s * BACKWARD_SHARE if request.device.gpu else None


def _waited(costs: HostStateCosts, count: int, grads: int, backward_s: float | None) -> float:
    return costs.host_gradient_seconds(count, backward_s) if grads else costs.exposed_seconds(count, OVERLAP_S)


def plan_with_host_state(request, plan_at: Callable[..., Plan], margin_bytes: int) -> Plan:
    """The least-time mix of optimizer state (and gradients) on the host and activations' decision that fits the
    request's budget (see the module's note). `plan_at(device_state_bytes, host_gradient_names=())` plans the
    graphs for the budget less that state, those gradients moved out in backward."""
    costs = host_costs(request)
    names = tuple(name for name, _, _ in request.host_state)
    tried: list[tuple[str, Plan, int, int]] = []  # (mix, plan, parameters with host state, with host gradients)
    rows: tuple = ()  # mixes refused
    if streams_gradients(request):  # its refusal is the least with every byte of state and gradient off the device
        tried.append((ALL_HOST_GRADS, plan_at(0, names), costs.count, costs.count))
        try:
            hosted = plan_at(0)
        except InfeasibleBudgetError as exc:
            floor = tried[0][1].breakdown.get("parameters, buffers and inputs", 0) + sum(costs.grads)
            hosted, rows = None, (_refused_row(ALL_HOST, 0, exc.min_budget_bytes, "found"),
                                  _refused_row(ALL_DEVICE, costs.total_state, costs.total_state + floor, "bound"))
    else:
        hosted = plan_at(0)  # its refusal is the least with every byte of state off the device
    streamed = tried[0][1] if tried else None  # all the state and gradients on the host
    if streamed is not None:
        partial = _least_streamed(costs, plan_at, request.budget_bytes, names, streamed)
        tried += [partial] if partial is not None else []
    if hosted is not None:
        found, rows = _device_gradient_mixes(request, plan_at, costs, hosted, margin_bytes)
        tried = found + tried
    seconds = [plan.predicted_step_s + _waited(costs, count, grads, _backward_s(request, plan))
               + grads * request.device.param_overhead_s for _, plan, count, grads in tried]
    best = min(range(len(tried)), key=lambda i: (seconds[i], tried[i][3], tried[i][2]))
    options = tuple({"mix": label, "device_state_bytes": costs.device_bytes(count), "step_s": s, "chosen": i == best,
                     "host_gradient_bytes": sum(costs.grads[:grads]),
                     "peak_bytes": plan.predicted_peak_bytes + costs.device_bytes(count) - plan.optimizer_state_bytes}
                    for i, ((label, plan, count, grads), s) in enumerate(zip(tried, seconds)))
    _, plan, count, grads = tried[best]
    plan = with_host_state(plan, costs, count, names, options + rows, grads, _backward_s(request, plan),
                           grads * request.device.param_overhead_s)
    return dataclasses.replace(plan, min_budget_bytes=(streamed or hosted).min_budget_bytes)


def _least_streamed(costs: HostStateCosts, plan_at: Callable[..., Plan], budget: int, names: tuple[str, ...],
                    streamed: Plan) -> tuple[str, Plan, int, int] | None:
    """The fewest parameters whose state and gradients on the host let the graphs fit at their least (found by
    `streamed`'s search, else by planning them at the parameters' bytes alone, refused naming it), taking the other
    parameters' gradients, back on the device, to add at most their bytes; planned, or None."""
    graphs_least = streamed.min_budget_bytes
    if graphs_least is None:
        probe = budget - streamed.breakdown.get("parameters, buffers and inputs", 0)
        try:
            plan_at(probe, names)
            return None
        except InfeasibleBudgetError as exc:
            graphs_least = exc.min_budget_bytes - probe
    count = costs.least_count_with_gradients(budget - graphs_least)
    if count is None or count >= costs.count:
        return None
    try:
        return MOST_DEVICE_GRADS, plan_at(costs.device_bytes(count), names[:count]), count, count
    except InfeasibleBudgetError:
        return None


def _device_gradient_mixes(request, plan_at: Callable[..., Plan], costs: HostStateCosts, hosted: Plan,
                           margin_bytes: int) -> tuple[list, tuple]:
    """The mixes with every gradient on the device (see the module's note) from `hosted`, the plan with all the
    state on the host: those that fit, and the row of all on the device where it is refused."""
    budget = request.budget_bytes
    tried: list[tuple[str, Plan, int, int]] = [(ALL_HOST, hosted, costs.count, 0)]
    room = budget - margin_bytes - hosted.predicted_peak_bytes
    fitted = costs.least_count(room)
    if fitted is not None and fitted < costs.count:
        tried.append((ALL_DEVICE if fitted == 0 else FITTED, hosted, fitted, 0))
    keep = costs.least_count(budget - margin_bytes - hosted.baseline_peak_bytes)
    recomputes = hosted.predicted_step_s > hosted.baseline_step_s or hosted.recompute or hosted.offload
    if keep is not None and recomputes and keep < costs.count:
        try:
            tried.append((ALL_DEVICE if keep == 0 else KEEP_ALL, plan_at(costs.device_bytes(keep)), keep, 0))
        except InfeasibleBudgetError:
            pass
    refused = None  # all on the device, where it does not fit: (the least budget, found or a bound)
    floor = sum(v for k, v in hosted.breakdown.items() if k in ("parameters, buffers and inputs", "gradients"))
    if fitted != 0 and keep != 0:
        if budget - costs.total_state > floor:
            try:
                tried.append((ALL_DEVICE, plan_at(costs.total_state), 0, 0))
            except InfeasibleBudgetError as exc:
                refused = (exc.min_budget_bytes, "found")
        else:  # the state, parameters and gradients alone exceed the budget: not planned
            refused = (costs.total_state + floor, "bound")
    if refused is None:
        return tried, ()
    most = _most_on_device(costs, plan_at, budget, floor, refused)
    if most is not None and all(most < count for _, _, count, _ in tried):
        try:
            tried.append((MOST_DEVICE, plan_at(costs.device_bytes(most)), most, 0))
        except InfeasibleBudgetError:
            pass
    return tried, (_refused_row(ALL_DEVICE, costs.total_state, *refused),)


def _refused_row(mix: str, device_state_bytes: int, least_bytes: int, least: str) -> dict:
    """A mix's row of `Plan.host_options` where it does not fit: its least budget, "found" or a "bound"."""
    return {"mix": mix, "device_state_bytes": device_state_bytes, "step_s": None, "chosen": False,
            "least_bytes": least_bytes, "least": least}


def _most_on_device(costs: HostStateCosts, plan_at: Callable[[int], Plan], budget: int, floor: int,
                    refused: tuple[int, str]) -> int | None:
    """The fewest parameters whose state on the host lets the graphs fit at their least budget (recomputing and
    offloading all they can); None where that least is unknown. The least comes from the refusal of all the
    state on the device, else from planning the graphs at the bytes of parameters and gradients alone, which is
    refused naming it."""
    if refused[1] == "found":
        graphs_least = refused[0] - costs.total_state
    elif budget > floor:
        probe = budget - floor
        try:
            plan_at(probe)
            return None
        except InfeasibleBudgetError as exc:
            graphs_least = exc.min_budget_bytes - probe
    else:
        return None
    return costs.least_count(budget - graphs_least)
