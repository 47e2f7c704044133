"""A rank of many identical blocks simulated at a few depths and extrapolated to all of them.

Reads the model (its block list's classes, parameter and buffer shapes) and figures measured at a few depths;
writes nothing. `shallow(model, path, depth)` is a twin of the model whose block list holds its first `depth`
blocks (everything else shared), so a rank of 32 blocks is simulated on 2, 3 and 4 of them. Every part of a
rank grows by the same bytes per identical block (its parameter, gradient and optimizer shards, what it saves
for backward), while what is gathered at once (the root, the block running and the one prefetched) and one
block's own step stay the same, so each figure is a line in the depth: `extrapolate` takes the line through
the two shallowest depths where the third lies on it too, and refuses (None) where it does not.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fxmem.dist.fsdp_root import twin

DEPTHS = (2, 3, 4)  # 2: a block before the last (FSDP2 prefetches it in backward); 4 checks the line of 2 and 3


def shallow(model: torch.nn.Module, path: str, depth: int) -> torch.nn.Module:
    """A twin of `model` (same class, parameters, buffers and submodules) whose ModuleList at `path` holds its
    first `depth` blocks; the model's forward runs over the blocks the list holds (a transformers model iterates
    `layers[:num_hidden_layers]`, which is the shorter list)."""
    name, _, rest = path.partition(".")
    child = model.get_submodule(name)
    replaced = shallow(child, rest, depth) if rest else torch.nn.ModuleList(list(child)[:depth])
    return twin(model, {**model._modules, name: replaced})


_INDEX = ("idx", "index", "layer_id", "layer_number")  # attributes that number the blocks, not configure them


def identical_blocks(units: torch.nn.ModuleList) -> bool:
    """Every block of one class with the same parameters and buffers (names, shapes, dtypes, requires_grad)
    and, in it and its submodules, the same plain settings (str, bool, int, float or None attributes but the
    block's number: an attention type or sliding window set per layer makes blocks differ)."""
    def settings(block: torch.nn.Module) -> tuple:
        return tuple((name, type(m).__name__, key, value) for name, m in block.named_modules()
                     for key, value in sorted(vars(m).items()) if not key.startswith("_")
                     and (value is None or isinstance(value, (str, bool, int, float)))
                     and not any(word in key.lower() for word in _INDEX))

    def signature(block: torch.nn.Module) -> tuple:
        tensors = [*block.named_parameters(), *block.named_buffers()]
        return type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors), settings(block)
    first = signature(units[0])
    return all(signature(block) == first for block in units[1:])


def extrapolate(figures: Mapping[int, Mapping[str, int]], depth: int) -> dict[str, int] | None:
    """Each figure at `depth` blocks on the line through `DEPTHS[0]` and `DEPTHS[1]`; None unless every figure
    at `DEPTHS[2]` lies on that line (where given: without it, the line is assumed)."""
    a, b = figures[DEPTHS[0]], figures[DEPTHS[1]]
    step = {key: b[key] - a[key] for key in a}
    check = figures.get(DEPTHS[2])
    if check is not None and any(check[key] != b[key] + step[key] for key in a):
        return None
    return {key: a[key] + (depth - DEPTHS[0]) * step[key] for key in a}


def depths_for(units: Any) -> tuple[int, ...] | None:
    """The depths to simulate a rank of `units` at, or None: simulate it whole (few blocks, or not identical)."""
    return DEPTHS if len(units) > DEPTHS[-1] and identical_blocks(units) else None
