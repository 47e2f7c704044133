"""The joint graphs AOTAutograd traced, kept in this process so that a step planned again (at another
budget, for a least search, a batch size search, a policy table, or the same model copied) is traced once.

A joint graph (AOTAutograd's trace of forward and backward on fake tensors) depends only on what is
traced, never on the budget: the captured graph (its code, in which symbolic_trace bakes the model's
Python attributes and export every op, and the settings and hooks of the modules it calls as leaves),
the model's parameters and buffers and the step's inputs (names, shape, strides, dtype, device,
`requires_grad`, subclass, which share storage; non-tensor inputs by value), the wrapped model's class,
grad mode, autocast, AOTAutograd's configuration, the default dtype, deterministic mode, the attention
kernels enabled, global module hooks, and the device a meta model is planned on. A joint is given again
where all of these are the same, whichever module object they come from (a deep copy of a model traces
as the model does); a changed parameter shape, dtype, device or `requires_grad`, loss function (its ops
are in the captured code), training mode, leaf module setting (a dropout's p) or chunk count (a rewritten
graph has other code) traces again.

The engine (`fxmem.run.engine._planned`) plans a step on a kept joint where there is one, and otherwise
traces it with `fxmem.run.planners.KeepingPlanner`, which keeps the joint as AOTAutograd gives it; a step planned on a kept
joint is compiled at its first call, where `KeepingPlanner` applies the plan it made. Reads what it keys
on; keeps at most `MAX_JOINTS` joints, least recently used first out. Every caller gets its own copy
(nodes, their metadata dictionaries one level deep, the module's metadata), which the planner and its
passes may rewrite; the copies share the nodes' fake tensors, which nothing writes to. Writes nothing
else.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.trace import autocast as bwa
from fxmem.trace.capture import flat_graph_inputs
from fxmem.trace.meta_device import _PLANNING_DEVICE
from fxmem.planner.planner import Planner

MAX_JOINTS = 32
_JOINTS: "collections.OrderedDict[tuple, tuple[torch.fx.GraphModule, int]]" = collections.OrderedDict()
_LOCK = threading.Lock()
stats = collections.Counter()  # "traced", "reused": how often each happened in this process


def key_of(model: torch.nn.Module, gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """What the joint graph of `gm`'s step (captured from `model`) depends on (module docstring)."""
    return (type(_root(model)), *trace_key(gm, args, kwargs))


@contextlib.contextmanager
def forgotten_after():
    """Joints traced within are forgotten at its end: they hold fake tensors of a fake mode that ends there
    (a rank simulated on fakes, `fxmem.fsdp.rank_peak`), which a later mode's step cannot be planned on."""
    with _LOCK:
        before = collections.OrderedDict(_JOINTS)
    try:
        yield
    finally:
        with _LOCK:
            _JOINTS.clear()
            _JOINTS.update(before)


def kept(key: tuple) -> tuple[torch.fx.GraphModule, int] | None:
    """A copy of the joint graph kept for `key` and its number of forward outputs; None if none is."""
    with _LOCK:
        found = _JOINTS.get(key)
        if found is None:
            return None
        _JOINTS.move_to_end(key)
        stats["reused"] += 1
    return copy_joint(found[0]), found[1]


