"""Host gradients pass: each chosen parameter's gradient leaves the device inside the backward graph.

Reads an AOTAutograd joint graph, the names of its parameter inputs in order (`primal_names`: primal i is
parameter `primal_names[i]`) and the parameters whose gradients live in host memory (`Plan.host_gradients`).
Returns a copy of the joint in which, right after backward computes such a gradient, a call
`to_host(sink, name, grad)` hands it to the step's `GradientSink`, and the graph returns None for it: the
gradient dies on the device once copied (the simulator, the problem builder and the breakdown see it freed
there, fx's code frees it after its last use), `.grad` stays None, and the sink's receiver (fxmem's
`HostOptimizer.receive`) holds it in a host buffer. The sink node is marked for backward
(`meta["partitioner_tag"]`) and side-effectful (`torch.fx.node.has_side_effect`), so the partition keeps
it in the backward graph. The joint given is not changed. The sink is connected to its receiver
(`GradientSink.connect`) before backward runs; one that is not refuses in one line.
"""
from __future__ import annotations

import copy
import itertools
import weakref
from typing import Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

_SINKS: "weakref.WeakValueDictionary[int, GradientSink]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


class GradientSink:
    """Where a backward graph's host gradients go: `receiver(name, grad)` for each, inside backward."""

    def __init__(self, names: Sequence[str]):
        self.id = next(_IDS)
        self.names = tuple(names)
        self.receiver: Callable[[str, torch.Tensor], None] | None = None
        _SINKS[self.id] = self

    def connect(self, receiver: Callable[[str, torch.Tensor], None]) -> None:
        self.receiver = receiver


@torch.fx.node.has_side_effect
def to_host(sink_id: int, name: str, grad: torch.Tensor) -> None:
    """Backward computed `name`'s gradient: hand it to the sink's receiver (a host copy, or an add into it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(grad, FakeTensor) or grad.device.type == "meta":  # traced, not run: nothing to copy
        return None
    sink = _SINKS.get(sink_id)
    if sink is None or sink.receiver is None:
        raise RuntimeError(f"the gradient of {name} is planned to live in host memory but no optimizer receives it: "
                           "step fxmem's HostOptimizer (the module's fxmem_optimizer) with this plan")
    sink.receiver(name, grad)
    return None


def host_gradient_joint(joint: torch.fx.GraphModule, names: Sequence[str], primal_names: Sequence[str]
                        ) -> tuple[torch.fx.GraphModule, GradientSink | None]:
    """A copy of `joint` whose gradients of the parameters `names` go to a new sink (see the module's note),
    and that sink; `joint` itself and no sink where `names` is empty."""
    if not names:
        return joint, None
    position = {name: i for i, name in enumerate(primal_names)}
    missing = [name for name in names if name not in position]
    if missing:
        raise ValueError(f"host gradients of {missing[:3]} asked for, but the step's graph has no such parameter "
                         f"(its first: {list(primal_names)[:3]})")
    graph = copy.deepcopy(joint.graph)
    output = graph.output_node()
    output.meta = dict(joint.graph.output_node().meta)  # the outputs' descriptions (AOTAutograd reads them)
    num_outputs = len(pytree.tree_leaves(output.args[0]))
    leaves, spec = pytree.tree_flatten(output.args[0])
    grads_of = _gradient_outputs(output, num_outputs)
    sink = GradientSink(names)
    for name in names:
        where = grads_of.get(position[name])
        if where is None or not isinstance(leaves[where], torch.fx.Node) or leaves[where].op != "call_function":
            continue  # no gradient computed for it in this step: nothing to move
        grad = leaves[where]
        with graph.inserting_after(grad):
            call = graph.call_function(to_host, (sink.id, name, grad))
        call.meta["val"] = None
        call.meta["partitioner_tag"] = "is_backward"
        leaves[where] = None
    output.args = (pytree.tree_unflatten(leaves, spec),)
    rewritten = torch.fx.GraphModule(joint, graph)
    rewritten.meta.update(joint.meta)
    return rewritten, sink


def _gradient_outputs(output: torch.fx.Node, num_outputs: int) -> dict[int, int]:
    """Primal index -> the position of its gradient among the joint's output leaves (AOTAutograd's
    descriptions: `GradAOTOutput(grad_of=PlainAOTInput(idx=i))`)."""
    found: dict[int, int] = {}
    for at, desc in enumerate(output.meta.get("desc") or ()):
        of = getattr(desc, "grad_of", None)
        idx = getattr(of, "idx", None)
        if isinstance(idx, int) and at < num_outputs:
            found[idx] = at
    return found
