"""Memory simulator: live bytes at every step of a training step's forward and backward graphs.

Reads `meta["val"]` (FakeTensors) of fx nodes; counts unique storages (views share their base's),
allocates at the producing node and frees after the last use, as fx-generated code with boxed
inputs does. Parameters, buffers and inputs are alive throughout; model outputs and gradients
are held until the step ends. Nodes marked `meta["fxmem"]["host"]` (offloaded copies) hold no
device memory. An `AllocatorModel` adds what a device's allocator holds beyond the tensors (block
rounding, BLAS workspaces, kernel scratch); the default adds nothing (the CPU). Writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Hashable, Iterable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.meta_keys import HOST, tag


def tensors_of(node: torch.fx.Node) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> Hashable:
    return StorageWeakRef(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def on_host(node: torch.fx.Node) -> bool:
    """True for values an offload moved to host memory (`meta["fxmem"]["host"]`): not device bytes."""
    return bool(tag(node, HOST))


def storages_of(node: torch.fx.Node) -> dict[Hashable, int]:
    """The storages a node's value refers to, with their sizes in bytes."""
    return {storage_key(t): storage_bytes(t) for t in tensors_of(node)}


# aten ops that run on cuBLAS: the first one a thread runs on a stream allocates its workspace.
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
                      "_addmm_activation", "_scaled_mm", "addr"})


def op_name(node: torch.fx.Node) -> str:
    """The aten op's name without namespace and overload ("mm" for aten.mm.default)."""
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else ""


@dataclass(frozen=True)
class AllocatorModel:
    """What a device's allocator holds beyond the tensors' bytes. Every block is rounded up to
    `block_bytes`; a graph that runs a BLAS op holds one `workspace_bytes` workspace for the whole
    step (cuBLAS caches it per thread and stream from the first step on: one for forward, one for
    autograd's backward thread); an op in `scratch_ops` holds a scratch of its output's size while
    it runs. `held_forward`/`held_backward`: bytes the rest of the step holds on the device while
    this graph's forward / backward runs (other graphs' parameters and saved values, gradients
    later graphs produced; `fxmem.run.dynamo.ledger`). The default is the CPU's: exact bytes, nothing else."""

    block_bytes: int = 1
    workspace_bytes: int = 0
    scratch_ops: frozenset[str] = frozenset()
    held_forward: int = 0
    held_backward: int = 0

    def held(self, phase: str) -> int:
        return self.held_backward if phase == "backward" else self.held_forward

    def holding(self, forward: int, backward: int) -> "AllocatorModel":
        """This model with the rest of the step holding `forward` / `backward` bytes."""
        return replace(self, held_forward=forward, held_backward=backward)

    @classmethod
    def for_device(cls, device: Any) -> "AllocatorModel":
        """The model of a `fxmem.price.cost.DeviceSpec` (its block size, workspace and scratch ops)."""
        return cls(device.block_bytes, device.workspace_bytes(), frozenset(device.scratch_ops))

    def round(self, nbytes: int) -> int:
        b = self.block_bytes
        return nbytes if b <= 1 or nbytes == 0 else -(-nbytes // b) * b

    def workspaces(self, *graphs: Iterable[torch.fx.Node]) -> int:
        """Workspace bytes held by a step running `graphs` (one workspace per graph with a BLAS op)."""
        if not self.workspace_bytes:
            return 0
        return self.workspace_bytes * sum(any(n.op == "call_function" and op_name(n) in BLAS_OPS for n in g)
                                          for g in graphs)

    def scratch(self, node: torch.fx.Node) -> int:
        if not self.scratch_ops or op_name(node) not in self.scratch_ops:
            return 0
        return sum(self.round(b) for b in storages_of(node).values())


EXACT = AllocatorModel()


@dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes at each simulated step; `static` (parameters, buffers, inputs) and `workspace`
    (the allocator's workspaces, held all step) are included in `live`."""

    names: tuple[str, ...]
    phases: tuple[str, ...]
    live: tuple[int, ...]
    static: int
    workspace: int = 0

    @property
    def peak(self) -> int:
        return max(self.live, default=self.static)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.live)), key=self.live.__getitem__) if self.live else -1


