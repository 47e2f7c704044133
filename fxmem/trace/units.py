"""Cut units: the modules a model may be split between, for pipeline stages and device placement.

Reads a model's module tree; writes nothing. A unit is the outermost module on a path that is not
*opened*. Containers (`ModuleList`, `Sequential`, `ModuleDict`) are opened, and so is a module that
directly holds a container of several modules: the wrapper around a layer list, such as a transformers
`LlamaModel` (`model.layers`) or `GPT2Model` (`transformer.h`). So a `LlamaForCausalLM` is cut into
`model.embed_tokens`, `model.layers.0` … `model.layers.N`, `model.norm` and `lm_head`, not into its
two children `model` and `lm_head`. Ops that run in an opened module's own forward belong to it.
"""
from __future__ import annotations

import torch

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def is_opened(module: torch.nn.Module) -> bool:
    """A container, or a module holding a container of two or more modules (a layer list)."""
    if isinstance(module, CONTAINERS):
        return True
    return any(isinstance(child, CONTAINERS) and len(child) > 1 for child in module.children())


def unit_path(model: torch.nn.Module, path: str) -> str:
    """The unit a module path belongs to ("model.layers.3" for "model.layers.3.self_attn.q_proj");
    "" for the root. A path that leaves the module tree ends its unit where it leaves."""
    parts = [p for p in path.split(".") if p]
    module = model
    for k, part in enumerate(parts):
        module = getattr(module, part, None) if isinstance(module, torch.nn.Module) else None
        if not isinstance(module, torch.nn.Module) or not is_opened(module):
            return ".".join(parts[:k + 1])
    return ".".join(parts)
