"""Solve a problem with repeated identical layers through one layer: fast at any depth.

Reads a `MemoryProblem`; writes nothing. Cuts the last layer out as a window (the rest as eager
autograd decides it), lists its Pareto options exactly (least recompute cost for each number of
bytes the layer keeps from forward to backward), and spreads them over the layers: how many
layers take each option is a small knapsack on kept bytes, whose cap is bisected until the
whole decision's peak, measured with `fxmem.problem.peak_bytes`, fits the budget. Then drops
recomputations the budget does not need and re-solves the candidates outside the layers and the
outermost layers exactly, one window at a time. Time grows with a layer's size, not the depth.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fxmem.problem import MemoryProblem, eager_decision, is_valid, peak_bytes
from fxmem.solve import Solution, make_solution
from fxmem.solve.exact import _Model, solve_exact
from fxmem.solve.layers import Layers, Window, find_layers, repair, window

MAX_OPTIONS = 48  # Pareto options listed per layer
BISECTIONS = 16  # caps tried on the layers' kept bytes, per choice of the last layer's option
LAST_LAYER_TRIES = 3  # options with the least transient tried on the last layer
POLISHED_LAYERS, WINDOW_TIME_S = 1, 0.5  # layers re-solved alone at the end, time for each window


@dataclass(frozen=True)
class Option:
    """A decision on one layer: the offsets it recomputes, the bytes it keeps, what it costs."""

    offsets: frozenset[int]
    kept: int
    cost: int


@dataclass(frozen=True)
class _Assembly:
    recompute: frozenset[int]
    cost: int
    peak: int


def layer_options(win: Window, first: int, deadline: float) -> list[Option]:
    """The layer's Pareto options from keeping what eager keeps down to the least it can keep,
    each the cheapest for its kept bytes (solved exactly on the decision rules alone)."""
    sub = win.problem
    model = _Model(sub, None, memory=False)
    own = [k for k, v in enumerate(win.members) if v in win.own]
    kept_terms = [(sub.size[k], model.s[k]) for k in own if model.s[k] is not False and sub.size[k]]
    kept = sum(b * x for b, x in kept_terms)
    model.model.minimize(sum(c * x for c, x in zip(sub.cost, model.r) if c and x is not False))
    options: list[Option] = []
    while len(options) < MAX_OPTIONS and time.perf_counter() < deadline:
        code, solver = model.run(max(0.05, deadline - time.perf_counter()), 2)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        rec = {win.members[k] for k in model.decision(solver) if win.members[k] in win.own}
        held = sum(b for b, x in kept_terms if solver.boolean_value(x))
        options.append(Option(frozenset(v - first for v in rec), held, int(solver.objective_value)))
        if not kept_terms:
            break
        model.model.add(kept <= held - 1)
    return options


def _counts(options: list[Option], layers: int, cap: int) -> list[int] | None:
    """How many layers take each option: least total cost with total kept bytes <= cap."""
    m = cp_model.CpModel()
    n = [m.new_int_var(0, layers, f"n{i}") for i in range(len(options))]
    m.add(sum(n) == layers)
    m.add(sum(o.kept * x for o, x in zip(options, n)) <= cap)
    m.minimize(sum(o.cost * x for o, x in zip(options, n)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 1.0
    solver.parameters.num_workers = 1
    if solver.solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [solver.value(x) for x in n]


def _assemble(p: MemoryProblem, layers: Layers, outside: frozenset[int], per_layer: list[Option]) -> _Assembly:
    rec = set(outside)
    for k, option in enumerate(per_layer):
        rec |= layers.spread(option.offsets, range(k, k + 1))
    full = repair(p, rec)
    return _Assembly(full, sum(p.cost[i] for i in full), peak_bytes(p, full))


def _spread(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
            counts: list[int], last: Option | None = None) -> _Assembly:
    """The options laid over the layers, keeping more bytes in the first layers or in the last
    ones, whichever peaks lower; `last` (when given) on the last layer."""
    ordered = [o for o, c in sorted(zip(options, counts), key=lambda oc: oc[0].kept) for _ in range(c)]
    tail = [last] if last is not None else []
    tries = [_assemble(p, layers, outside, ordered + tail), _assemble(p, layers, outside, ordered[::-1] + tail)]
    return min(tries, key=lambda a: (a.peak, a.cost))


def solve_layered(problem: MemoryProblem, time_limit_s: float = 10.0,
                  layers: Layers | None = None) -> Solution | None:
    """A decision built from one layer's options ("feasible", or "optimal" when nothing is
    recomputed), or None when no repeated layers are found or no assembly fits the budget."""
    started = time.perf_counter()
    deadline = started + time_limit_s
    p = problem
    layers = layers or find_layers(p)
    if layers is None:
        return None
    eager = eager_decision(p)
    span = range(layers.start, layers.start + layers.count * layers.length)
    outside = frozenset(v for v in eager if v not in span)
    last = layers.layer(layers.count - 1)
    win = window(p, last, eager)
    options = layer_options(win, last.start, started + time_limit_s / 3)
    if not options:
        return None
    # The last layer's backward comes first, while every layer keeps its bytes: there, the lowest
    # transient matters. Options ranked by the window's peak beyond their kept bytes.
    transient = sorted(options, key=lambda o: (_window_peak(win, last.start, o) - o.kept, o.cost))
    best: _Assembly | None = None
    for fixed in [None] + transient[:LAST_LAYER_TRIES]:
        found = _bisect(p, layers, outside, options, fixed, deadline)
        if found is not None and (best is None or (found.cost, found.peak) < (best.cost, best.peak)):
            best = found
    if best is None:
        return None
    rec = _polish(p, layers, _prune(p, best.recompute, deadline), deadline)
    cost = sum(p.cost[i] for i in rec)
    return make_solution(p, rec, "feasible" if cost else "optimal", 0, started, "layered")


def _window_peak(win: Window, first: int, option: Option) -> int:
    """The window's peak with `option` on its layer."""
    return peak_bytes(win.problem, repair(win.problem, {k for k, v in enumerate(win.members)
                                                        if v in win.own and v - first in option.offsets}))


