"""Pipeline stage boundaries: cut a chain of units into S contiguous stages, slowest stage least.

Reads a `StageProblem` (per unit: forward+backward seconds, recompute seconds, parameter bytes,
activation bytes per microbatch; per cut: bytes sent; no torch, no fx) and returns a `StagePlan`.
Exact dynamic programme over (stage, last unit), O(S * n^2) (`fxmem.solve.partition`); ties go to the earliest cut, so every
rank that solves the same problem gets the same plan. Writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxmem.errors import GIB, InfeasibleBudgetError, fmt_bytes
from fxmem.solve.partition import min_max_partition

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class StageProblem:
    """A chain of `n` units to cut into `num_stages` stages.

    time_s[u]: forward + backward seconds of unit u for one microbatch; recompute_s[u]: extra seconds
    when u is checkpointed (its forward again). param_bytes[u]: parameters only u reads; shared:
    (bytes, units) for parameters read by several units (counted once per stage that reads them).
    act_bytes[u]: bytes u keeps for backward per microbatch; ckpt_bytes[u]: bytes kept per microbatch
    when u is checkpointed (what u's recomputation starts from; a checkpointed stage recomputes only
    the units where that is less than act_bytes). cut_bytes[k]: bytes crossing the cut
    between units k and k+1 (n-1 cuts), sent forward and their gradients back once per microbatch.
    opt_bytes_per_param_byte: optimizer state per parameter byte (Adam fp32: 2.0; SGD: 0).
    """

    names: tuple[str, ...]
    time_s: tuple[float, ...]
    param_bytes: tuple[int, ...]
    act_bytes: tuple[int, ...]
    cut_bytes: tuple[int, ...]
    num_stages: int
    budget_bytes: int | None = None
    schedule: str = "1f1b"
    n_microbatches: int = 1
    recompute_s: tuple[float, ...] = ()
    ckpt_bytes: tuple[int, ...] = ()
    shared: tuple[tuple[int, tuple[int, ...]], ...] = ()
    opt_bytes_per_param_byte: float = 0.0
    link_bytes_per_s: float = 25e9
    link_latency_s: float = 0.0
    excluded: frozenset[tuple[int, int, int]] = frozenset()  # (first, last, stage) found not to fit

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("time_s", "param_bytes", "act_bytes"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"StageProblem.{field} has {len(getattr(self, field))} entries for {n} units")
        if len(self.cut_bytes) != max(n - 1, 0):
            raise ValueError(f"StageProblem.cut_bytes needs {n - 1} entries (one per cut), got {len(self.cut_bytes)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive integer, got {self.num_stages!r}")
        if self.num_stages > n:
            raise ValueError(f"cannot cut {n} units into {self.num_stages} non-empty stages; "
                             f"use at most {n} stages")
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {self.n_microbatches}")

    @property
    def num_units(self) -> int:
        return len(self.names)

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds at once: 1F1B S-s (at most M), GPipe M."""
        if self.schedule == "gpipe":
            return self.n_microbatches
        return min(self.num_stages - stage, self.n_microbatches)


@dataclass(frozen=True)
class Stage:
    """Units first..last (inclusive); memory and time of one stage under the schedule."""

    first: int
    last: int
    time_s: float
    compute_s: float
    transfer_s: float
    param_bytes: int
    act_bytes: int
    in_flight: int
    memory_bytes: int
    checkpoint: bool


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    slowest_s: float
    lower_bound_s: float

    @property
    def balance(self) -> float:
        """Slowest stage / lower bound (1.0 is perfect)."""
        return self.slowest_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    @property
    def cuts(self) -> tuple[int, ...]:
        """Index of the first unit of every stage but the first."""
        return tuple(s.first for s in self.stages[1:])


class _Prefix:
    """O(1) sums over unit ranges; parameters shared by several units counted once per range."""

    def __init__(self, p: StageProblem):
        self.p = p
        self.time = _prefix(p.time_s)
        # a checkpointed stage recomputes the units where that keeps fewer bytes, and keeps the rest
        ckpt = p.ckpt_bytes or p.act_bytes
        helps = [c < a for c, a in zip(ckpt, p.act_bytes)]
        self.rec = _prefix([r if h else 0.0 for r, h in zip(p.recompute_s or (0.0,) * p.num_units, helps)])
        self.params = _prefix(p.param_bytes)
        self.act = _prefix(p.act_bytes)
        self.ckpt = _prefix([min(c, a) for c, a in zip(ckpt, p.act_bytes)])

    def param_bytes(self, i: int, j: int) -> int:
        own = self.params[j + 1] - self.params[i]
        return own + sum(size for size, users in self.p.shared if any(i <= u <= j for u in users))

    def stage(self, i: int, j: int, s: int, checkpoint: bool) -> Stage:
        p = self.p
        compute = self.time[j + 1] - self.time[i]
        if checkpoint:
            compute += self.rec[j + 1] - self.rec[i]
        transfer = 0.0
        if j < p.num_units - 1 and p.link_bytes_per_s > 0:
            transfer = 2 * (p.cut_bytes[j] / p.link_bytes_per_s + p.link_latency_s)
        params = self.param_bytes(i, j)
        inflight = p.in_flight(s)
        received = p.cut_bytes[i - 1] if i > 0 else 0
        if checkpoint:  # kept per microbatch, plus one unit's activations while it is recomputed
            act = self.ckpt[j + 1] - self.ckpt[i]
            transient = max(p.act_bytes[i:j + 1])
        else:
            act, transient = self.act[j + 1] - self.act[i], 0
        memory = int(params * (2 + p.opt_bytes_per_param_byte)) + inflight * (act + received) + transient
        return Stage(i, j, compute + transfer, compute, transfer, params, act, inflight, memory, checkpoint)

    def best(self, i: int, j: int, s: int) -> Stage | None:
        """The faster of eager and checkpointed that fits the budget (None if neither fits)."""
        budget = self.p.budget_bytes
        if (i, j, s) in self.p.excluded:
            return None
        eager = self.stage(i, j, s, False)
        if budget is None or eager.memory_bytes <= budget:
            return eager
        if self.p.recompute_s and self.p.ckpt_bytes:
            ckpt = self.stage(i, j, s, True)
            if ckpt.memory_bytes <= budget:
                return ckpt
        return None