def keep(key: tuple, joint: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    """Keep a copy of `joint` (as traced, before a planner rewrites it) for `key`."""
    copied = copy_joint(joint)
    with _LOCK:
        _JOINTS[key] = (copied, num_fwd_outputs)
        _JOINTS.move_to_end(key)
        while len(_JOINTS) > MAX_JOINTS:
            _JOINTS.popitem(last=False)
        stats["traced"] += 1


def joint_of(key: tuple, trace: Callable[[Callable[..., Any]], Any]) -> tuple[torch.fx.GraphModule, int]:
    """The joint graph for `key` and its number of forward outputs: a copy of the one kept, else traced
    by `trace(partitioner)`, which traces the step with `partitioner` as AOTAutograd's (it stops
    AOTAutograd there), and kept."""
    found = kept(key)
    if found is not None:
        return found
    try:
        trace(_joint_only)
        raise AssertionError("AOTAutograd traced no joint graph")  # grad mode off: no training step
    except _Traced as traced:
        keep(key, traced.joint, traced.num_fwd_outputs)
        return traced.joint, traced.num_fwd_outputs


class Uncompiled:
    """In place of a CompiledStep where only the plan is wanted: the planner that made it."""

    def __init__(self, planner: Planner):
        self.planner = planner


def clear() -> None:
    """Forget every joint graph kept."""
    with _LOCK:
        _JOINTS.clear()


class _Traced(Exception):
    """Raised by `_joint_only` to stop AOTAutograd once the joint graph is traced."""

    def __init__(self, joint: torch.fx.GraphModule, num_fwd_outputs: int):
        super().__init__("joint graph traced")
        self.joint, self.num_fwd_outputs = joint, num_fwd_outputs


def _joint_only(joint: torch.fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int, **_kw: Any):
    raise _Traced(joint, num_fwd_outputs)


@contextlib.contextmanager
def partitioning(joint: torch.fx.GraphModule):
    """What AOTAutograd's partitioner runs under: the joint's fake mode, no grad, no autocast."""
    from torch._guards import detect_fake_mode

    values = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext(), torch.no_grad(), torch._C._DisableAutocast():
        yield


def _root(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model under fxmem's wrappers (`fxmem.trace.wrapper.ModelWrapper`), made anew at each plan."""
    while getattr(model, "fxmem_model", None) is not None:
        model = model.fxmem_model
    return model


def copy_joint(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own nodes, node metadata (one level deep: the dictionaries passes write
    into) and module metadata; fake tensors and attribute tensors shared."""
    with warnings.catch_warnings():  # copying a pytree spec warns of a deprecated spec class
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(joint.graph)
    for old, new in zip(joint.graph.nodes, graph.nodes):
        new.meta = {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in old.meta.items()}
    fresh = torch.fx.GraphModule(joint, graph)
    fresh.meta = copy.copy(joint.meta)
    return fresh


def trace_key(gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """Everything besides the model's identity that the joint graph of `gm`'s step depends on: `gm`'s
    parameters and buffers are the model's own tensors (`fxmem.capture`), which the step receives."""
    flat = flat_graph_inputs(gm, args, kwargs)
    state = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    storages: dict[int, int] = {}
    tensors = [t for _, t in state] + [x for x in pytree.tree_leaves(flat) if isinstance(x, torch.Tensor)]
    described = tuple(_tensor(t, storages) for t in tensors)
    others = tuple(_value(x) for x in pytree.tree_leaves(flat) if not isinstance(x, torch.Tensor))
    return (gm.code, _leaf_modules(gm), tuple(name for name, _ in state), described, others, _modes())


def _tensor(t: torch.Tensor, storages: dict[int, int]) -> tuple:
    """Metadata of one traced tensor; which earlier tensor's storage it shares, by order of appearance."""
    try:
        storage = storages.setdefault(t.untyped_storage()._cdata, len(storages))
    except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
        storage = -1
    return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            t.is_leaf, storage)


def _value(x: Any) -> Any:
    """A non-tensor input: itself where it is a plain value, else its type and identity."""
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(x), x)
    return (type(x), id(x))


def _leaf_modules(gm: torch.fx.GraphModule) -> tuple:
    """The modules the captured code calls as leaves (`call_module`), with their plain attributes (a
    convolution's stride, a dropout's p) and hooks: their code is not in `gm.code`."""
    described = []
    for node in gm.graph.find_nodes(op="call_module"):
        module = gm.get_submodule(node.target)
        settings = tuple(sorted((k, _setting(v)) for k, v in vars(module).items()
                                if not k.startswith("_") and not isinstance(v, (torch.Tensor, torch.nn.Module))))
        hooks = tuple(id(h) for d in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
                                      module._backward_pre_hooks) for h in d.values())
        described.append((node.target, type(module), settings, hooks))
    return tuple(described)


def _setting(value: Any) -> Any:
    """A leaf module's attribute as the key holds it: plain values (and tuples, lists of them) by value,
    others (a function a module holds, as export's guard module does) by type."""
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return type(value)


def _modes() -> tuple:
    """The process-wide settings tracing reads."""
    from torch._functorch import config as functorch_config

    return (torch.is_grad_enabled(), bwa.live_state(), functorch_config.get_hash(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(), _PLANNING_DEVICE.get(), _global_hooks())


def _global_hooks() -> tuple:
    """Module hooks registered for every module (`torch.nn.modules.module.register_module_forward_hook`)."""
    from torch.nn.modules import module as nn_module

    return tuple(id(h) for d in (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
                                 nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)
                 for h in d.values())