def _bisect(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
            fixed: Option | None, deadline: float) -> _Assembly | None:
    """Cheapest assembly found by bisecting the cap on the layers' kept bytes; `fixed`, when
    given, is the last layer's option and the knapsack covers the others."""
    free = layers.count - (fixed is not None)
    low, high = free * options[-1].kept, free * options[0].kept
    best: _Assembly | None = None
    for step in range(BISECTIONS + 2):
        if low > high or time.perf_counter() > deadline:
            break
        cap = high if step == 0 else low if best is None else (low + high) // 2
        counts = _counts(options, free, cap) if free else []
        trial = None
        if counts is not None:
            trial = _spread(p, layers, outside, options, counts, fixed)
        if trial is not None and trial.peak <= p.budget:
            if best is None or (trial.cost, trial.peak) < (best.cost, best.peak):
                best = trial
            if step == 0:
                break  # keeping the most fits
            low = cap + 1
        elif step == 1:
            return None  # keeping the least does not fit
        else:
            high = cap - 1
    return best


def _prune(p: MemoryProblem, rec: frozenset[int], deadline: float) -> frozenset[int]:
    """Drop recomputations the budget does not need (greedy's pruning, on the whole problem)."""
    from fxmem.solve.greedy import _prune as prune, _State

    state = _State(p, rec)
    prune(p, state, p.budget, deadline)
    out = frozenset(state.rec)
    return out if is_valid(p, out) and peak_bytes(p, out) <= p.budget else rec


def _polish(p: MemoryProblem, layers: Layers, rec: frozenset[int], deadline: float) -> frozenset[int]:
    """Re-solve windows exactly under the real budget, the rest of `rec` fixed: the candidates
    outside the layers, then the last and first layers. A window's new decision is kept when the
    whole problem says it fits and costs less."""
    span = range(layers.start, layers.start + layers.count * layers.length)
    ends = [layers.count - 1, 0][:min(POLISHED_LAYERS, layers.count)]
    windows = [[v for v in range(p.num_values) if v not in span]] + [list(layers.layer(k)) for k in ends]
    cost = sum(p.cost[v] for v in rec)
    for own in windows:
        left = deadline - time.perf_counter()
        if left < 0.05 or not own:
            break
        mine = frozenset(own)
        win = window(p, own, rec)
        current = frozenset(k for k, v in enumerate(win.members) if v in rec and v in mine)
        found = solve_exact(win.problem, min(left, WINDOW_TIME_S), hint=current)
        if found.status == "infeasible":
            continue
        trial = repair(p, (rec - mine) | {win.members[k] for k in found.recompute if win.members[k] in mine})
        trial_cost = sum(p.cost[v] for v in trial)
        if trial_cost < cost and is_valid(p, trial) and peak_bytes(p, trial) <= p.budget:
            rec, cost = trial, trial_cost
    return rec
