"""Solve a problem with repeated identical layers through one layer: fast at any depth.

Reads a `MemoryProblem`; writes nothing. Cuts the last layer out as a window (the rest as eager
autograd decides it) and lists its Pareto options exactly: the least recompute cost for each
number of bytes the layer keeps from forward to backward, and for each peak of the window.
Spreads them over the layers: every option on all layers, then two option groups whose split is
a knapsack on kept bytes, its cap bisected (also with the last layer's option fixed, and with
only options holding few bytes beyond their kept ones) until the whole decision's peak,
measured with `fxmem.solve.problem.peak_bytes`, fits the budget. Cheaper assemblies over the budget
get an exact re-solve of the candidates outside the layers; the winner is pruned and its
outside and last layer re-solved exactly. Stops within about `MAX_TIME_S` whatever the depth: limits are
counted (`fxmem.solve.effort`: CP-SAT's deterministic time, and `ASSEMBLE_US` per value and step of each
assembly checked), so the same problem gets the same decision on every run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fxmem.solve.effort import Effort
from fxmem.solve.problem import (
    MemoryProblem,
    eager_decision,
    is_valid,
    peak_bytes,
    recompute_cost,
    repair,
    saved_set,
)
from fxmem.solve.recompute.exact import _Model, solve_exact
from fxmem.solve.recompute.layers import Layers, Window, find_layers, window
from fxmem.solve.solution import Solution, make_solution

MAX_TIME_S = 3.0  # the layered solver stops by then (or by the time limit), at any depth
MAX_OPTIONS, OPTIONS_TIME_S = 32, 0.6  # Pareto options listed per layer and kind, and the time for each kind
BISECTIONS = 16  # caps tried on the layers' kept bytes, per choice of the last layer's option
LAST_LAYER_TRIES = 3  # options with the least transient tried on the last layer
OUTSIDE_TRIES = 4  # assemblies over the budget offered to an exact solve of the rest
TRANSIENT_LEVELS = 3  # searches again with only the options holding less beyond their kept bytes
POLISHED_LAYERS, WINDOW_TIME_S = 1, 0.5  # layers re-solved alone at the end, time for each window
ASSEMBLE_US = 0.5  # effort units per value and step of an assembly repaired and measured (0.4 measured)


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


def layer_options(win: Window, first: int, time_limit_s: float | Effort, memory: bool = False) -> list[Option]:
    """The layer's Pareto options, cheapest first, each solved exactly: the least recompute cost
    for each number of bytes the layer keeps from forward to backward (on the decision rules
    alone), or with `memory`, for each peak of the window (the rest as the window fixes it); as many
    as about `time_limit_s` seconds find."""
    effort, sub = Effort.of(time_limit_s), win.problem
    model = _Model(sub, None, memory=memory)
    own = [k for k, v in enumerate(win.members) if v in win.own]
    kept = sum(sub.size[k] * model.s[k] for k in own if model.s[k] is not False and sub.size[k])
    model.model.minimize(sum(c * x for c, x in zip(sub.cost, model.r) if c and x is not False))
    options: list[Option] = []
    while len(options) < MAX_OPTIONS and not effort.done():
        code, solver = model.run(effort, 2, least_s=0.05)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        rec = model.decision(solver)
        held = sum(sub.size[k] for k in saved_set(sub, rec) if win.members[k] in win.own)
        options.append(Option(frozenset(win.members[k] - first for k in rec if win.members[k] in win.own),
                              held, recompute_cost(sub, rec)))
        if memory:
            model.model.add(model.capacity <= peak_bytes(sub, rec) - 1)
        elif isinstance(kept, int):
            break
        else:
            model.model.add(kept <= held - 1)
    return options


def _counts(options: list[Option], layers: int, cap: int) -> list[int] | None:
    """How many layers take each option: the cheapest split of the layers between two options
    (or one) whose kept bytes stay within `cap`."""
    best: tuple[int, int, int, int] | None = None  # (cost, a, b, layers on a)
    for a, more in enumerate(options):
        if more.kept * layers <= cap:
            if best is None or more.cost * layers < best[0]:
                best = (more.cost * layers, a, a, layers)
            continue
        for b, less in enumerate(options):
            if less.kept >= more.kept or less.kept * layers > cap:
                continue
            on_a = (cap - less.kept * layers) // (more.kept - less.kept)
            cost = more.cost * on_a + less.cost * (layers - on_a)
            if best is None or cost < best[0]:
                best = (cost, a, b, on_a)
    if best is None:
        return None
    counts = [0] * len(options)
    counts[best[2]] += layers - best[3]
    counts[best[1]] += best[3]
    return counts


def _assemble(p: MemoryProblem, layers: Layers, outside: frozenset[int], per_layer: list[Option],
              effort: Effort) -> _Assembly:
    effort.spend(ASSEMBLE_US * (p.num_values + p.num_steps))
    rec = set(outside)
    for k, option in enumerate(per_layer):
        rec |= layers.spread(option.offsets, range(k, k + 1))
    full = repair(p, rec)
    return _Assembly(full, sum(p.cost[i] for i in full), peak_bytes(p, full))


def _spread(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
            counts: list[int], effort: Effort, last: Option | None = None) -> _Assembly:
    """The options laid over the layers, keeping more bytes in the first layers or in the last
    ones, whichever peaks lower; `last` (when given) on the last layer."""
    ordered = [o for o, c in sorted(zip(options, counts), key=lambda oc: oc[0].kept) for _ in range(c)]
    tail = [last] if last is not None else []
    tries = [_assemble(p, layers, outside, ordered + tail, effort),
             _assemble(p, layers, outside, ordered[::-1] + tail, effort)]
    return min(tries, key=lambda a: (a.peak, a.cost))


def solve_layered(problem: MemoryProblem, time_limit_s: float | Effort = 10.0,
                  layers: Layers | None = None) -> Solution | None:
    """A decision built from one layer's options ("feasible", or "optimal" when nothing is
    recomputed) within about `time_limit_s` seconds or `MAX_TIME_S`, whichever is less, or None when no
    repeated layers are found or no assembly fits the budget."""
    started = time.perf_counter()
    effort = Effort.of(time_limit_s).part(most_s=MAX_TIME_S)
    p = problem
    layers = layers or find_layers(p)
    if layers is None:
        return None
    eager = eager_decision(p)
    if is_valid(p, eager) and peak_bytes(p, eager) <= p.budget:
        return make_solution(p, eager, "optimal", 0, started, "layered")
    span = range(layers.start, layers.start + layers.count * layers.length)
    outside = frozenset(v for v in eager if v not in span)
    last = layers.layer(layers.count - 1)
    win, options = _options(p, layers, eager, effort, min(OPTIONS_TIME_S, effort.seconds / 6))
    if not options:
        return None
    # A layer's backward comes while the layers before it keep their bytes: the bytes it holds
    # beyond its kept ones then matter too (the window's peak beyond its kept bytes).
    extra = {o.offsets: _window_peak(win, last.start, o) - o.kept for o in options}
    transient = sorted(options, key=lambda o: (extra[o.offsets], o.cost))
    over: list[_Assembly] = []
    best = None
    for trial in _uniform(p, layers, outside, options, effort):  # one option on every layer
        if trial.peak > p.budget:
            over.append(trial)
        elif best is None or (trial.cost, trial.peak) < (best.cost, best.peak):
            best = trial
    found = _search(p, layers, outside, options, transient, effort, over)
    if found is not None and (best is None or (found.cost, found.peak) < (best.cost, best.peak)):
        best = found
    levels = sorted(set(extra.values()))
    limits = {levels[len(levels) * q // (TRANSIENT_LEVELS + 1)] for q in range(1, TRANSIENT_LEVELS + 1)}
    lowest = min(options, key=lambda o: (o.kept + extra[o.offsets], o.cost))  # the window's lowest peak
    limits.add(extra[lowest.offsets])
    for limit in sorted(limits, reverse=True):
        if effort.done():
            break
        calm = [o for o in options if extra[o.offsets] <= limit]
        found = _search(p, layers, outside, calm, [o for o in transient if o in calm], effort, over)
        if found is not None and (best is None or (found.cost, found.peak) < (best.cost, best.peak)):
            best = found
    if best is None:
        # Even the least-keeping layers do not fit with the rest as eager keeps it: solve the rest
        # exactly with the layers keeping least, then search again.
        least = _assemble(p, layers, outside, [options[-1]] * layers.count, effort).recompute
        rest = _resolve(p, [v for v in range(p.num_values) if v not in span], least, effort, check=False)
        if rest is not None:
            best = _search(p, layers, frozenset(v for v in rest if v not in span), options, transient, effort, over)
    if best is None:
        return None
    # Cheaper assemblies that went over the budget may fit once the rest recomputes some more.
    outside_own = [v for v in range(p.num_values) if v not in span]
    for trial in sorted({a.recompute: a for a in over if a.cost < best.cost}.values(), key=lambda a: a.cost)[:OUTSIDE_TRIES]:
        if effort.done():
            break
        fixed = _resolve(p, outside_own, trial.recompute, effort, check=False)
        if fixed is not None and is_valid(p, fixed) and peak_bytes(p, fixed) <= p.budget:
            cost = sum(p.cost[v] for v in fixed)
            if cost < best.cost:
                best = _Assembly(fixed, cost, peak_bytes(p, fixed))
    rec = _polish(p, layers, _prune(p, best.recompute, effort), effort)
    cost = sum(p.cost[i] for i in rec)
    return make_solution(p, rec, "feasible" if cost else "optimal", 0, started, "layered")


def _options(p: MemoryProblem, layers: Layers, eager: frozenset[int], effort: Effort,
             share_s: float) -> tuple[Window, list[Option]]:
    """The last layer's window (the rest as eager keeps it) and its options of both kinds, the
    most kept bytes first, each kind listed for about `share_s` seconds."""
    last = layers.layer(layers.count - 1)
    win = window(p, last, eager)
    options = layer_options(win, last.start, effort.child(share_s))
    options += layer_options(win, last.start, effort.child(share_s), memory=True)
    return win, sorted({o.offsets: o for o in options}.values(), key=lambda o: (-o.kept, o.cost))


def layered_min_peak(problem: MemoryProblem, time_limit_s: float | Effort = 10.0,
                     layers: Layers | None = None) -> tuple[int, frozenset[int]] | None:
    """A low peak (an upper bound on the least one) from one option on every layer, the rest as
    eager keeps it; None without repeated layers."""
    layers = layers or find_layers(problem)
    if layers is None:
        return None
    eager = eager_decision(problem)
    span = range(layers.start, layers.start + layers.count * layers.length)
    outside = frozenset(v for v in eager if v not in span)
    effort = Effort.of(time_limit_s)
    _, options = _options(problem, layers, eager, effort, effort.seconds / 3)
    best = min(_uniform(problem, layers, outside, options, effort), key=lambda a: (a.peak, a.cost), default=None)
    return None if best is None else (best.peak, best.recompute)


def _uniform(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
             effort: Effort) -> list[_Assembly]:
    """Each option on every layer (as many as the effort allows, least kept bytes first)."""
    out = []
    for option in reversed(options):
        if out and effort.done():
            break
        out.append(_assemble(p, layers, outside, [option] * layers.count, effort))
    return out


def _search(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
            transient: list[Option], effort: Effort, over: list[_Assembly]) -> _Assembly | None:
    best: _Assembly | None = None
    for fixed in [None] + transient[:LAST_LAYER_TRIES]:
        found = _bisect(p, layers, outside, options, fixed, effort, over)
        if found is not None and (best is None or (found.cost, found.peak) < (best.cost, best.peak)):
            best = found
    return best


def _window_peak(win: Window, first: int, option: Option) -> int:
    """The window's peak with `option` on its layer."""
    return peak_bytes(win.problem, repair(win.problem, {k for k, v in enumerate(win.members)
                                                        if v in win.own and v - first in option.offsets}))


