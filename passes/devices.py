"""Devices pass: run each region of a captured model on its device, moving values at the boundaries.

Reads a captured (torch-level) GraphModule and a device (or a (device, region) pair) per node name; moves the parameters and
buffers each region owns to its device (in place: they stay the model's own tensors) and inserts
a `to_device` node wherever a node reads a tensor from another device or region (inputs included:
regions on one device get no-op moves, so the boundaries show on a single-device machine); the
model's outputs go to `output_device`. Writes `meta["fxmem"]["device"]` on every node it places.
Autograd carries gradients back across the moves, so training the result trains the model.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxmem.meta_keys import DEVICE, NAMESPACE, tags


def to_device(x: Any, device: str) -> Any:
    """`x` on `device` (a tensor; other values and tensors already there pass through)."""
    if isinstance(x, torch.Tensor) and x.device != torch.device(device):
        return x.to(device, non_blocking=True)
    return x


def _state_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(owner, attribute, tensor) for the parameters and buffers a call_module or get_attr node uses."""
    if node.op == "call_module":
        owner = gm.get_submodule(node.target)
        return [(m, name, t) for m in owner.modules()
                for name, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
    if node.op == "get_attr":
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, attr)
        return [(owner, attr, value)] if isinstance(value, torch.Tensor) else []
    return []


def _move_state(state: list[tuple[torch.nn.Module, str, torch.Tensor]], device: str) -> None:
    """Move tensors to `device` in place: parameters keep their identity (optimizers keep working)."""
    target = torch.device(device)
    for owner, name, t in state:
        if t.device == target:
            continue
        if isinstance(t, torch.nn.Parameter):
            t.data = t.data.to(target)
        elif name in owner._buffers:
            owner._buffers[name] = t.to(target)
        else:
            setattr(owner, name, t.to(target))


def place(gm: torch.fx.GraphModule, node_device: Mapping[str, str | tuple[str, int]],
          output_device: str) -> torch.fx.GraphModule:
    """Rewrite `gm` in place so node `n` runs on `node_device[n.name]`; see the module docstring."""
    graph = gm.graph
    device_of: dict[torch.fx.Node, tuple[str, Any]] = {}
    moved: dict[tuple[torch.fx.Node, tuple[str, Any]], torch.fx.Node] = {}
    home: dict[int, tuple[str, Any]] = {}  # id(tensor) -> (device, region): state lives where first used
    for node in list(graph.nodes):
        if node.op == "output":
            continue
        spec = node_device.get(node.name)
        if spec is None:
            continue
        device, region = (spec, spec) if isinstance(spec, str) else spec
        state = _state_of(gm, node)
        placed = [home[id(t)] for _, _, t in state if id(t) in home]
        if placed:  # shared state (a module called twice, tied weights): run where it already lives
            device, region = placed[0]
        _move_state(state, device)
        home.update({id(t): (device, region) for _, _, t in _state_of(gm, node)})
        tags(node)[DEVICE] = device
        if node.op == "placeholder":  # inputs: wherever the caller put them; moved where read
            continue
        device_of[node] = (device, region)
        if node.op == "get_attr":
            continue
        for source in node.all_input_nodes:
            if device_of.get(source) == (device, region):
                continue
            key = (source, (device, region))
            if key not in moved:
                with graph.inserting_before(node):
                    moved[key] = graph.call_function(to_device, (source, device))
                moved[key].meta = {NAMESPACE: {DEVICE: device}}
            node.replace_input_with(source, moved[key])
    output = graph.output_node()
    with graph.inserting_before(output):
        def back(n: Any) -> Any:
            if isinstance(n, torch.fx.Node):
                mover = graph.call_function(to_device, (n, output_device))
                mover.meta = {NAMESPACE: {DEVICE: output_device}}
                return mover
            return n
        output.args = pytree.tree_map(back, output.args)
    graph.lint()
    gm.recompile()
    return gm
