"""Greedy keep / recompute / offload heuristic: fast, no optimality claim.

Reads a `MemoryProblem`; writes nothing. Starts from eager autograd's decision and, while the
peak is over budget, recomputes the value alive at the peak step that lowers it most per unit of
cost; then drops recomputations the budget no longer needs. Moves are priced incrementally: a
change re-derives lifetimes only upstream of the values it touches (`fxmem.solve.problem.lifetimes`
rules) and updates a segment tree over the memory profile. Seeds CP-SAT and `min_peak`.
When the problem allows offload, a second run first offloads the largest values alive at the peak
(copies that hide cost almost nothing), then recomputes; the cheaper of the two runs is returned.
Limits are counted (`fxmem.solve.effort`): a move charges `TOGGLE_US` per value it re-derives, a
profile `PROFILE_US` per value and step. It proves nothing: a decision over the budget is "unknown",
"infeasible" only where `bound.proven_over_budget` proves it.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import replace

from fxmem.solve.effort import Effort
from fxmem.solve.problem import (
    NEVER,
    MemoryProblem,
    decision_cost,
    eager_decision,
    held_sizes,
    is_valid,
    lifetimes,
    memory_profile,
    offload_cost,
    peak_bytes,
    recompute_cost,
    saved_set,
    transfer_schedule,
)
from fxmem.solve.recompute.bound import proven_over_budget
from fxmem.solve.recompute.profile_tree import ProfileTree
from fxmem.solve.solution import Solution, make_solution

MOVES_PER_ROUND = 32  # candidate moves priced per round (values alive at the peak, best bytes/cost first)
CHAIN_DEPTH = 4  # a move may pull up to this many producers along with the value it recomputes
TOGGLE_US = 10.0  # effort units (about µs) a move or its undo costs per value it re-derives (6-16 measured)
PROFILE_US = 0.4  # effort units per value and step of one memory profile (0.31-0.41 measured)


class _State:
    """A decision with its lifetimes and memory profile, changed in place and undone on demand."""

    def __init__(self, problem: MemoryProblem, rec: frozenset[int], offload: frozenset[int] = frozenset(),
                 effort: Effort | None = None):
        self.p, self.users = problem, problem.consumers()
        self.effort = effort or Effort(float("inf"))  # charged by every move and undo
        self.rec = set(rec)
        self.rec_users = [sum(w in self.rec for w in self.users[v]) for v in range(problem.num_values)]
        self.span = dict(lifetimes(problem, rec))
        self.made = {v: self.span[v][0] for v in self.rec if v in self.span}
        self.end = {v: last for v, (_, last) in self.span.items()}
        held = held_sizes(problem, rec)
        self.held = {v: held[v] for v in self.span}
        self.tree = ProfileTree(memory_profile(problem, rec, offload))

    def status(self, v: int) -> str:
        if v in self.rec:
            return "rec"
        return "saved" if self.p.needed[v] or self.rec_users[v] else "free"

    def first_read(self, v: int) -> int:
        """The step a recomputation of v would be made at: its first read or a recomputed user's."""
        first = self.p.need_first[v]
        for w in self.users[v]:
            when = self.made.get(w)
            if when is not None and (first == NEVER or when < first):
                first = when
        return self.p.num_steps if first == NEVER else first

    def _derive(self, v: int) -> tuple[int | None, int | None, tuple[int, int] | None]:
        """(made, end, span) of v from its users, as `lifetimes` computes them."""
        p, status = self.p, self.status(v)
        if status == "free":
            return None, None, None
        first, last = p.need_first[v], p.need_last[v]
        for w in self.users[v]:
            when = self.made.get(w)
            if when is None:
                continue
            if first == NEVER or when < first:
                first = when
            reach = self.end[w] if p.holds_inputs(w) else when
            last = max(last, reach)
        if status == "saved":
            return None, last, (p.saved_from[v], last)
        if first == NEVER:
            return None, None, None
        return first, last, (first, max(first, last))

    def _set_span(self, v: int, new: tuple[int, int] | None, log: list, size: int | None = None) -> None:
        """v alive over `new` holding `size` bytes (by default what it holds as saved or recomputed now)."""
        old, old_size = self.span.get(v), self.held.get(v, 0)
        if size is None:
            size = self.p.recomputed_size(v) if v in self.rec else self.p.size[v]
        if old == new and (new is None or old_size == size):
            return
        if old is not None:
            self.tree.add(old[0], old[1], -old_size)
        if new is not None:
            self.tree.add(new[0], new[1], size)
            self.span[v], self.held[v] = new, size
        else:
            self.span.pop(v, None)
            self.held.pop(v, None)
        log.append(("span", v, old, new, old_size))

    def toggle(self, values: set[int], recompute: bool) -> list:
        """Add `values` to (or remove them from) the recompute set; returns an undo log."""
        log: list = []
        changed = values - self.rec if recompute else values & self.rec
        for v in changed:
            (self.rec.add if recompute else self.rec.discard)(v)
            for u in set(self.p.inputs[v]):
                self.rec_users[u] += 1 if recompute else -1
            log.append(("rec", v, recompute))
        heap = [-v for v in {x for v in changed for x in (v, *self.p.inputs[v])}]
        heapq.heapify(heap)
        seen: set[int] = set()
        while heap:
            v = -heapq.heappop(heap)
            if v in seen:
                continue
            seen.add(v)
            made, end, span = self._derive(v)
            if (self.made.get(v), self.end.get(v)) != (made, end):
                log.append(("times", v, self.made.get(v), self.end.get(v)))
                _put(self.made, v, made)
                _put(self.end, v, end)
                for u in set(self.p.inputs[v]):
                    heapq.heappush(heap, -u)
            self._set_span(v, span, log)
        self.effort.spend(TOGGLE_US * (1 + len(log)))
        return log

    def undo(self, log: list) -> None:
        self.effort.spend(TOGGLE_US * len(log))
        for entry in reversed(log):
            kind, v = entry[0], entry[1]
            if kind == "rec":
                (self.rec.discard if entry[2] else self.rec.add)(v)
                for u in set(self.p.inputs[v]):
                    self.rec_users[u] += -1 if entry[2] else 1
            elif kind == "times":
                _put(self.made, v, entry[2])
                _put(self.end, v, entry[3])
            else:
                self._set_span(v, entry[2], [], entry[4])  # back to the span and bytes before


