"""Small readable model zoo: named presets of GPT, ResNet, U-Net and MLP models.

Each preset has a default batch size, and `example_inputs` includes targets, so
`model(*example_inputs(name))` is one training step's scalar loss. The preset names and batch
sizes below load without torch (`fxmem-plan --list-models` answers at once); a family's module
(`gpt.py`, ...: its config dataclass, presets and model) is imported when one of its presets is built.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

DEFAULT_MODEL = "gpt-small"

# preset -> (family module, default batch size); the family module holds the preset's config
PRESETS: dict[str, tuple[str, int]] = {
    "gpt-tiny": ("gpt", 8), "gpt-small": ("gpt", 64), "gpt2": ("gpt", 12),
    "resnet-tiny": ("resnet", 8), "resnet18": ("resnet", 64),
    "unet-tiny": ("unet", 4), "unet-small": ("unet", 32),
    "mlp-tiny": ("mlp", 16), "mlp-small": ("mlp", 128),
}
FAMILIES = {"gpt": "GPT", "resnet": "ResNet", "unet": "UNet", "mlp": "MLP"}  # module -> model class


def __getattr__(name: str) -> ModuleType:
    if name in FAMILIES:  # `models.gpt` without importing it first
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def list_models() -> list[str]:
    return list(PRESETS)


def _family(name: str) -> ModuleType:
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; presets are: {', '.join(PRESETS)}")
    return importlib.import_module(f"{__name__}.{PRESETS[name][0]}")


def preset_config(name: str, **config_overrides: Any) -> Any:
    """The preset's frozen config dataclass, with `config_overrides` replacing fields."""
    return dataclasses.replace(_family(name).presets[name], **config_overrides)


def from_name(name: str, **config_overrides: Any) -> Any:
    """A freshly initialised model (an `nn.Module`) of preset `name`; parameters come from torch's global RNG."""
    module = _family(name)
    return getattr(module, FAMILIES[PRESETS[name][0]])(preset_config(name, **config_overrides))


def default_batch_size(name: str) -> int:
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; presets are: {', '.join(PRESETS)}")
    return PRESETS[name][1]


def example_inputs(name: str, batch_size: int | None = None, *, seed: int = 0, device: Any = "cpu",
                   **config_overrides: Any) -> tuple:
    """Random inputs then targets for preset `name`, reproducible from `seed`.

    Pass the `config_overrides` given to `from_name` when they change input shapes.
    """
    import torch  # the zoo's names and batch sizes load without torch; inputs need it

    module = _family(name)
    generator = torch.Generator().manual_seed(seed)
    if batch_size is None:
        batch_size = default_batch_size(name)
    inputs = module.example_inputs(preset_config(name, **config_overrides), batch_size, generator)
    return tuple(x.to(device) for x in inputs)