class Walker:
    """Allocation and freeing of storages along one node sequence."""

    def __init__(self, static: dict[Hashable, int], allocator: AllocatorModel = EXACT, workspace: int = 0):
        self.static = static
        self.allocator = allocator
        self.workspace = workspace
        self.static_bytes = sum(allocator.round(b) for b in static.values())
        self.exclude: set[Hashable] = set()
        self.live: dict[Hashable, int] = {}
        self.names: list[str] = []
        self.phases: list[str] = []
        self.levels: list[int] = []

    def allocate(self, storages: dict[Hashable, int]) -> None:
        for key, nbytes in storages.items():
            if key not in self.static and key not in self.exclude:
                self.live.setdefault(key, self.allocator.round(nbytes))

    def record(self, name: str, phase: str, scratch: int = 0) -> None:
        self.names.append(name)
        self.phases.append(phase)
        self.levels.append(self.static_bytes + self.workspace + sum(self.live.values()) + scratch
                           + self.allocator.held(phase))

    def walk(self, nodes: Sequence[torch.fx.Node], phase: str, *, keep: set[Hashable],
             counted_users: Any = None, inlined: frozenset[str] = frozenset()) -> None:
        """Run `nodes` in order; a storage dies after the last (counted) use of every node referring to it.
        A node named in `inlined` is computed inside the kernels that read it (Inductor's fusion): it holds
        no storage of its own, and refers to its inputs' storages, which so live until its readers ran."""
        position = {n: i for i, n in enumerate(nodes)}
        storages = [storages_of(node) for node in nodes]
        for i, node in enumerate(nodes):
            if node.name in inlined:
                storages[i] = {k: b for n in node.all_input_nodes
                               for k, b in (storages[position[n]] if n in position else storages_of(n)).items()}
        death: dict[Hashable, int] = {}
        for i, node in enumerate(nodes):
            users = [u for u in node.users if u in position and (counted_users is None or counted_users(u))]
            last = max((position[u] for u in users), default=i)
            for key in storages[i]:
                death[key] = max(death.get(key, -1), last)
        dying: dict[int, list[Hashable]] = {}
        for key, when in death.items():
            if key not in keep:
                dying.setdefault(when, []).append(key)
        for i, node in enumerate(nodes):
            if node.op in ("call_function", "placeholder") and not on_host(node):
                self.allocate(storages[i])
            if node.op == "call_function":
                self.record(node.name, phase, self.allocator.scratch(node))
            for key in dying.get(i, ()):
                self.live.pop(key, None)

    def retain(self, keys: set[Hashable]) -> None:
        """Free every live storage not in `keys` (what a graph's caller does not hold on to)."""
        for key in [k for k in self.live if k not in keys]:
            del self.live[key]

    def timeline(self) -> MemoryTimeline:
        return MemoryTimeline(tuple(self.names), tuple(self.phases), tuple(self.levels), self.static_bytes,
                              self.workspace)


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="placeholder"))


def graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """The leaves of `gm`'s output, in order (nodes, and None or constants where a graph returns them)."""
    return list(pytree.tree_leaves(gm.graph.output_node().args[0]))


def _keys(nodes: Iterable[Any]) -> set[Hashable]:
    keys: set[Hashable] = set()
    for n in nodes:
        if isinstance(n, torch.fx.Node):
            keys.update(storages_of(n))
    return keys


def simulate_step(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_user_outputs: int,
                  allocator: AllocatorModel = EXACT, inlined: frozenset[str] = frozenset()) -> MemoryTimeline:
    """Simulate forward graph `fw` then backward graph `bw` as AOTAutograd runs them.

    fw returns `num_user_outputs` values for the caller (mutated buffers, model outputs), then the
    values saved for backward; bw takes those saved values and the tangents and returns gradients.
    `allocator`: what the device's allocator holds beside the tensors (default: nothing). `inlined`:
    backward's recomputed nodes that Inductor computes inside their readers (see `Walker.walk`).
    """
    static = {}
    for node in _placeholders(fw):
        static.update(storages_of(node))
    walker = Walker(static, allocator, allocator.workspaces(fw.graph.nodes, bw.graph.nodes))
    fw_outputs = graph_outputs(fw)
    held_by_user = _keys(fw_outputs[:num_user_outputs])
    returned = _keys(fw_outputs)
    walker.walk(list(fw.graph.nodes), "forward", keep=returned)
    walker.retain(returned)
    grads = _keys(graph_outputs(bw))
    walker.walk(list(bw.graph.nodes), "backward", keep=held_by_user | grads, inlined=inlined)
    return walker.timeline()