def _bisect(p: MemoryProblem, layers: Layers, outside: frozenset[int], options: list[Option],
            fixed: Option | None, effort: Effort, over: list[_Assembly]) -> _Assembly | None:
    """Cheapest assembly found by bisecting the cap on the layers' kept bytes; `fixed`, when
    given, is the last layer's option and the knapsack covers the others. Assemblies over the
    budget are added to `over`."""
    free = layers.count - (fixed is not None)
    low, high = free * options[-1].kept, free * options[0].kept
    best: _Assembly | None = None
    for step in range(BISECTIONS + 2):
        if low > high or effort.done():
            break
        cap = high if step == 0 else low if best is None else (low + high) // 2
        counts = _counts(options, free, cap) if free else []
        trial = None
        if counts is not None:
            trial = _spread(p, layers, outside, options, counts, effort, fixed)
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
            if trial is not None:
                over.append(trial)
    return best


def _prune(p: MemoryProblem, rec: frozenset[int], effort: Effort) -> frozenset[int]:
    """Drop recomputations the budget does not need (greedy's pruning, on the whole problem)."""
    from fxmem.solve.recompute.greedy import _prune as prune
    from fxmem.solve.recompute.greedy import _State

    state = _State(p, rec, effort=effort)
    prune(p, state, p.budget)
    out = frozenset(state.rec)
    return out if is_valid(p, out) and peak_bytes(p, out) <= p.budget else rec


