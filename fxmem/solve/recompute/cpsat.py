"""Exact keep / recompute / offload solver on OR-Tools CP-SAT (the only module importing ortools).

Reads a `MemoryProblem`; writes nothing. Booleans r_i (recompute) and s_i (save); integers
made_i (the step a recomputed value is made) and end_i (its last step alive), linked as in
`fxmem.solve.problem.lifetimes`; memory is a cumulative resource over optional intervals, with the
decision-independent base bytes as fixed intervals. Offload (when the problem allows it): o_i
replaces value i's saved interval by two, before its copy out ends and after its copy back
starts, each copy as it would run alone on the link; a no-overlap constraint per direction keeps
the copies apart, so they do run alone (`transfer_schedule` then agrees). Determinism: limits in CP-SAT's
deterministic time (`fxmem.solve.effort`: this model counts less of it the larger it is, so the rate falls with
its constraints), seed 0, and a fixed number of workers: 2, interleaved, up to `INTERLEAVED_UP_TO` values (its LP
and core workers prove small problems optimal in a fraction of a second), 1 above (on a GPT-2 of 531 values one
worker finds lower peaks per second, and stops at its limit where interleaved batches run past it). The same
problem and limit give the same R on every run, on an idle or a loaded machine.
"""
from __future__ import annotations

import math
import time

from ortools.sat.python import cp_model

from fxmem.solve.effort import Effort, cumulative_dtime_per_s
from fxmem.solve.problem import (
    NEVER,
    MemoryProblem,
    decision_cost,
    is_feasible,
    is_valid,
    lifetimes,
    peak_bytes,
    saved_set,
    transfer_schedule,
)
from fxmem.solve.recompute.greedy import solve_greedy
from fxmem.solve.solution import Solution, make_solution

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}
INTERLEAVED_UP_TO = 200  # values; larger problems get one worker


