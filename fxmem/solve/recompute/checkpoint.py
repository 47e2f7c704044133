"""Activation checkpointing of every repeated layer, as a decision: what `torch.utils.checkpoint`
around each block does, written in the problem's terms.

Reads a `MemoryProblem` and its `Layers` (or, for `checkpoint_units`, the checkpointed unit of each
candidate, as `fxmem.planner.policies` finds them by module path); returns a recompute set. Torch-free. Within each layer,
every value no later layer reads is recomputed (if it can be); what a layer passes on is kept;
`repair` adds what cannot be saved. `least` offers it beside its searches: at real model size the
searches alone stop far above it (a GPT-2 of 124M shape with its loss: 2258 MiB found, 1739 MiB
with every layer checkpointed), and CP-SAT then starts from it.
"""
from __future__ import annotations

from typing import Sequence

from fxmem.solve.problem import MemoryProblem, repair
from fxmem.solve.recompute.layers import Layers


def checkpoint_layers(problem: MemoryProblem, layers: Layers) -> frozenset[int]:
    """Recompute every layer's values that do not leave the layer; keep the ones that do."""
    users = problem.consumers()
    recompute: set[int] = set()
    for k in range(layers.count):
        layer = layers.layer(k)
        recompute |= {i for i in layer if problem.can_recompute[i] and all(j < layer.stop for j in users[i])}
    return repair(problem, recompute)


def checkpoint_units(problem: MemoryProblem, unit_of: Sequence[int | None], escapes: Sequence[bool]
                     ) -> frozenset[int]:
    """What `torch.utils.checkpoint` around each unit does: recompute every value made inside a unit
    (`unit_of[i]` not None) that no forward op outside its unit reads (`escapes[i]` False); keep the rest.
    What cannot be saved is recomputed too (`repair`); what cannot be recomputed is kept."""
    recompute = {i for i in range(problem.num_values)
                 if unit_of[i] is not None and not escapes[i] and problem.can_recompute[i]}
    return repair(problem, recompute)