def _put(d: dict, key: int, value: int | None) -> None:
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def _closure(problem: MemoryProblem, rec: set[int], value: int) -> set[int] | None:
    """`value` plus the unsaveable inputs its recomputation needs (recursively), not yet in rec."""
    out, stack = set(), [value]
    while stack:
        v = stack.pop()
        if v in out or (v in rec and v != value):
            continue
        if not problem.can_recompute[v]:
            return None
        out.add(v)
        stack.extend(j for j in problem.inputs[v] if not problem.can_save[j])
    return out - rec


def _extend(problem: MemoryProblem, rec: set[int], move: set[int]) -> set[int] | None:
    """`move` plus the producers it would newly force to be kept (those that can be recomputed)."""
    grown = set(move)
    for v in move:
        for u in problem.inputs[v]:
            if u not in rec and u not in move and problem.size[u] and problem.can_recompute[u]:
                grown |= _closure(problem, rec, u) or set()
    return grown if grown != move else None


def _descend(problem: MemoryProblem, state: _State, target: int, weigh_cost: bool) -> None:
    """Add recomputations until the peak is <= target, no move lowers it or the state's effort is spent.
    Each round prices the moves at the peak step, then applies them best first while each still lowers it."""
    while state.tree.top() > target and not state.effort.done():
        peak, step = state.tree.top(), state.tree.argmax()
        alive = [v for v, (first, last) in state.span.items() if first <= step <= last and problem.size[v]
                 and v not in state.rec and problem.can_recompute[v]]
        # Values whose recomputation would come after this step free their bytes here: try them first.
        alive.sort(key=lambda v: (state.first_read(v) <= step, -problem.size[v] / (problem.cost[v] + 1), v))
        ranked, level_moves = [], []
        for v in alive[:MOVES_PER_ROUND]:
            move = _closure(problem, state.rec, v)
            for _ in range(CHAIN_DEPTH):
                if not move:
                    break
                log = state.toggle(move, True)
                new_peak, new_level = state.tree.top(), state.tree.at(step)
                state.undo(log)
                added = recompute_cost(problem, move) if weigh_cost else 0
                if new_peak < peak:
                    ranked.append(((peak - new_peak) / (added + 1), -new_peak, -v, move))
                    break
                if new_peak == peak and new_level < peak:
                    level_moves.append(((peak - new_level) / (added + 1), 0, -v, move))
                    break
                # Recomputing v only moved its bytes to an input that must now be kept: take the input too.
                move = _extend(problem, state.rec, move)
        if not ranked and level_moves:
            # A plateau: several steps share the peak. Lower this one; the others come next rounds.
            state.toggle(max(level_moves, key=lambda r: r[:3])[3], True)
            continue
        progressed = False
        for *_, move in sorted(ranked, key=lambda r: r[:3], reverse=True):
            before = state.tree.top()
            log = state.toggle(move - state.rec, True)
            if state.tree.top() < before:
                progressed = True
            else:
                state.undo(log)
            if state.tree.top() <= target:
                break
        if not progressed:
            break


def _prune(problem: MemoryProblem, state: _State, budget: int) -> None:
    """Drop recomputations, costliest first, while the decision stays valid and within budget (and the
    state's effort lasts)."""
    for v in sorted(state.rec, key=lambda i: (-problem.cost[i], i)):
        if state.effort.done():
            break
        if problem.cost[v] == 0 or v not in state.rec:
            continue
        log = state.toggle({v}, False)
        if state.tree.top() > budget or not problem.can_save[v] and state.status(v) == "saved" \
                or any(not problem.can_save[u] and state.status(u) == "saved" for u in problem.inputs[v]):
            state.undo(log)


