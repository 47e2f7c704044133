"""The keep / recompute / offload problem as plain integers: no torch, no fx.

Reads nothing and writes nothing: `MemoryProblem` is built by `fxmem.price.joint_problem` from a joint
forward/backward graph and read by the solvers in `fxmem.solve`.

A decision is the set R of candidate values recomputed in backward. Everything else follows
from R: a value is *saved* (kept from forward to backward) when backward reads it directly, or
a recomputed value reads it, and it is not itself recomputed. Backward recomputes a value just
before its first use, as the autograd engine orders it, so *when* a value is recomputed, and how
long a saved value must stay, depend on R too; `lifetimes` works that out.

Offload (optional, `can_offload`): a saved value O may instead be copied to host memory after its
last forward use and back before its first backward read; `transfer_schedule` says when its device
copy is gone and back, on one copy stream per direction (see there), and what time is exposed.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Iterable

NEVER = -1


@dataclass(frozen=True)
class MemoryProblem:
    """Candidates are forward values that backward may need, in topological order; steps are
    the joint schedule (forward steps, then backward steps).

    Per candidate i:
      names[i]          node name, for messages and plans
      size[i]           bytes its storage occupies while kept or recomputed
      cost[i]           time to recompute it, integer nanoseconds
      inputs[i]         candidate indices it reads, all < i (always-available values omitted)
      aliases[i]        it is a view of its inputs: they stay alive as long as it does
      needed[i]         backward reads it directly
      can_save[i]       False for views and multi-output ops (their parts are saved instead)
      can_recompute[i]  False for random and side-effecting ops
      multi_output[i]   it is a tuple: the candidates that take its items hold its bytes (empty: none is)
      fused[i]          when recomputed, it is computed inside the kernels that read it (Inductor fuses a
                        pointwise op into its pointwise and reduction readers): it holds no bytes of its
                        own, and its inputs stay alive as long as it would (empty: none is)
      saved_from[i]     first step at which keeping it costs `size` (after its last forward use)
      need_first[i]     first backward step that reads it directly (NEVER when none)
      need_last[i]      last backward step that reads it, or a backward view of it (NEVER when none)
    base[t]: bytes live at step t whatever is decided (parameters, gradients, transients).

    Offload, all empty when offloading is off (see `enable_offload`):
      can_offload[i]    it may be offloaded to host (saveable, large enough, its copies hide alone)
      transfer_ns[i]    one copy of it over the host link, either direction, integer nanoseconds
      offload_ready[i]  the step by which it must be back on the device (first backward read of
                        it or of a view of it)
      offload_blockers[i]  candidates that must not be recomputed while it is offloaded (they
                        would read it before `offload_ready`)
      step_ns[t]        duration of step t, integer nanoseconds (the compute copies hide behind)
      offload_overhead_ns  launch cost of the two copies of one offloaded value
    """

    names: tuple[str, ...]
    size: tuple[int, ...]
    cost: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    aliases: tuple[bool, ...]
    needed: tuple[bool, ...]
    can_save: tuple[bool, ...]
    can_recompute: tuple[bool, ...]
    saved_from: tuple[int, ...]
    need_first: tuple[int, ...]
    need_last: tuple[int, ...]
    base: tuple[int, ...]
    budget: int
    can_offload: tuple[bool, ...] = ()
    transfer_ns: tuple[int, ...] = ()
    offload_ready: tuple[int, ...] = ()
    offload_blockers: tuple[tuple[int, ...], ...] = ()
    step_ns: tuple[int, ...] = ()
    offload_overhead_ns: int = 0
    multi_output: tuple[bool, ...] = ()
    fused: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("size", "cost", "inputs", "aliases", "needed", "can_save", "can_recompute",
                      "saved_from", "need_first", "need_last") + (("multi_output",) if self.multi_output else ()) \
                + (("fused",) if self.fused else ()):
            if len(getattr(self, field)) != n:
                raise ValueError(f"MemoryProblem.{field} has {len(getattr(self, field))} entries, expected {n}")
        for i, ins in enumerate(self.inputs):
            if any(not 0 <= j < i for j in ins):
                raise ValueError(f"MemoryProblem.inputs[{i}] must name earlier candidates, got {ins}")
            if self.needed[i] != (self.need_first[i] != NEVER):
                raise ValueError(f"MemoryProblem candidate {i}: needed and need_first disagree")
        if self.can_offload:
            for field in ("can_offload", "transfer_ns", "offload_ready", "offload_blockers"):
                if len(getattr(self, field)) != n:
                    raise ValueError(f"MemoryProblem.{field} has {len(getattr(self, field))} entries, expected {n}")
            if len(self.step_ns) != len(self.base):
                raise ValueError(f"MemoryProblem.step_ns has {len(self.step_ns)} entries, expected {len(self.base)}")

    def offloadable(self, i: int) -> bool:
        return bool(self.can_offload) and self.can_offload[i]

    def inlined(self, i: int) -> bool:
        """Whether i, recomputed, is computed inside its readers' kernels (`fused`): no bytes of its own."""
        return bool(self.fused) and self.fused[i]

    def holds_inputs(self, i: int) -> bool:
        """Whether i, recomputed, keeps its inputs alive as long as it lives (a view, or `inlined`)."""
        return self.aliases[i] or self.inlined(i)

    def recomputed_size(self, i: int) -> int:
        """Bytes i holds while recomputed (`size`, none where `inlined`)."""
        return 0 if self.inlined(i) else self.size[i]

    @property
    def num_values(self) -> int:
        return len(self.names)

    @property
    def num_steps(self) -> int:
        return len(self.base)

    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """consumers()[j]: candidates whose inputs contain j (computed once)."""
        cached = self.__dict__.get("_consumers")
        if cached is None:
            users: list[list[int]] = [[] for _ in self.names]
            for i, ins in enumerate(self.inputs):
                for j in set(ins):
                    users[j].append(i)
            cached = tuple(map(tuple, users))
            object.__setattr__(self, "_consumers", cached)
        return cached


