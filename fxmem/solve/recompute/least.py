"""The least peak of a keep-or-recompute problem: the best decision found, its lower bound, and
whether it is proven least.

Reads a `MemoryProblem`; returns a `LeastPeak`. Torch-free. Every search runs within the limit, converted
once into counted effort (`fxmem.solve.effort`) that they share, so the least found is the same on every
run, on an idle or a loaded machine; the best is kept: the greedy descent (fast, local), every repeated
layer checkpointed (`checkpoint`), the greedy descent from there (it recomputes what checkpointing keeps
between layers where that lowers the peak), and one option spread over repeated layers (`layered`), where
the graph has them, then CP-SAT seeded with the best so far, in its
deterministic mode (the same decision every run: decisions of equal peak can simulate differently),
first within an eighth of its limit where its workers interleave (a proof there ends it), and on graphs
of up to `EXACT_CANDIDATES` candidates where CP-SAT proved nothing, the exact time-indexed program, to
prove it. The answer is proven when CP-SAT or the exact program proves it or when it meets
`peak_lower_bound`.

Writes nothing but a per-process memo of the answers: the least peak ignores the budget, and a
planner asks for the same problem's least at every budget below what its solvers fit (and a refusal
names it before the caller plans at it); an answer is given again for a time limit no longer than
the one it was searched with, or whatever the limit once it is proven.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fxmem.solve.effort import Effort
from fxmem.solve.problem import MemoryProblem, is_valid, peak_bytes, recompute_cost
from fxmem.solve.recompute.bound import peak_lower_bound
from fxmem.solve.recompute.checkpoint import checkpoint_layers
from fxmem.solve.recompute.cpsat import INTERLEAVED_UP_TO, cpsat_min_peak
from fxmem.solve.recompute.exact import exact_min_peak
from fxmem.solve.recompute.greedy import greedy_min_peak
from fxmem.solve.recompute.layered import layered_min_peak
from fxmem.solve.recompute.layers import find_layers

EXACT_CANDIDATES = 200
FIRST_TRY = 1 / 8  # of CP-SAT's limit, tried first: a proof within it ends CP-SAT's search
GREEDY_MIN_S = 1.0  # the greedy descent gets this long however short the limit: it stops at its local minimum
MEMO_SIZE = 64
_FOUND: dict[MemoryProblem, tuple[float, "LeastPeak"]] = {}  # problem (budget 0) -> (time limit, answer)


@dataclass(frozen=True)
class LeastPeak:
    """`peak` bytes reached by `recompute`; no decision is below `lower_bound`; `proven` when
    `peak` is the least there is. `method` names the search that found it."""

    peak: int
    recompute: frozenset[int]
    lower_bound: int
    proven: bool
    method: str

    @property
    def gap(self) -> float:
        """How far the peak may be above the least, as a fraction of the lower bound."""
        return 0.0 if self.proven else (self.peak - self.lower_bound) / max(1, self.lower_bound)


def least_peak(problem: MemoryProblem, time_limit_s: float = 10.0) -> LeastPeak:
    """The least peak found within about `time_limit_s` seconds, or `GREEDY_MIN_S` if that is longer
    (see the module docstring); the answer found before in this process for this problem, whatever
    its budget, when that search had at least as long or proved its answer.
    Raises ValueError when no decision is valid at all."""
    key = replace(problem, budget=0)
    known = _FOUND.get(key)
    if known is not None and (known[1].proven or known[0] >= time_limit_s):
        return known[1]
    found = _search(problem, time_limit_s)
    if len(_FOUND) >= MEMO_SIZE and key not in _FOUND:
        _FOUND.pop(next(iter(_FOUND)))
    _FOUND[key] = (time_limit_s, found)
    return found


def _search(problem: MemoryProblem, time_limit_s: float) -> LeastPeak:
    effort = Effort.of(time_limit_s)
    bound = peak_lower_bound(problem)
    found: list[tuple[int, int, str, frozenset[int]]] = []

    def offer(rec: frozenset[int] | None, method: str) -> None:
        if rec is not None and is_valid(problem, rec):
            found.append((peak_bytes(problem, rec), recompute_cost(problem, rec), method, frozenset(rec)))

    offer(greedy_min_peak(problem, effort.child(max(GREEDY_MIN_S, time_limit_s / 4))), "greedy")
    layers = find_layers(problem)
    if layers is not None:
        checkpointed = checkpoint_layers(problem, layers)
        offer(checkpointed, "checkpoint every layer")
        # what checkpointing keeps between layers, recomputed where that lowers the peak
        offer(greedy_min_peak(problem, effort.part(1 / 4, least_s=0.01), start=checkpointed), "checkpoint, then greedy")
        if problem.num_values > EXACT_CANDIDATES:
            layered = layered_min_peak(problem, effort.part(1 / 2, least_s=0.01), layers)
            offer(layered[1] if layered else None, "layered")
    proved_peak = None  # CP-SAT's or the exact program's peak, when it proved it least
    if not found or min(found)[0] > bound:
        # CP-SAT in deterministic mode chooses among decisions of equal peak the same way every run
        # (the simulated step can differ between them); the exact program then only proves what it did not
        hint = min(found)[3] if found else None
        cpsat = _cpsat(problem, effort.part(1 / 2 if problem.num_values <= EXACT_CANDIDATES else 1, least_s=0.01),
                       effort, hint)
        offer(cpsat[1] if cpsat else None, "cpsat")
        proved_peak = cpsat[0] if cpsat and cpsat[2] else None
        if problem.num_values <= EXACT_CANDIDATES and proved_peak is None and (not found or min(found)[0] > bound):
            exact = exact_min_peak(problem, effort.part(least_s=0.01))
            if exact is not None:
                proved_peak = exact[0] if exact[2] else None
                if not found or exact[0] < min(found)[0]:
                    offer(exact[1], "exact")
    if not found:
        raise ValueError("no valid decision: some value can be neither saved nor recomputed")
    peak, _, method, rec = min(found)
    proven = peak == proved_peak or peak <= bound
    return LeastPeak(peak=peak, recompute=rec, lower_bound=min(bound, peak), proven=proven, method=method)


def _cpsat(problem: MemoryProblem, limit: Effort, effort: Effort,
           hint: frozenset[int] | None) -> tuple[int, frozenset[int], bool] | None:
    """CP-SAT's least within `limit` (a part of `effort`), tried first within `FIRST_TRY` of it where its workers
    interleave: in that deterministic mode CP-SAT runs each batch of work to the limit even after proving its
    answer (a block of a Llama-3-8B rank: proven least within 0.6 s of effort, then 17 s more at 5 s), so a
    proof found early ends the search there (one worker, on larger problems, stops at its proof). Where the
    first try proves nothing, CP-SAT runs again within the whole `limit`, as it did alone, and `effort` is
    charged both."""
    if problem.num_values > INTERLEAVED_UP_TO:
        return cpsat_min_peak(problem, limit, hint=hint)
    first = Effort(limit.limit * FIRST_TRY)  # not a part of `limit`: the whole run gets what it would alone
    found = cpsat_min_peak(problem, first, hint=hint)
    if found is None or not found[2]:
        found = cpsat_min_peak(problem, limit, hint=hint)
    effort.spend(first.spent)
    return found
