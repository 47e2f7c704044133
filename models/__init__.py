"""Small readable model zoo: named presets of GPT, ResNet, U-Net and MLP models.

Each preset has a default batch size, and `example_inputs` includes targets, so
`model(*example_inputs(name))` is one training step's scalar loss.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
import torch.nn as nn

from . import gpt, mlp, resnet, unet

DEFAULT_MODEL = "gpt-small"

_FAMILIES: tuple[tuple[ModuleType, type[nn.Module]], ...] = (
    (gpt, gpt.GPT),
    (resnet, resnet.ResNet),
    (unet, unet.UNet),
    (mlp, mlp.MLP),
)
_REGISTRY: dict[str, tuple[ModuleType, type[nn.Module]]] = {
    name: family for family in _FAMILIES for name in family[0].presets
}


def list_models() -> list[str]:
    return list(_REGISTRY)


def _lookup(name: str) -> tuple[ModuleType, type[nn.Module]]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; presets are: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def preset_config(name: str, **config_overrides):
    """The preset's frozen config dataclass, with `config_overrides` replacing fields."""
    module, _ = _lookup(name)
    return dataclasses.replace(module.presets[name], **config_overrides)


def from_name(name: str, **config_overrides) -> nn.Module:
    """A freshly initialised model of preset `name`; parameters come from torch's global RNG."""
    _, model_class = _lookup(name)
    return model_class(preset_config(name, **config_overrides))


def default_batch_size(name: str) -> int:
    module, _ = _lookup(name)
    return module.batch_sizes[name]


def example_inputs(
    name: str, batch_size: int | None = None, *, seed: int = 0, device="cpu", **config_overrides
) -> tuple:
    """Random inputs then targets for preset `name`, reproducible from `seed`.

    Pass the `config_overrides` given to `from_name` when they change input shapes.
    """
    module, _ = _lookup(name)
    generator = torch.Generator().manual_seed(seed)
    if batch_size is None:
        batch_size = default_batch_size(name)
    inputs = module.example_inputs(preset_config(name, **config_overrides), batch_size, generator)
    return tuple(x.to(device) for x in inputs)
