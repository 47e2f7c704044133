"""A module that is the user's model under another forward: it shares the model's parameters,
buffers and submodules (`state_dict` keys unchanged; training either trains both), and reads through
to the model whatever it does not have itself (`config`, `generation_config`, `can_generate`,
`main_input_name`, `save_pretrained`, ...: what transformers' `Trainer` and Accelerate read on the
model they train).

Reads the model it wraps; writes nothing of its own but `fxmem_model` and the attributes a
subclass adds with `object.__setattr__` (kept out of `_modules`)."""
from __future__ import annotations

from typing import Any

import torch


class ModelWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, **attributes: Any):
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "fxmem_model", model)
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def train(self, mode: bool = True) -> "ModelWrapper":
        self.fxmem_model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        # called only where the wrapper has no such attribute, parameter, buffer or submodule: the model's
        # (bound methods stay bound to the model: `save_pretrained` saves it, under its own keys)
        model = self.__dict__.get("fxmem_model")
        if model is not None and not name.startswith(("fxmem_", "__")):
            try:
                return getattr(model, name)
            except AttributeError:
                pass
        return super().__getattr__(name)  # nn.Module's lookup, and its error naming this module
