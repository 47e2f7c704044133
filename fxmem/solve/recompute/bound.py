"""A lower bound on the least peak of a keep-or-recompute problem, from the problem alone.

Reads a `MemoryProblem`; returns bytes. Torch-free. Whatever is decided, a value that backward
reads is on the device from its first backward read to its last one: saved values from before,
recomputed ones from their making, which is at or before the first read. With what is live at
every step anyway (`base`), the largest such sum over the steps is a peak no decision goes below.
A value Inductor would compute inside its readers (`MemoryProblem.fused`) may hold nothing: not counted.
"""
from __future__ import annotations

from fxmem.solve.problem import NEVER, MemoryProblem, eager_decision, is_valid


def peak_lower_bound(problem: MemoryProblem) -> int:
    """No valid recompute decision has a smaller peak (offload, which moves values off the device,
    is not covered)."""
    delta = [0] * (problem.num_steps + 1)
    for v in range(problem.num_values):
        if problem.need_first[v] != NEVER and problem.size[v] and not (problem.inlined(v) and problem.can_recompute[v]):
            delta[problem.need_first[v]] += problem.size[v]
            delta[problem.need_last[v] + 1] -= problem.size[v]
    best, live = 0, 0
    for t, base in enumerate(problem.base):
        live += delta[t]
        best = max(best, base + live)
    return best


def proven_over_budget(problem: MemoryProblem) -> bool:
    """No valid decision fits the budget, proven from the problem alone: the memory every decision
    holds (`base`) is over it, no decision is valid (eager's, the least recomputation, is not: every valid
    decision recomputes what it does), or, without offload, the peak's lower bound is over it."""
    if problem.base and max(problem.base) > problem.budget:
        return True
    if not is_valid(problem, eager_decision(problem)):
        return True
    return not any(problem.can_offload) and peak_lower_bound(problem) > problem.budget
