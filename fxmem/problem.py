"""The keep-or-recompute problem as plain integers: no torch, no fx.

Reads nothing and writes nothing: `MemoryProblem` is built by `fxmem.schedule` from a joint
forward/backward graph and read by the solvers in `fxmem.solve`.

A decision is the set R of candidate values recomputed in backward. Everything else follows
from R: a value is *saved* (kept from forward to backward) when backward reads it directly, or
a recomputed value reads it, and it is not itself recomputed. Backward recomputes a value just
before its first use, as the autograd engine orders it, so *when* a value is recomputed, and how
long a saved value must stay, depend on R too; `lifetimes` works that out.
"""
from __future__ import annotations

from dataclasses import dataclass
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
      saved_from[i]     first step at which keeping it costs `size` (after its last forward use)
      need_first[i]     first backward step that reads it directly (NEVER when none)
      need_last[i]      last backward step that reads it, or a backward view of it (NEVER when none)
    base[t]: bytes live at step t whatever is decided (parameters, gradients, transients).
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

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("size", "cost", "inputs", "aliases", "needed", "can_save", "can_recompute",
                      "saved_from", "need_first", "need_last"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"MemoryProblem.{field} has {len(getattr(self, field))} entries, expected {n}")
        for i, ins in enumerate(self.inputs):
            if any(not 0 <= j < i for j in ins):
                raise ValueError(f"MemoryProblem.inputs[{i}] must name earlier candidates, got {ins}")
            if self.needed[i] != (self.need_first[i] != NEVER):
                raise ValueError(f"MemoryProblem candidate {i}: needed and need_first disagree")

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


def violations(problem: MemoryProblem, recompute: Iterable[int]) -> list[str]:
    """Why a decision cannot run (empty when it can)."""
    rec = frozenset(recompute)
    errors = [f"{problem.names[i]} cannot be recomputed" for i in sorted(rec) if not problem.can_recompute[i]]
    errors += [f"{problem.names[i]} cannot be saved" for i in sorted(saved_set(problem, rec))
               if not problem.can_save[i]]
    return errors


def is_valid(problem: MemoryProblem, recompute: Iterable[int]) -> bool:
    return not violations(problem, recompute)


def lifetimes(problem: MemoryProblem, recompute: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Inclusive [first, last] steps each saved or recomputed value occupies under a decision.

    A recomputed value is made at the first backward read of it or of a recomputed consumer;
    any value lives until its last direct read, the making of its recomputed consumers, and the
    end of recomputed views of it."""
    rec = frozenset(recompute)
    saved = saved_set(problem, rec)
    users, aliases = problem.consumers(), problem.aliases
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
            reach = ends[w] if aliases[w] else when
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


def memory_profile(problem: MemoryProblem, recompute: Iterable[int]) -> list[int]:
    """Live bytes at every step under a decision (difference array over lifetimes)."""
    delta = [0] * (problem.num_steps + 1)
    for v, (first, last) in lifetimes(problem, recompute).items():
        if problem.size[v] and first <= last:
            delta[first] += problem.size[v]
            delta[last + 1] -= problem.size[v]
    return [b + d for b, d in zip(problem.base, accumulate(delta))]


def peak_bytes(problem: MemoryProblem, recompute: Iterable[int]) -> int:
    profile = memory_profile(problem, recompute)
    return max(profile) if profile else 0


def recompute_cost(problem: MemoryProblem, recompute: Iterable[int]) -> int:
    return sum(problem.cost[i] for i in set(recompute))


def is_feasible(problem: MemoryProblem, recompute: Iterable[int]) -> bool:
    rec = frozenset(recompute)
    return is_valid(problem, rec) and peak_bytes(problem, rec) <= problem.budget


def eager_decision(problem: MemoryProblem) -> frozenset[int]:
    """Recompute only what cannot be saved (views, parts of multi-output ops), as eager autograd
    effectively does: the least recomputation that is valid. Walks inputs until saveable values."""
    rec: set[int] = set()
    stack = [i for i in saved_set(problem, rec) if not problem.can_save[i]]
    while stack:
        i = stack.pop()
        if i in rec:
            continue
        rec.add(i)
        stack.extend(j for j in problem.inputs[i] if not problem.can_save[j] and j not in rec)
    return frozenset(rec)
