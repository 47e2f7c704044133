"""Per-rank memory parts of an FSDP2 step: shards, gathered units, the rest. Torch-free.

Reads byte counts (the rank's parameter shards, the unsharded bytes of the root and of each block unit, the
step's metered peak) and writes nothing: the table rows of `fxmem.fsdp.FsdpPlan`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankParts:
    param_shards: int        # this rank's shard of every parameter (dim 0 split over the ranks)
    gradient_shards: int     # the same size: reduce-scatter leaves each rank its shard of every gradient
    optimizer_shards: int    # optimizer state, per shard (AdamW: two tensors per parameter, a step counter each)
    gathered_units: int      # unsharded parameters in flight at once: the root + blocks gathered together
    activations_and_buffers: int  # the step's peak less parameter shards and gathered units

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def in_flight_blocks(num_blocks: int, reshard_after_forward: bool) -> int:
    """Blocks whose parameters are unsharded at once in backward: the one running and the one FSDP2
    prefetches; all of them when they stay gathered after forward."""
    return num_blocks if not reshard_after_forward else min(2, num_blocks)


def rank_parts(param_shard_bytes: int, units: tuple[int, list[int]], world_size: int, state_per_param_byte: float,
               reshard_after_forward: bool, step_peak_bytes: int, counter_bytes: int = 0) -> RankParts:
    """The parts of one rank's step; `units` = (root unit's unsharded bytes, each block's unsharded bytes);
    `counter_bytes`: the optimizer's scalar state (step counters), on every rank whole."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    root, blocks = units
    flight = sorted(blocks, reverse=True)[:in_flight_blocks(len(blocks), reshard_after_forward)]
    gathered = root + sum(flight) if world_size > 1 else 0
    return RankParts(param_shards=param_shard_bytes, gradient_shards=param_shard_bytes,
                     optimizer_shards=int(state_per_param_byte * param_shard_bytes) + counter_bytes, gathered_units=gathered,
                     activations_and_buffers=max(0, step_peak_bytes - param_shard_bytes - gathered))