def _polish(p: MemoryProblem, layers: Layers, rec: frozenset[int], effort: Effort) -> frozenset[int]:
    """Re-solve windows exactly under the real budget, the rest of `rec` fixed: the candidates
    outside the layers, then the last and first layers. A window's new decision is kept when the
    whole problem says it fits and costs less."""
    span = range(layers.start, layers.start + layers.count * layers.length)
    ends = [layers.count - 1, 0][:min(POLISHED_LAYERS, layers.count)]
    windows = [[v for v in range(p.num_values) if v not in span]] + [list(layers.layer(k)) for k in ends]
    for own in windows:
        if effort.left_s < 0.05 or not own:
            break
        rec = _resolve(p, own, rec, effort) or rec
    return rec


def _resolve(p: MemoryProblem, own: list[int], rec: frozenset[int], effort: Effort,
             check: bool = True) -> frozenset[int] | None:
    """The whole decision with the candidates `own` re-solved exactly under the budget, the rest
    of `rec` fixed; None when that finds nothing, or (with `check`) nothing cheaper that fits."""
    mine = frozenset(own)
    win = window(p, own, rec)
    current = frozenset(k for k, v in enumerate(win.members) if v in rec and v in mine)
    found = solve_exact(win.problem, effort.part(least_s=0.05, most_s=WINDOW_TIME_S), hint=current)
    if not found.fits:
        return None
    trial = repair(p, (rec - mine) | {win.members[k] for k in found.recompute if win.members[k] in mine})
    if check and not (sum(p.cost[v] for v in trial) < sum(p.cost[v] for v in rec)
                      and is_valid(p, trial) and peak_bytes(p, trial) <= p.budget):
        return None
    return trial
