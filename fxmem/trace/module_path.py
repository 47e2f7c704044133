"""Module paths of a captured graph's nodes: the dotted path (`layers.0.attn`) of the module whose forward
made each node, read from torch's `meta["nn_module_stack"]`. Writes nothing.
"""
from __future__ import annotations

import torch


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost module `node` was traced in ("" outside every module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return clean_path(path)


def clean_path(path: str) -> str:
    """A module path as torch records it, in dotted form: export writes paths like "L['self'].layers[0]"
    in some modes."""
    path = path.replace("L['self'].", "").replace("L['self']", "")
    for ch in "[]'\"":
        path = path.replace(ch, "." if ch == "[" else "")
    return ".".join(p for p in path.split(".") if p and p != "_modules")