def _recompute_run(problem: MemoryProblem, start: frozenset[int], offload: frozenset[int],
                   effort: Effort) -> tuple[frozenset[int], bool]:
    """Recompute descent (cheapest first, then by bytes alone) from `start` with `offload` fixed;
    returns R and whether it fits."""
    state = _State(problem, start, offload, effort)
    _descend(problem, state, problem.budget, weigh_cost=True)
    if state.tree.top() > problem.budget:  # cheapest-first got stuck: descend on bytes alone
        retry = _State(problem, start, offload, effort)
        _descend(problem, retry, problem.budget, weigh_cost=False)
        state = min(state, retry, key=lambda s: s.tree.top())
    rec = frozenset(state.rec)
    feasible = is_valid(problem, rec) and state.tree.top() <= problem.budget
    if feasible:
        _prune(problem, state, problem.budget)
        rec = frozenset(state.rec)
    return rec, feasible


def _offload_descent(problem: MemoryProblem, rec: frozenset[int], effort: Effort) -> frozenset[int]:
    """Offload values alive at the peak, largest first, while that lowers the peak for little time."""
    spans = lifetimes(problem, rec)
    saved = saved_set(problem, rec)
    options = [v for v in saved if problem.offloadable(v) and not set(problem.offload_blockers[v]) & rec]
    alone = {v: transfer_schedule(problem, [v]) for v in options}
    off: frozenset[int] = frozenset()
    profile = memory_profile(problem, rec)
    sweep = PROFILE_US * (problem.num_values + problem.num_steps)  # one profile
    while max(profile) > problem.budget and not effort.done():
        peak = max(profile)
        step = profile.index(peak)
        tries = sorted((v for v in options if v not in off and spans[v][0] <= step <= spans[v][1]
                        and alone[v].out_last[v] < step < alone[v].in_first[v]),
                       key=lambda v: (-problem.size[v], v))[:MOVES_PER_ROUND]
        cost, best = offload_cost(problem, off), None
        effort.spend(sweep * len(tries))
        for v in tries:
            trial = memory_profile(problem, rec, off | {v})
            gain = peak - max(trial)
            if gain > 0:
                score = (gain / (offload_cost(problem, off | {v}) - cost + 1), -v)
                if best is None or score > best[0]:
                    best = (score, v, trial)
        if best is None:
            break
        off, profile = off | {best[1]}, best[2]
    return off


def _with_offload(problem: MemoryProblem, effort: Effort) -> tuple[frozenset[int], frozenset[int], bool]:
    """Offload first, then recompute what still does not fit; then drop offloads not needed."""
    start = eager_decision(problem)
    off = _offload_descent(problem, start, effort)
    blocked = off | {w for v in off for w in problem.offload_blockers[v]}
    fixed = replace(problem, can_recompute=tuple(c and i not in blocked for i, c in enumerate(problem.can_recompute)))
    rec, feasible = _recompute_run(fixed, start, off, effort)
    if feasible:
        for v in sorted(off, key=lambda v: (problem.size[v], v)):
            if effort.done():
                break
            effort.spend(PROFILE_US * (problem.num_values + problem.num_steps))
            if peak_bytes(problem, rec, off - {v}) <= problem.budget:
                off = off - {v}
    return rec, off, feasible and is_valid(problem, rec, off)


def solve_greedy(problem: MemoryProblem, time_limit_s: float | Effort = 10.0) -> Solution:
    """The greedy decision within about `time_limit_s` seconds (`fxmem.solve.effort`): "optimal" when it
    recomputes nothing costly, "feasible" when it fits, else "unknown" (or "infeasible" when proven)."""
    started, effort = time.perf_counter(), Effort.of(time_limit_s)
    offloading = any(problem.can_offload)
    rec, feasible = _recompute_run(problem, eager_decision(problem), frozenset(),
                                   effort.part(0.5) if offloading else effort)
    off: frozenset[int] = frozenset()
    if offloading:
        rec2, off2, feasible2 = _with_offload(problem, effort)
        if (feasible2, -decision_cost(problem, rec2, off2)) > (feasible, -decision_cost(problem, rec)):
            rec, off, feasible = rec2, off2, feasible2
    cost = decision_cost(problem, rec, off)
    if feasible:
        status = "optimal" if cost == 0 else "feasible"
    else:
        status = "infeasible" if proven_over_budget(problem) else "unknown"
    return make_solution(problem, rec, status, 0, started, "greedy", off)


def greedy_min_peak(problem: MemoryProblem, time_limit_s: float | Effort = 10.0,
                    start: frozenset[int] | None = None) -> frozenset[int]:
    """A decision with a low peak, cost ignored (an upper bound on the least peak), descending from
    `start` (eager's decision by default) for about `time_limit_s` seconds at most."""
    state = _State(problem, eager_decision(problem) if start is None else start, effort=Effort.of(time_limit_s))
    _descend(problem, state, -1, weigh_cost=False)
    return frozenset(state.rec)
