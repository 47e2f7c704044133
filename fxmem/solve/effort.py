"""Deterministic limits for the searches: work counted, never read off a clock.

A search given `time_limit_s` converts it once, where it starts, into an `Effort` of
`time_limit_s * UNITS_PER_SECOND` units, a unit being about a microsecond of one core of an idle machine
(measured as CPU time on a 2-core x86 machine, so its load did not skew the figures; a search using two
cores of an idle machine may take less). fxmem's own searches charge each step by what it touches (the
constants beside each search: a value re-derived by the greedy descent, the values and steps of a profile, a
buffer placed, a node of the skyline search) and stop once the effort is spent, so the same problem is
searched the same way, to the same answer, on an idle or a loaded machine; only the seconds it takes change.

A CP-SAT call gets what is left as a deterministic time limit (`max_deterministic_time`), at its model's rate
of CP-SAT's deterministic time per CPU-second (`EXACT_DTIME_PER_S`, `PACKING_DTIME_PER_S`,
`cumulative_dtime_per_s`), a fixed number of workers (interleaved when more than one, so the threads' timing
does not change the answer) and seed `SEED`; the deterministic time it used is charged back, with what
loading and presolving the model costs beside it (`CPSAT_CALL_US`, `CPSAT_CONSTRAINT_US`), which CP-SAT's
deterministic time leaves out. CP-SAT may pass its limit by a batch of work; that too is the same on every
run. The rates are approximate (a model's work per unit of deterministic time varies 2-3x with its shape),
so a search takes about its limit, not exactly.

Torch-free, and ortools-free: the CP-SAT solver is handed in by the modules that build models.
"""
from __future__ import annotations

import math

UNITS_PER_SECOND = 1_000_000
SEED = 0
WORKERS = 2
# CP-SAT's deterministic time per CPU-second, measured on the models fxmem builds: the 0-1 program of
# `fxmem.solve.recompute.exact` (1.4-4.9 CPU-seconds per unit), and buffer packing's 2-D no-overlap models
# (`fxmem.solve.packing`: 3-10 CPU-seconds per unit, 6-7 on the large-neighbourhood search's windows).
EXACT_DTIME_PER_S = 0.5
PACKING_DTIME_PER_S = 0.15
# The cumulative model of `fxmem.solve.recompute.cpsat` counts far less deterministic time than it works,
# and less the larger it is: a CPU-second per unit per 40-55 constraints on synthetic chains (20 CPU-seconds
# per unit at 740 constraints, 60 at 2,500, 160 at 7,400, 350-450 at 24,700), per 80-115 constraints on GPT
# models' problems; with one worker or two.
CUMULATIVE_CONSTRAINTS_PER_DTIME_S = 75
# What a CP-SAT call costs beside the deterministic time it counts (loading and presolving the model): about
# 10 ms, and 7-17 µs per constraint on the exact program's windows of a GPT-2 layer (14,000 constraints).
CPSAT_CALL_US, CPSAT_CONSTRAINT_US = 10_000.0, 10.0


def cumulative_dtime_per_s(constraints: int) -> float:
    """CP-SAT's deterministic time per CPU-second on a cumulative model with `constraints` constraints."""
    return CUMULATIVE_CONSTRAINTS_PER_DTIME_S / max(1, constraints)


class Effort:
    """A limit of `limit` units of work, of which `spent` are spent. A part given to a sub-search
    (`part`, `until`) spends from this one too, so shares add up as deadlines did."""

    __slots__ = ("limit", "parent", "spent")

    def __init__(self, units: float, parent: Effort | None = None):
        self.limit, self.spent, self.parent = max(0.0, float(units)), 0.0, parent

    @classmethod
    def of(cls, limit: float | Effort) -> Effort:
        """`limit` itself when it is an Effort, else `limit` seconds as units: the one conversion."""
        return limit if isinstance(limit, Effort) else cls(float(limit) * UNITS_PER_SECOND)

    @property
    def seconds(self) -> float:
        """The limit, in seconds of the idle machine."""
        return self.limit / UNITS_PER_SECOND

    @property
    def left_s(self) -> float:
        return max(0.0, self.limit - self.spent) / UNITS_PER_SECOND

    def done(self) -> bool:
        return self.spent >= self.limit

    def spend(self, units: float) -> None:
        effort: Effort | None = self
        while effort is not None:
            effort.spent += units
            effort = effort.parent

    def part(self, share: float = 1.0, *, least_s: float = 0.0, most_s: float = math.inf) -> Effort:
        """A sub-search's limit: `share` of what is left, at least `least_s` (even past this limit) and at
        most `most_s` seconds."""
        return Effort(min(max(share * self.left_s, least_s), most_s) * UNITS_PER_SECOND, self)

    def child(self, seconds: float) -> Effort:
        """A sub-search's limit of `seconds`, even past what is left of this one."""
        return Effort(seconds * UNITS_PER_SECOND, self)

    def until(self, share: float) -> Effort:
        """A sub-search's limit: what is left of the first `share` of this limit (nothing once it is spent)."""
        return Effort(share * self.limit - self.spent, self)

    def run_cpsat(self, solver, model, dtime_per_s: float, workers: int = WORKERS, least_s: float = 0.0,
                  seed: int = SEED) -> int:
        """`solver.solve(model)` within what is left (at least `least_s` seconds) at `dtime_per_s`, with
        `workers` workers and `seed`; charges the deterministic time it used and returns its status."""
        params = solver.parameters
        params.max_deterministic_time = max(self.left_s, least_s) * dtime_per_s
        params.num_workers = workers
        params.interleave_search = workers > 1
        params.random_seed = seed
        code = solver.solve(model)
        self.spend(solver.response_proto.deterministic_time / dtime_per_s * UNITS_PER_SECOND
                   + CPSAT_CALL_US + CPSAT_CONSTRAINT_US * len(model.proto.constraints))
        return code
