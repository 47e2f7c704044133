"""The keep-or-recompute problem as plain integers: no torch, no fx.

Reads nothing and writes nothing: `MemoryProblem` is built by `fxmem.schedule` from a
joint forward/backward graph and read by the solvers in `fxmem.solve`.

A decision is the set R of candidate values recomputed in backward. Everything else
follows from R: a value is *saved* (kept from forward to backward) when backward reads
it directly, or a recomputed value reads it, and it is not itself recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable


@dataclass(frozen=True)
class MemoryProblem:
    """Candidates are forward values that backward may need; steps are the joint schedule.

    Per candidate i:
      names[i]          node name, for messages and plans
      size[i]           bytes its storage occupies while kept
      cost[i]           time to recompute it, integer nanoseconds
      inputs[i]         candidate indices it reads (always-available values omitted)
      needed[i]         backward reads it directly
      can_save[i]       False for views and multi-output ops (their parts are saved instead)
      can_recompute[i]  False for random and side-effecting ops
      save_span[i]      inclusive [first, last] steps it adds `size` when saved
      recompute_span[i] inclusive [first, last] steps it adds `size` when recomputed
    base[t]: bytes live at step t whatever is decided (parameters, gradients, transients).
    """

    names: tuple[str, ...]
    size: tuple[int, ...]
    cost: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    needed: tuple[bool, ...]
    can_save: tuple[bool, ...]
    can_recompute: tuple[bool, ...]
    save_span: tuple[tuple[int, int], ...]
    recompute_span: tuple[tuple[int, int], ...]
    base: tuple[int, ...]
    budget: int

    def __post_init__(self) -> None:
        n = len(self.names)
        for field in ("size", "cost", "inputs", "needed", "can_save", "can_recompute",
                      "save_span", "recompute_span"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"MemoryProblem.{field} has {len(getattr(self, field))} entries, expected {n}")
        for i, ins in enumerate(self.inputs):
            if any(not 0 <= j < n for j in ins):
                raise ValueError(f"MemoryProblem.inputs[{i}] names a candidate out of range: {ins}")

    @property
    def num_values(self) -> int:
        return len(self.names)

    @property
    def num_steps(self) -> int:
        return len(self.base)

    def consumers(self) -> list[list[int]]:
        """consumers()[j]: candidates whose inputs contain j."""
        users: list[list[int]] = [[] for _ in self.names]
        for i, ins in enumerate(self.inputs):
            for j in ins:
                users[j].append(i)
        return users


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


def memory_profile(problem: MemoryProblem, recompute: Iterable[int]) -> list[int]:
    """Live bytes at every step under a decision (difference array over spans)."""
    rec = frozenset(recompute)
    delta = [0] * (problem.num_steps + 1)

    def add(span: tuple[int, int], nbytes: int) -> None:
        first, last = span
        if nbytes and first <= last:
            delta[first] += nbytes
            delta[last + 1] -= nbytes

    for i in saved_set(problem, rec):
        add(problem.save_span[i], problem.size[i])
    for i in rec:
        add(problem.recompute_span[i], problem.size[i])
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
