"""Optimizer state: the bytes an optimizer keeps across training steps.

Reads an optimizer instance (its state once it has stepped, else its class and options) or a name
("adamw", "sgd-momentum", ...) or a number of state bytes per parameter byte; writes nothing.
One table serves `fxmem.estimate`, pipeline stages and the CLI.
"""
from __future__ import annotations

from typing import Any, Iterable

# State tensors per parameter (each the parameter's size and dtype) a fresh optimizer creates at its
# first step, by lower-case class name; options add more (see `tensors_per_param`).
STATE_TENSORS: dict[str, int] = {
    "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2, "adagrad": 1, "rprop": 2,
    "asgd": 2, "sgd": 0, "rmsprop": 1, "adafactor": 2, "lbfgs": 0,
}
# Names a user may give instead of an optimizer (CLI --optimizer, pipeline optimizer=): name -> options.
NAMED: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("sgd", {}), "sgd-momentum": ("sgd", {"momentum": 0.9}), "adam": ("adam", {}), "adamw": ("adamw", {}),
    "adagrad": ("adagrad", {}), "rmsprop": ("rmsprop", {}),
}


def tensors_per_param(kind: str, options: dict[str, Any]) -> int:
    """State tensors per parameter of optimizer class `kind` (lower case) with param-group `options`."""
    if kind not in STATE_TENSORS:
        raise ValueError(f"fxmem does not know the state of optimizer {kind}; take one step first "
                         "(its existing state is counted) or leave the optimizer out")
    extra = 0
    if kind in ("adam", "adamw"):
        extra = bool(options.get("amsgrad"))
    elif kind == "sgd":
        extra = bool(options.get("momentum", 0))
    elif kind == "rmsprop":
        extra = bool(options.get("momentum", 0)) + bool(options.get("centered"))
    return STATE_TENSORS[kind] + extra


def kind_of(optimizer: Any) -> str:
    """The lower-case class name of an optimizer (of the one it wraps, for fxmem's HostOptimizer)."""
    return getattr(optimizer, "optimizer_class", type(optimizer)).__name__.lower()


def bytes_per_param_byte(optimizer: Any) -> float:
    """State bytes per parameter byte: from a name in `NAMED`, a number >= 0, an optimizer, or None (0)."""
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) and optimizer >= 0:
        return float(optimizer)
    if isinstance(optimizer, str) and optimizer.lower() in NAMED:
        kind, options = NAMED[optimizer.lower()]
        return float(tensors_per_param(kind, options))
    if hasattr(optimizer, "param_groups"):
        return float(tensors_per_param(kind_of(optimizer), optimizer.param_groups[0]))
    raise ValueError(f"optimizer must be one of {sorted(NAMED)}, an optimizer, or its state's bytes per "
                     f"parameter byte (a number >= 0), got {optimizer!r}")


def unique_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by several counts once)."""
    seen: dict[Any, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr()) if storage.data_ptr() else id(storage)] = storage.nbytes()
    return sum(seen.values())


def state_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's state: counted from its state when it has taken a step, else inferred
    from its class and options (Adam/AdamW 2 tensors per parameter, SGD with momentum 1, ...), as
    torch.optim allocates them. Scalar step counters are left out. None: 0."""
    if optimizer is None:
        return 0
    if optimizer.state:
        return unique_bytes(t for state in optimizer.state.values() for t in state.values()
                             if hasattr(t, "untyped_storage") and t.dim() > 0)
    kind = kind_of(optimizer)
    return sum(tensors_per_param(kind, group) * sum(p.numel() * p.element_size()
                                                     for p in group["params"] if p.requires_grad)
               for group in optimizer.param_groups)


def model_state_bytes(optimizer: Any, model: Any) -> int:
    """Bytes of `optimizer`'s state for `model`: an optimizer instance as `state_bytes` counts it; a name
    or bytes per parameter byte applied to the model's trainable parameters (shared ones once)."""
    if optimizer is None:
        return 0
    if hasattr(optimizer, "param_groups"):
        return state_bytes(optimizer)
    trainable = unique_bytes(p for p in model.parameters() if p.requires_grad)
    return int(bytes_per_param_byte(optimizer) * trainable)


def per_parameter(optimizer: Any, module: Any) -> tuple[tuple[str, int, int], ...]:
    """(name, state bytes, value bytes) of each of `module`'s trainable parameters the optimizer trains, in
    the order backward produces their gradients (the reverse of the module's; shared ones once). An optimizer
    instance: its state where it has stepped, else as `tensors_per_param` counts it per group; a name or a
    number of bytes per parameter byte: applied to every trainable parameter."""
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if hasattr(optimizer, "param_groups"):
        per = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                per[p] = unique_bytes(t for t in state.values() if hasattr(t, "untyped_storage") and t.dim() > 0) \
                    if state else tensors_per_param(kind_of(optimizer), group) * p.numel() * p.element_size()
    else:
        ratio = bytes_per_param_byte(optimizer)
        per = {p: int(ratio * p.numel() * p.element_size()) for _, p in params}
    return tuple((name, per[p], p.numel() * p.element_size()) for name, p in reversed(params) if p in per)
