"""A module that is the user's model under another forward: it shares the model's parameters,
buffers and submodules (`state_dict` keys unchanged; training either trains both), and reads through
to the model whatever it does not have itself (`config`, `generation_config`, `can_generate`,
`main_input_name`, `save_pretrained`, ...: what transformers' `Trainer` and Accelerate read on the
model they train). `presented` makes a wrapper show the model's forward signature and class where
frameworks look for them: `Trainer` keeps the dataset columns `inspect.signature(model.forward)` names,
finds the label names on `model.__class__.forward`, and saves a `PreTrainedModel` with `save_pretrained`.

Reads the model it wraps; writes nothing of its own but `fxmem_model` and the attributes a
subclass adds with `object.__setattr__` (kept out of `_modules`)."""
from __future__ import annotations

import inspect
import types
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

    def caller_signature(self) -> inspect.Signature | None:
        """The forward signature callers of this wrapper see: the model's (None where Python cannot read it)."""
        return forward_signature(self.fxmem_model)


def forward_signature(module: torch.nn.Module) -> inspect.Signature | None:
    """`module`'s forward signature as its callers see it (a wrapper's: `ModelWrapper.caller_signature`)."""
    if isinstance(module, ModelWrapper):
        return module.caller_signature()
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def user_model(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model under fxmem's wrappers."""
    while isinstance(module, ModelWrapper):
        module = module.fxmem_model
    return module


def presented(wrapper: ModelWrapper) -> ModelWrapper:
    """`wrapper`, made an instance of a subclass of its class (named after the user's model) that frameworks
    read as the model: its forward, the same function, shows `caller_signature()` to
    `inspect.signature(wrapper.forward)`, and on the class with `self` (transformers' `find_labels`).
    A model that saves itself (`save_pretrained`: transformers', diffusers') is saved as what its class says:
    transformers' `Trainer` saves a `PreTrainedModel` with `save_pretrained`, anything else with safetensors,
    which refuses tied weights. So where the wrapper's forward returns what such a model's does (no
    `loss_fn`), it reports the model's class as its `__class__`, as a transparent proxy does:
    `isinstance(wrapper, type(model))` holds (other models keep the wrapper's class, so that a framework
    that drives a model through methods other than forward, as Lightning does a LightningModule's, does not
    take the wrapper for it and run the model's methods unplanned). `type(wrapper)` is still the wrapper's
    class, and so is its repr. The forward runs the same code object: no frame is added to tracebacks,
    `public`'s error handling kept."""
    signature = wrapper.caller_signature()
    cls, model = type(wrapper), user_model(wrapper)
    own = cls.forward
    if signature is None or not isinstance(own, types.FunctionType) or "self" in signature.parameters:
        return wrapper  # a forward Python cannot show (or not with `self` in front): the wrapper's own
    shown = types.FunctionType(own.__code__, own.__globals__, own.__name__, own.__defaults__, own.__closure__)
    shown.__dict__.update({k: v for k, v in own.__dict__.items() if k != "__wrapped__"})  # unwrapped: itself
    shown.__kwdefaults__, shown.__doc__ = own.__kwdefaults__, own.__doc__
    shown.__module__, shown.__qualname__ = own.__module__, own.__qualname__
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    shown.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])  # type: ignore
    members: dict[str, Any] = {"forward": shown, "__module__": cls.__module__,
                               "__qualname__": f"{cls.__qualname__}[{type(model).__qualname__}]"}
    if signature == forward_signature(model) and callable(getattr(model, "save_pretrained", None)):
        members["__class__"] = property(lambda self: type(user_model(self)), _set_class)
        members["_get_name"] = lambda self: type(self).__name__  # the repr names the wrapper
    _set_class(wrapper, type(f"{cls.__name__}[{type(model).__name__}]", (cls,), members))
    return wrapper


def _set_class(obj: object, cls: type) -> None:
    object.__dict__["__class__"].__set__(obj, cls)  # the slot itself, under a `__class__` property