def saved_set(problem: MemoryProblem, recompute: Iterable[int]) -> frozenset[int]:
    """Values kept from forward to backward when `recompute` are recomputed."""
    rec = frozenset(recompute)
    wanted = {i for i, need in enumerate(problem.needed) if need}
    for i in rec:
        wanted.update(problem.inputs[i])
    return frozenset(wanted - rec)


def violations(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> list[str]:
    """Why a decision cannot run (empty when it can)."""
    rec, off = frozenset(recompute), frozenset(offload)
    saved = saved_set(problem, rec)
    errors = [f"{problem.names[i]} cannot be recomputed" for i in sorted(rec) if not problem.can_recompute[i]]
    errors += [f"{problem.names[i]} cannot be saved" for i in sorted(saved) if not problem.can_save[i]]
    for i in sorted(off):
        if not problem.offloadable(i):
            errors.append(f"{problem.names[i]} cannot be offloaded")
        elif i not in saved:
            errors.append(f"{problem.names[i]} is offloaded but not saved")
        else:
            errors += [f"{problem.names[i]} is offloaded but {problem.names[j]} recomputes from it early"
                       for j in problem.offload_blockers[i] if j in rec]
    return errors


def is_valid(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> bool:
    return not violations(problem, recompute, offload)


def lifetimes(problem: MemoryProblem, recompute: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Inclusive [first, last] steps each saved or recomputed value occupies under a decision.

    A recomputed value is made at the first backward read of it or of a recomputed consumer;
    any value lives until its last direct read, the making of its recomputed consumers, and the
    end of recomputed views (and `inlined` readers) of it."""
    rec = frozenset(recompute)
    saved = saved_set(problem, rec)
    users, holds = problem.consumers(), [problem.holds_inputs(i) for i in range(problem.num_values)]
    need_first, need_last = problem.need_first, problem.need_last
    made: dict[int, int] = {}
    ends: dict[int, int] = {}
    for v in sorted(saved | rec, reverse=True):
        first, last = need_first[v], need_last[v]
        for w in users[v]:
            when = made.get(w)
            if when is None:
                continue
            if first == NEVER or when < first:
                first = when
            reach = ends[w] if holds[w] else when
            if reach > last:
                last = reach
        if v in rec:
            if first == NEVER:
                continue  # nothing reads it: it is never actually recomputed
            made[v] = first
        ends[v] = last
    spans = {v: (problem.saved_from[v], ends[v]) for v in saved if v in ends}
    spans.update({v: (made[v], max(made[v], ends[v])) for v in made})
    return spans


def memory_profile(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> list[int]:
    """Live bytes at every step under a decision (difference array over lifetimes); an offloaded
    value is off the device between its copy out and its copy back (`transfer_schedule`)."""
    rec = frozenset(recompute)
    return profile_of(problem, lifetimes(problem, rec), held_sizes(problem, rec), offload)


def held_sizes(problem: MemoryProblem, recompute: frozenset[int]) -> list[int]:
    """Bytes each value holds while alive under a decision: `size`, none for an `inlined` recomputed one."""
    return [problem.recomputed_size(v) if v in recompute else problem.size[v] for v in range(problem.num_values)]


def profile_of(problem: MemoryProblem, spans: dict[int, tuple[int, int]], size, offload: Iterable[int] = ()
               ) -> list[int]:
    """Live bytes at every step: `base` plus `size[v]` over each of `spans`, less offloaded values
    while they are on the host."""
    delta = [0] * (problem.num_steps + 1)
    for v, (first, last) in spans.items():
        if size[v] and first <= last:
            delta[first] += size[v]
            delta[last + 1] -= size[v]
    off = [v for v in offload if v in spans and problem.size[v]]
    if off:
        moves = transfer_schedule(problem, off)
        for v in off:
            first, last = spans[v]
            gone, back = max(first, moves.out_last[v] + 1), min(last, moves.in_first[v] - 1)
            if gone <= back:
                delta[gone] -= problem.size[v]
                delta[back + 1] += problem.size[v]
    return [b + d for b, d in zip(problem.base, accumulate(delta))]


def peak_bytes(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> int:
    profile = memory_profile(problem, recompute, offload)
    return max(profile) if profile else 0


def recompute_cost(problem: MemoryProblem, recompute: Iterable[int]) -> int:
    return sum(problem.cost[i] for i in set(recompute))


def offload_cost(problem: MemoryProblem, offload: Iterable[int]) -> int:
    """Time offloading adds to the step: exposed transfer time plus the copies' launch cost (ns)."""
    off = frozenset(offload)
    if not off:
        return 0
    return transfer_schedule(problem, off).exposed_ns + problem.offload_overhead_ns * len(off)


def decision_cost(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> int:
    """The objective: recompute time plus time offloading adds (ns)."""
    return recompute_cost(problem, recompute) + offload_cost(problem, offload)


def is_feasible(problem: MemoryProblem, recompute: Iterable[int], offload: Iterable[int] = ()) -> bool:
    rec = frozenset(recompute)
    return is_valid(problem, rec, offload) and peak_bytes(problem, rec, offload) <= problem.budget


@dataclass(frozen=True)
class Transfers:
    """When offloaded values leave and re-enter device memory, per candidate index.

    out_last[v]: last step its device copy is alive in forward (its copy out ends in this step);
    in_first[v]: first step its device copy is alive again (its copy back starts in this step);
    exposed_ns: time the step waits on the link (a copy back that would have to start before
    the copy out ends delays backward by the difference; the largest such delay)."""

    out_last: dict[int, int]
    in_first: dict[int, int]
    exposed_ns: int


def transfer_schedule(problem: MemoryProblem, offload: Iterable[int]) -> Transfers:
    """Copies on two streams, one per direction, with compute times `step_ns`.

    Out (device to host): each copy is issued when the value's last forward use ends (the start
    of step `saved_from`) and the stream runs them first-in first-out, so simultaneous copies
    share the link by queueing. Back (host to device): each copy must end when step
    `offload_ready` starts; they are placed as late as possible, last deadline first, each
    ending before the next one starts. Sound for memory: a device copy counts from the start of
    the step in which its copy back begins until the end of the step in which its copy out ends.
    """
    off = sorted(frozenset(offload), key=lambda v: (problem.saved_from[v], v))
    starts = [0, *accumulate(problem.step_ns)]  # starts[t]: time step t begins; starts[-1]: the end
    last_step, size = problem.num_steps - 1, problem.transfer_ns
    ends = copies_out([starts[min(problem.saved_from[v], problem.num_steps)] for v in off], [size[v] for v in off])
    out_end = dict(zip(off, ends))
    out_last = {v: max(problem.saved_from[v] - 1, min(last_step, bisect_left(starts, out_end[v]) - 1)) for v in off}
    begins = copies_in([starts[problem.offload_ready[v]] for v in off], [size[v] for v in off])
    in_first, stall = {}, 0
    for v, begin in zip(off, begins):
        in_first[v] = max(0, bisect_right(starts, begin) - 1)
        stall = max(stall, out_end[v] - begin)
        if in_first[v] <= out_last[v]:  # no gap: the value never leaves the device
            in_first[v] = out_last[v] + 1
    return Transfers(out_last, in_first, max(0, stall))


def copies_out(issued: list[float], durations: list[float]) -> list[float]:
    """End times of copies on one first-in first-out stream, each issued at `issued[i]`."""
    ends, free_at = [0.0] * len(issued), float("-inf")
    for i in sorted(range(len(issued)), key=lambda i: (issued[i], i)):
        free_at = ends[i] = max(issued[i], free_at) + durations[i]
    return ends


def copies_in(deadlines: list[float], durations: list[float]) -> list[float]:
    """Latest start times of copies on one stream, each ending by `deadlines[i]` and before the
    next one starts (placed last deadline first)."""
    begins, next_begin = [0.0] * len(deadlines), float("inf")
    for i in sorted(range(len(deadlines)), key=lambda i: (deadlines[i], i), reverse=True):
        next_begin = begins[i] = min(deadlines[i], next_begin) - durations[i]
    return begins


def enable_offload(problem: MemoryProblem, step_ns: Iterable[int], transfer_ns: Iterable[int],
                   min_bytes: int = 1 << 20, overhead_ns: int = 0) -> MemoryProblem:
    """`problem` with offloading allowed for saveable values of at least `min_bytes` whose copies,
    each alone on the link, hide behind compute and free memory for at least one step.

    A value may be offloaded when backward reads it, or a view of it, directly; while it is
    offloaded, nothing that is not a view of it may be recomputed from it (its copy back is
    timed for the first direct read)."""
    p = replace(problem, step_ns=tuple(int(t) for t in step_ns), transfer_ns=tuple(int(t) for t in transfer_ns),
                can_offload=(False,) * problem.num_values, offload_ready=(NEVER,) * problem.num_values,
                offload_blockers=((),) * problem.num_values, offload_overhead_ns=int(overhead_ns))
    users = p.consumers()
    can, ready, blockers = [], [], []
    for v in range(p.num_values):
        group, stack = [v], [v]
        while stack:  # v and the views of it, recursively
            x = stack.pop()
            for w in users[x]:
                if p.aliases[w] and w not in group:
                    group.append(w)
                    stack.append(w)
        reads = [p.need_first[x] for x in group if p.needed[x]]
        ready.append(min(reads) if reads else NEVER)
        blockers.append(tuple(sorted({w for x in group for w in users[x] if not p.aliases[w]})))
        can.append(bool(reads) and p.can_save[v] and p.size[v] >= max(1, min_bytes))
    p = replace(p, can_offload=tuple(can), offload_ready=tuple(ready), offload_blockers=tuple(blockers))
    for v in range(p.num_values):
        if can[v]:
            alone = transfer_schedule(p, [v])
            can[v] = alone.exposed_ns == 0 and alone.in_first[v] > alone.out_last[v] + 1
    return replace(p, can_offload=tuple(can))


def eager_decision(problem: MemoryProblem) -> frozenset[int]:
    """Recompute only what cannot be saved (views, parts of multi-output ops), as eager autograd
    effectively does: the least recomputation that is valid."""
    return repair(problem, ())


def repair(problem: MemoryProblem, recompute: Iterable[int]) -> frozenset[int]:
    """`recompute` plus what must then be recomputed because it cannot be saved: walks the inputs
    of every value that would be saved until saveable values."""
    rec: set[int] = set(recompute)
    stack = [i for i in saved_set(problem, rec) if not problem.can_save[i]]
    while stack:
        i = stack.pop()
        if i in rec:
            continue
        rec.add(i)
        stack.extend(j for j in problem.inputs[i] if not problem.can_save[j] and j not in rec)
    return frozenset(rec)
