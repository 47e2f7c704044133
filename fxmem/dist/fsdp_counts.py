"""The byte counts of a simulated FSDP2 rank that its parts are made from (`fxmem.dist.fsdp_memory.rank_parts`).

Reads a sharded model (its parameters' local shards and full sizes), the step's inputs and the optimizer's kind;
writes nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fxmem.price.optimizer_state import bytes_per_param_byte


def keyword_input_bytes(inputs: Sequence[Any], kwargs: dict | None) -> int:
    """Tensors given by keyword (`input_ids=`, `labels=`): resident through the step like positional inputs,
    which the meter counts; counted once each."""
    seen = {id(x) for x in inputs}
    tensors = {id(x): x for x in torch.utils._pytree.tree_leaves(kwargs or {})
               if isinstance(x, torch.Tensor) and id(x) not in seen}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def counter_bytes(optimizer: Any, model: torch.nn.Module) -> int:
    """torch.optim's step counters: a float32 scalar per trainable parameter (SGD and L-BFGS keep none)."""
    if optimizer is None or not bytes_per_param_byte(optimizer):
        return 0
    kind = optimizer.lower() if isinstance(optimizer, str) else type(optimizer).__name__.lower()
    return 0 if kind.startswith("sgd") or isinstance(optimizer, (int, float)) else \
        4 * sum(p.requires_grad for p in model.parameters())


def sharded_bytes(model: torch.nn.Module) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def unit_bytes(model: torch.nn.Module, blocks: str) -> tuple[int, list[int]]:
    """Unsharded parameter bytes of the root unit and of each block unit."""
    units = model.get_submodule(blocks)
    full = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in units]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - sum(full), full
