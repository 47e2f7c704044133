"""Exact keep-or-recompute solver: a time-indexed 0-1 program (Checkmate-style) solved to proof.

Reads a `MemoryProblem`; writes nothing. An independent formulation from `fxmem.solve.recompute.cpsat`:
memory is checked at every step where some lifetime can begin or end (the `saved_from`,
`need_first` and `need_last` values; lifetimes of `fxmem.solve.problem.lifetimes` only ever begin and
end there) and on the open stretches between them, with booleans
  r_v, s_v       recompute / save v
  M[v,k]         v is recomputed and made at or before point k (exact: min over readers)
  E[v,k]         v's last step is at or after point k (only bounded below: memory pushes it down)
  A[v,k]         v occupies memory at point k (only bounded below)
and a linear memory row per point and stretch. Nothing is cut short: no heuristic limits on the
decisions, no time-limited shortcut; a result is "optimal" only when CP-SAT proves it, "infeasible" only
when it proves that. Limits are CP-SAT's deterministic time (`fxmem.solve.effort`), 2 interleaved workers
and seed 0, so a search that runs out of its limit stops at the same point on every run.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fxmem.solve.effort import EXACT_DTIME_PER_S, WORKERS, Effort
from fxmem.solve.problem import NEVER, MemoryProblem, eager_decision, is_valid, peak_bytes
from fxmem.solve.recompute.bound import proven_over_budget
from fxmem.solve.solution import Solution, make_solution

DEFAULT_TIME_LIMIT_S = 600.0


@dataclass(frozen=True)
class _Points:
    """The steps memory is checked at, and the largest base bytes on the stretch after each."""

    steps: tuple[int, ...]
    base_at: tuple[int, ...]
    base_after: tuple[int, ...]  # max base on (steps[k], steps[k+1]); 0 when the stretch is empty
    base_outside: int  # max base before the first and after the last point


def _points(p: MemoryProblem) -> _Points:
    raw = set(p.saved_from) | {t for t in p.need_first if t != NEVER} | {t for t in p.need_last if t != NEVER}
    steps = tuple(sorted(t for t in raw if 0 <= t < p.num_steps))
    after = []
    for k, t in enumerate(steps):
        stop = steps[k + 1] if k + 1 < len(steps) else t + 1
        after.append(max(p.base[t + 1:stop], default=0))
    outside = list(p.base[:steps[0]] + p.base[steps[-1] + 1:]) if steps else list(p.base)
    return _Points(steps, tuple(p.base[t] for t in steps), tuple(after), max(outside, default=0))


Lit = object  # True, False, or a CP-SAT literal


def _neg(x: Lit) -> Lit:
    return (not x) if isinstance(x, bool) else ~x


def _implied(m: cp_model.CpModel, out: Lit, conds: list[Lit]) -> Lit:
    """`out` is forced true when all `conds` hold: adds the clause; returns what the
    conjunction folds to (False when a condition is False, True when all are True)."""
    conds = [c for c in conds if c is not True]
    if any(c is False for c in conds):
        return False
    if not conds:
        return True
    m.add_bool_or([out] + [_neg(c) for c in conds])
    return out


def _at_least(m: cp_model.CpModel, name: str, causes: list[list[Lit]]) -> Lit:
    """A boolean forced true by any of the conjunctions `causes` (bounded below only)."""
    causes = [c for c in ([x for x in cause if x is not True] for cause in causes) if not any(x is False for x in c)]
    if not causes:
        return False
    if any(not c for c in causes):
        return True
    var = m.new_bool_var(name)
    for cause in causes:
        _implied(m, var, cause)
    return var


class _Model:
    """The 0-1 program for one problem; `capacity` is the budget, or None to minimise the peak."""

    def __init__(self, p: MemoryProblem, capacity: int | None, memory: bool = True):
        self.p, self.model = p, cp_model.CpModel()
        self.pts = _points(p)
        m, n = self.model, p.num_values
        self.r: list[Lit] = [m.new_bool_var(f"r{v}") if p.can_recompute[v] else False for v in range(n)]
        self.s: list[Lit] = [m.new_bool_var(f"s{v}") if p.can_save[v] else False for v in range(n)]
        for v in range(n):
            pair = [x for x in (self.r[v], self.s[v]) if x is not False]
            if p.needed[v]:
                m.add_bool_or(pair) if pair else m.add_bool_or([])
            if len(pair) == 2:
                m.add_at_most_one(pair)
            if self.r[v] is not False:
                for j in sorted(set(p.inputs[v])):
                    either = [x for x in (self.s[j], self.r[j]) if x is not False]
                    m.add_bool_or(either + [_neg(self.r[v])])
        if memory:  # without it: the decision rules only
            self._made()
            self._ends()
            self._memory(capacity)

    def _index(self, t: int) -> int:
        return bisect.bisect_left(self.pts.steps, t)

    def _made(self) -> None:
        """M[v][k]: v is recomputed and made at or before point k (the first read of v or of a
        recomputed user), exact in both directions."""
        p, m, K = self.p, self.model, len(self.pts.steps)
        users = p.consumers()
        self.M: list[list[Lit]] = [[] for _ in range(p.num_values)]
        lo = [K] * p.num_values
        for v in reversed(range(p.num_values)):
            nf = self._index(p.need_first[v]) if p.needed[v] else K
            lo[v] = min([nf] + [lo[w] for w in users[v]])
            row: list[Lit] = []
            for k in range(K):
                if self.r[v] is False or k < lo[v]:
                    row.append(False)
                elif k >= nf:
                    row.append(self.r[v])
                else:
                    readers = [self.M[w][k] for w in users[v] if self.M[w][k] is not False]
                    made = m.new_bool_var(f"M{v}_{k}")
                    m.add_implication(made, self.r[v])
                    m.add_bool_or(readers + [_neg(made)])
                    for x in readers:
                        m.add_bool_or([made, _neg(x), _neg(self.r[v])])
                    row.append(made)
            self.M[v] = row
        self.mat = [row[-1] if row else False for row in self.M]

    def _ends(self) -> None:
        """E[v][k]: the last step v must stay alive reaches point k: its own last read, the making
        of a recomputed user, or the end of a recomputed view of it (bounded below)."""
        p, K = self.p, len(self.pts.steps)
        users = p.consumers()
        self.E: list[list[Lit]] = [[] for _ in range(p.num_values)]
        for v in reversed(range(p.num_values)):
            nl = self._index(p.need_last[v]) if p.need_last[v] != NEVER else -1
            row: list[Lit] = []
            for k in range(K):
                if k <= nl:
                    row.append(True)
                    continue
                causes = []
                for w in users[v]:
                    if p.holds_inputs(w):
                        causes.append([self.E[w][k], self.mat[w]])
                    elif not k or self.M[w][k - 1] is not self.mat[w]:  # else made before point k
                        causes.append([self.mat[w]] + ([_neg(self.M[w][k - 1])] if k else []))
                row.append(_at_least(self.model, f"E{v}_{k}", causes))
            self.E[v] = row

    def _memory(self, capacity: int | None) -> None:
        p, m, pts = self.p, self.model, self.pts
        K = len(pts.steps)
        top = max(p.base, default=0) + sum(p.size)
        self.capacity = m.new_int_var(0, top, "peak") if capacity is None else capacity
        if capacity is None:
            m.add(self.capacity >= pts.base_outside)
        elif pts.base_outside > capacity:
            m.add_bool_or([])
        alive: list[dict[int, Lit]] = [{} for _ in range(K)]
        for v in range(p.num_values):
            if not p.size[v]:
                continue
            sf = self._index(p.saved_from[v])
            for k in range(K):
                causes = []  # recomputed and `inlined`, it holds no bytes of its own
                if not p.inlined(v):
                    causes = [[self.M[v][k], self.E[v][k]], [self.M[v][k]] + ([_neg(self.M[v][k - 1])] if k else [])]
                    if self.M[v][k] is not False and k and self.M[v][k] is self.M[v][k - 1]:
                        causes.pop(1)  # made at or before point k-1 already
                if k >= sf:
                    causes.append([self.s[v], self.E[v][k]])
                lit = _at_least(m, f"A{v}_{k}", causes)
                if lit is not False:
                    alive[k][v] = lit
        for k in range(K):
            self._row(pts.base_at[k], alive[k])
            if k + 1 < K and pts.steps[k + 1] > pts.steps[k] + 1:
                both = {v: _at_least(m, f"G{v}_{k}", [[x, alive[k + 1][v]]])
                        for v, x in alive[k].items() if v in alive[k + 1]}
                self._row(pts.base_after[k], {v: x for v, x in both.items() if x is not False})

    def _row(self, fixed: int, alive: dict[int, Lit]) -> None:
        fixed += sum(self.p.size[v] for v, x in alive.items() if x is True)
        terms = [self.p.size[v] * x for v, x in alive.items() if x is not True]
        if terms or not isinstance(self.capacity, int):
            self.model.add(sum(terms) + fixed <= self.capacity)
        elif fixed > self.capacity:
            self.model.add_bool_or([])

    def hint(self, rec: frozenset[int]) -> None:
        for v, x in enumerate(self.r):
            if x is not False:
                self.model.add_hint(x, v in rec)

    def run(self, effort: Effort, num_workers: int = WORKERS, least_s: float = 0.01) -> tuple[int, cp_model.CpSolver]:
        solver = cp_model.CpSolver()
        return effort.run_cpsat(solver, self.model, EXACT_DTIME_PER_S, num_workers, least_s), solver

    def decision(self, solver: cp_model.CpSolver) -> frozenset[int]:
        return frozenset(v for v, x in enumerate(self.r) if x is not False and solver.boolean_value(x))


def solve_exact(problem: MemoryProblem, time_limit_s: float | Effort = DEFAULT_TIME_LIMIT_S,
                num_workers: int = WORKERS, hint: frozenset[int] | None = None) -> Solution:
    """Least-cost decision with peak <= budget within about `time_limit_s` seconds (`fxmem.solve.effort`),
    "optimal" only when proven ("feasible" with CP-SAT's bound otherwise, or the `hint` when it fits and
    nothing better was found); "infeasible" when proven that none exists, "unknown" when the limit ran out
    with no decision that fits (eager's decision is then returned)."""
    started, effort = time.perf_counter(), Effort.of(time_limit_s)
    if proven_over_budget(problem):
        return make_solution(problem, eager_decision(problem), "infeasible", 0, started, "exact")
    model = _Model(problem, problem.budget)
    model.model.minimize(sum(c * x for c, x in zip(problem.cost, model.r) if c and x is not False))
    fits = hint is not None and is_valid(problem, hint) and peak_bytes(problem, hint) <= problem.budget
    if fits:
        model.hint(hint)
    code, solver = model.run(effort, num_workers)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if fits and code != cp_model.INFEASIBLE:  # out of its limit before a first solution: the hint fits
            return make_solution(problem, hint, "feasible", 0, started, "exact")
        status = "infeasible" if code == cp_model.INFEASIBLE else "unknown"
        return make_solution(problem, eager_decision(problem), status, 0, started, "exact")
    rec = model.decision(solver)
    if not is_valid(problem, rec) or peak_bytes(problem, rec) > problem.budget:
        raise AssertionError(f"exact model returned an infeasible decision: {sorted(rec)}")
    status = "optimal" if code == cp_model.OPTIMAL else "feasible"
    return make_solution(problem, rec, status, math.ceil(solver.best_objective_bound - 1e-6), started, "exact")


def exact_min_peak(problem: MemoryProblem, time_limit_s: float | Effort = DEFAULT_TIME_LIMIT_S,
                   num_workers: int = WORKERS) -> tuple[int, frozenset[int], bool] | None:
    """Smallest peak over valid decisions (cost ignored), a decision reaching it, and whether
    that is proven; None when none was found within the limit."""
    model = _Model(problem, None)
    model.model.minimize(model.capacity)
    code, solver = model.run(Effort.of(time_limit_s), num_workers)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    rec = model.decision(solver)
    if not is_valid(problem, rec):
        raise AssertionError(f"exact model returned an invalid decision: {sorted(rec)}")
    return peak_bytes(problem, rec), rec, code == cp_model.OPTIMAL