def _base_runs(base: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first, last + 1, bytes) for each run of equal base memory."""
    runs, start = [], 0
    for t in range(1, len(base) + 1):
        if t == len(base) or base[t] != base[start]:
            runs.append((start, t, base[start]))
            start = t
    return runs


class _Model:
    """Decision variables, validity, lifetimes, and the cumulative memory constraint."""

    def __init__(self, problem: MemoryProblem, capacity: int | None, offload: bool = True) -> None:
        p, m = problem, cp_model.CpModel()
        self.p, self.model = p, m
        n, never = p.num_values, p.num_steps  # `never`: a step after the last one
        self.r = [m.new_bool_var(f"r{i}") for i in range(n)]
        self.s = [m.new_bool_var(f"s{i}") for i in range(n)]
        self.o = {i: m.new_bool_var(f"o{i}") for i in range(n) if offload and p.offloadable(i) and p.size[i]}
        self.windows = {i: transfer_schedule(p, [i]) for i in self.o}
        self.made = [m.new_int_var(0, never, f"made{i}") for i in range(n)]
        self.end = [m.new_int_var(0, never, f"end{i}") for i in range(n)]
        made_if_recomputed = []
        for i in range(n):
            var = m.new_int_var(0, never, f"mr{i}")
            m.add(var == self.made[i]).only_enforce_if(self.r[i])
            m.add(var == never).only_enforce_if(~self.r[i])
            made_if_recomputed.append(var)
        users = p.consumers()
        for i in range(n):
            r, s = self.r[i], self.s[i]
            if not p.can_recompute[i]:
                m.add(r == 0)
            if not p.can_save[i]:
                m.add(s == 0)
            if p.needed[i]:
                m.add_exactly_one(r, s)
            else:
                m.add_at_most_one(r, s)
            # Made just before the first read of it or of a recomputed consumer (the latest step
            # allowed); alive until the last such read and the end of recomputed views of it.
            firsts = [made_if_recomputed[w] for w in users[i]]
            firsts += [p.need_first[i]] if p.needed[i] else [never]
            m.add_min_equality(self.made[i], firsts)
            if p.need_last[i] != NEVER:
                m.add(self.end[i] >= p.need_last[i])
            m.add(self.end[i] >= self.made[i]).only_enforce_if(r)
            for j in sorted(set(p.inputs[i])):
                m.add_bool_or([self.s[j], self.r[j]]).only_enforce_if(r)
            for w in users[i]:
                m.add(self.end[i] >= (self.end[w] if p.holds_inputs(w) else self.made[w])).only_enforce_if(self.r[w])
            if i in self.o:
                m.add_implication(self.o[i], s)
                for w in p.offload_blockers[i]:
                    m.add_implication(self.o[i], ~self.r[w])
        self.capacity = m.new_int_var(0, max(p.base, default=0) + sum(p.size), "peak") if capacity is None else capacity
        self._memory()

    def _memory(self) -> None:
        p, m = self.p, self.model
        intervals, demands = [], []
        copies_out, copies_in = [], []
        for i in range(p.num_values):
            if not p.size[i]:
                continue
            if p.can_save[i]:
                m.add(self.end[i] >= p.saved_from[i]).only_enforce_if(self.s[i])
                size = m.new_int_var(0, p.num_steps, f"kept{i}")
                kept = self.s[i]
                if i in self.o:
                    kept = m.new_bool_var(f"k{i}")
                    m.add_bool_and([self.s[i], ~self.o[i]]).only_enforce_if(kept)
                    m.add_bool_or([~self.s[i], self.o[i], kept])
                    out_last, in_first = self.windows[i].out_last[i], self.windows[i].in_first[i]
                    ready = p.offload_ready[i]
                    m.add(self.end[i] >= in_first).only_enforce_if(self.o[i])
                    gone = m.new_optional_fixed_size_interval_var(p.saved_from[i], out_last + 1 - p.saved_from[i],
                                                                  self.o[i], f"O{i}")
                    back_size = m.new_int_var(0, p.num_steps, f"back{i}")
                    back = m.new_optional_interval_var(in_first, back_size, self.end[i] + 1, self.o[i], f"I{i}")
                    intervals += [gone, back]
                    demands += [p.size[i], p.size[i]]
                    copies_out.append(gone)
                    copies_in.append(m.new_optional_fixed_size_interval_var(in_first, ready - in_first,
                                                                            self.o[i], f"C{i}"))
                intervals.append(m.new_optional_interval_var(p.saved_from[i], size, self.end[i] + 1, kept, f"S{i}"))
                demands.append(p.size[i])
            if p.can_recompute[i] and p.recomputed_size(i):
                size = m.new_int_var(0, p.num_steps, f"held{i}")
                intervals.append(m.new_optional_interval_var(self.made[i], size, self.end[i] + 1, self.r[i], f"R{i}"))
                demands.append(p.size[i])
        for first, stop, nbytes in _base_runs(p.base):
            if nbytes:
                intervals.append(m.new_fixed_size_interval_var(first, stop - first, f"B{first}"))
                demands.append(nbytes)
        m.add_cumulative(intervals, demands, self.capacity)
        if copies_out:
            m.add_no_overlap(copies_out)
            m.add_no_overlap(copies_in)

    def hint(self, rec: frozenset[int], off: frozenset[int] = frozenset()) -> None:
        saved, spans = saved_set(self.p, rec), lifetimes(self.p, rec)
        for i, o in self.o.items():
            self.model.add_hint(o, i in off)
        for i in range(self.p.num_values):
            self.model.add_hint(self.r[i], i in rec)
            self.model.add_hint(self.s[i], i in saved)
            if i in rec and i in spans:
                self.model.add_hint(self.made[i], spans[i][0])
            if i in spans:
                self.model.add_hint(self.end[i], spans[i][1])

    def run(self, effort: Effort, num_workers: int | None = None) -> tuple[int, cp_model.CpSolver]:
        """Solve within `effort` (at least 0.01 s), with `num_workers` or the count for this size."""
        solver = cp_model.CpSolver()
        workers = num_workers or (2 if self.p.num_values <= INTERLEAVED_UP_TO else 1)
        rate = cumulative_dtime_per_s(len(self.model.proto.constraints))
        return effort.run_cpsat(solver, self.model, rate, workers, least_s=0.01), solver

    def decision(self, solver: cp_model.CpSolver) -> frozenset[int]:
        return frozenset(i for i, r in enumerate(self.r) if solver.boolean_value(r))

    def offloaded(self, solver: cp_model.CpSolver) -> frozenset[int]:
        return frozenset(i for i, o in self.o.items() if solver.boolean_value(o))

    def cost(self):
        overhead = self.p.offload_overhead_ns
        return sum(c * r for c, r in zip(self.p.cost, self.r) if c) + sum(overhead * o for o in self.o.values())


def solve_cpsat(problem: MemoryProblem, time_limit_s: float | Effort = 10.0,
                num_workers: int | None = None) -> Solution:
    """Least-cost decision with peak <= budget within about `time_limit_s` seconds (`fxmem.solve.effort`),
    the greedy descent getting half; the greedy decision when CP-SAT finds none better. "infeasible" only
    when proven; out of its limit with nothing that fits, "unknown" with the greedy's best try."""
    started, effort = time.perf_counter(), Effort.of(time_limit_s)
    greedy = solve_greedy(problem, effort.part(0.5))
    if greedy.status == "infeasible":  # proven from the problem alone
        return make_solution(problem, greedy.recompute, "infeasible", 0, started, "cpsat", greedy.offloaded)
    model = _Model(problem, problem.budget)
    model.model.minimize(model.cost())
    if greedy.fits:
        model.hint(greedy.recompute, greedy.offloaded)
    code, solver = model.run(effort, num_workers)
    status = _STATUS.get(code)
    if status is None or status == "infeasible":
        return make_solution(problem, greedy.recompute, greedy.status if status is None else "infeasible",
                             0, started, "cpsat", greedy.offloaded)
    rec, off = model.decision(solver), model.offloaded(solver)
    bound = math.ceil(solver.best_objective_bound - 1e-6)
    if status == "optimal" and effort.left_s > 0.05:
        rec, off = _lowest_peak(problem, rec, off, effort, num_workers)
    if not is_feasible(problem, rec, off):
        raise AssertionError(f"CP-SAT returned an infeasible decision: {sorted(rec)}, offload {sorted(off)}")
    if greedy.fits and greedy.objective < decision_cost(problem, rec, off):
        rec, off, status = greedy.recompute, greedy.offloaded, "feasible"
    return make_solution(problem, rec, status, bound, started, "cpsat", off)


