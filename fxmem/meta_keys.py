"""The keys fxmem writes into torch.fx metadata, named once: every fxmem tag of a node or a graph lives
under `meta["fxmem"]`, as torch's own keys (`meta["val"]`, `meta["recompute"]`) live beside it.

On a node: `capture` (the tracer), `cost` (`fxmem.price.cost.NodeCost`), `host` (an offloaded copy),
`unit` (its cut unit), `device` (its region's device), `pool` (its arena offset), `decision` and
`offload` (an offloaded value and its copies), `rng` (a replayed random op's role), `attention_chunks`
and `loss_chunks` (the nodes a chunking pass wrote). On a graph module:
`capture`, `input_names` (the traced inputs' names), `param_names` (a stage's parameters), `pool` (its
`PoolStats`). Reads and writes nothing else.
"""
from __future__ import annotations

from typing import Any

NAMESPACE = "fxmem"
CAPTURE, COST, HOST, UNIT, DEVICE, POOL = "capture", "cost", "host", "unit", "device", "pool"
DECISION, OFFLOAD, RNG = "decision", "offload", "rng"
ATTENTION_CHUNKS, LOSS_CHUNKS = "attention_chunks", "loss_chunks"
INPUT_NAMES, PARAM_NAMES = "input_names", "param_names"


def tags(owner: Any) -> dict:
    """The fxmem tags of a node or graph module, to write into (made on first use)."""
    return owner.meta.setdefault(NAMESPACE, {})


def tag(owner: Any, key: str, default: Any = None) -> Any:
    """One fxmem tag of a node or graph module, or `default` where it has none."""
    return owner.meta.get(NAMESPACE, {}).get(key, default)


def has_tag(owner: Any, key: str) -> bool:
    return key in owner.meta.get(NAMESPACE, {})