def _prefix(values) -> list:
    out = [0] * (len(values) + 1)
    for k, v in enumerate(values):
        out[k + 1] = out[k] + v
    return out


def stage_cost(p: StageProblem, first: int, last: int, stage: int, checkpoint: bool = False) -> Stage:
    """Units first..last as stage `stage`, eager or checkpointed, whether or not it fits."""
    return _Prefix(p).stage(first, last, stage, checkpoint)


def lower_bound_s(p: StageProblem) -> float:
    """No split into S contiguous stages is faster than total / S, nor than the slowest unit."""
    return max(sum(p.time_s) / p.num_stages, max(p.time_s, default=0.0))


def solve_stages(p: StageProblem) -> StagePlan:
    """Least slowest stage subject to every stage's memory <= budget; InfeasibleBudgetError otherwise."""
    plan = _dp(p, key=lambda st: st.time_s, respect_budget=True)
    if plan is None:
        raise _infeasible(p)
    return plan


def min_stage_memory(p: StageProblem) -> StagePlan:
    """The split whose largest stage memory is least (checkpointing any stage where it helps)."""
    plan = _dp(p, key=lambda st: st.memory_bytes, respect_budget=False)
    assert plan is not None
    return plan


def _dp(p: StageProblem, key, respect_budget: bool) -> StagePlan | None:
    pre = _Prefix(p)

    def choose(i: int, j: int, s: int) -> Stage | None:
        if respect_budget:
            return pre.best(i, j, s)
        eager = pre.stage(i, j, s, False)
        if p.recompute_s and p.ckpt_bytes:
            ckpt = pre.stage(i, j, s, True)
            return ckpt if ckpt.memory_bytes < eager.memory_bytes else eager
        return eager

    def run_cost(first: int, stop: int, s: int) -> float | None:
        st = choose(first, stop - 1, s)
        return None if st is None else key(st)

    runs = min_max_partition(p.num_units, p.num_stages, run_cost)
    if runs is None:
        return None
    stages = [choose(first, stop - 1, s) for s, (first, stop) in enumerate(runs)]
    return StagePlan(tuple(stages), max(st.time_s for st in stages), lower_bound_s(p))


def _infeasible(p: StageProblem) -> InfeasibleBudgetError:
    least = min_stage_memory(p)
    worst = max(least.stages, key=lambda st: st.memory_bytes)
    k = least.stages.index(worst)
    breakdown = {
        f"stage {k} of {p.num_stages} ({p.names[worst.first]} .. {p.names[worst.last]}) parameters, "
        f"gradients and optimizer state": int(worst.param_bytes * (2 + p.opt_bytes_per_param_byte)),
        f"activations of {worst.in_flight} microbatches in flight ({p.schedule})":
            worst.memory_bytes - int(worst.param_bytes * (2 + p.opt_bytes_per_param_byte)),
    }
    err = InfeasibleBudgetError(int(p.budget_bytes or 0), worst.memory_bytes, breakdown)
    err.args = (f"no split into {p.num_stages} pipeline stages fits {fmt_bytes(p.budget_bytes or 0)} per stage: "
                f"the least per-stage budget any split reaches is {fmt_bytes(worst.memory_bytes)} "
                f"({'; '.join(f'{k} {fmt_bytes(v)}' for k, v in breakdown.items())}); raise budget_gb to at "
                f"least {worst.memory_bytes / GIB:.3f}, use more stages, fewer microbatches in flight "
                "(schedule='1f1b'), or a smaller microbatch",)
    return err


def evaluate(p: StageProblem, cuts: tuple[int, ...] | list[int]) -> StagePlan:
    """A given split (first unit of every stage but the first), each stage eager unless only its
    checkpointed form fits the budget; the memory of a stage that fits neither way is still reported."""
    pre = _Prefix(p)
    bounds = list(zip([0, *cuts], [c - 1 for c in cuts] + [p.num_units - 1]))
    if len(bounds) != p.num_stages or any(i > j for i, j in bounds):
        raise ValueError(f"cuts {list(cuts)} do not make {p.num_stages} non-empty stages of {p.num_units} units")
    stages = tuple(pre.best(i, j, s) or pre.stage(i, j, s, False) for s, (i, j) in enumerate(bounds))
    return StagePlan(stages, max(st.time_s for st in stages), lower_bound_s(p))


def min_max_cuts(weights: list[float] | tuple[float, ...], num_stages: int) -> tuple[int, ...]:
    """Contiguous split whose heaviest stage (sum of weights) is least: DeepSpeed's 'parameters'
    partitioning with parameter counts as weights. Ties go to the earliest cut."""
    pre = _prefix(weights)
    runs = min_max_partition(len(weights), num_stages, lambda i, j, _: pre[j] - pre[i])
    if runs is None:
        raise ValueError(f"cannot split {len(weights)} units into {num_stages} non-empty stages")
    return tuple(first for first, _ in runs[1:])