def _lowest_peak(problem: MemoryProblem, rec: frozenset[int], off: frozenset[int], effort: Effort,
                 num_workers: int | None) -> tuple[frozenset[int], frozenset[int]]:
    """Among decisions as cheap as `rec` (and `off`), one with the lowest peak, so the peak falls as the
    budget does. Returns the decision given if nothing better is found within `effort`."""
    model = _Model(problem, None)
    peak = peak_bytes(problem, rec, off)
    model.model.add(model.cost() <= decision_cost(problem, rec, off))
    model.model.add(model.capacity <= peak)
    model.model.minimize(model.capacity)
    model.hint(rec, off)
    code, solver = model.run(effort, num_workers)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return rec, off
    better, better_off = model.decision(solver), model.offloaded(solver)
    if is_valid(problem, better, better_off) and peak_bytes(problem, better, better_off) < peak:
        return better, better_off
    return rec, off


def cpsat_min_peak(problem: MemoryProblem, time_limit_s: float | Effort = 10.0, num_workers: int | None = None,
                   hint: frozenset[int] | None = None) -> tuple[int, frozenset[int], bool] | None:
    """Smallest peak over valid decisions (budget and cost ignored), a decision reaching it, and whether
    CP-SAT proved it least (this model is exact); None when CP-SAT finds no valid decision within the
    limit. Recompute only (no offload)."""
    model = _Model(problem, None, offload=False)
    model.model.minimize(model.capacity)
    if hint is not None and is_valid(problem, hint):
        model.hint(hint)
        model.model.add_hint(model.capacity, peak_bytes(problem, hint))
    code, solver = model.run(Effort.of(time_limit_s), num_workers)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    rec = model.decision(solver)
    if not is_valid(problem, rec):
        raise AssertionError(f"CP-SAT returned an invalid decision: {sorted(rec)}")
    peak = peak_bytes(problem, rec)  # proven where the model's optimum is this decision's peak
    return peak, rec, code == cp_model.OPTIMAL and peak == round(solver.objective_value)
