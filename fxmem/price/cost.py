"""Cost model: per node of a joint forward/backward graph, bytes, FLOPs and estimated seconds.

Reads `meta["val"]` (FakeTensors) and `meta["nn_module_stack"]`; FLOPs come from
`torch.utils.flop_counter.FlopCounterMode` run on the fake values (with `fxmem.price.op_pricing`'s
formulas for the attention kernels torch has none for), time from a `DeviceSpec` roofline (compute
or memory traffic, whichever is slower, plus a per-op overhead). Ops with no FLOP formula that are
not memory-bound by nature are marked as priced by memory traffic alone; a GPU target prices the
attention kernel the GPU runs where the graph holds the CPU's. Returns a frozen `CostTable`;
writes `meta["fxmem"]["cost"]` on each node.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from fxmem.price.memory import storage_bytes, storage_key, tensors_of
from fxmem.price.op_pricing import FLOP_FORMULAS, gpu_attention_kernel, needs_fallback
from fxmem.meta_keys import COST, tags
from fxmem.trace.module_path import module_path


@dataclass(frozen=True)
class HostLink:
    """The device's link to host memory: sustained bytes/s in each direction (one copy stream per
    direction; device->host and host->device run at once) and the fixed cost of one copy."""

    name: str
    bytes_per_s: float
    latency_s: float = 10e-6

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def from_name(cls, name: str) -> "HostLink":
        try:
            return HOST_LINKS[name.lower()]
        except KeyError:
            raise KeyError(f"unknown host link {name!r}; presets: {', '.join(sorted(HOST_LINKS))}") from None


GB = 10**9
# Sustained pinned-memory copy rates per direction, about 80% of the link's peak.
HOST_LINKS: Mapping[str, HostLink] = MappingProxyType({
    "pcie4": HostLink("pcie4", 25 * GB),        # PCIe Gen4 x16: 32 GB/s peak per direction
    "pcie5": HostLink("pcie5", 50 * GB),        # PCIe Gen5 x16: 64 GB/s peak per direction
    "nvlink-c2c": HostLink("nvlink-c2c", 360 * GB, 5e-6),  # Grace Hopper NVLink-C2C: 450 GB/s per direction
    "memcpy": HostLink("memcpy", 10 * GB, 2e-6),  # a CPU "device": host copies within one memory
})


@dataclass(frozen=True)
class DeviceSpec:
    """What a device can do: matmul FLOP/s (16-bit and 32-bit), memory bytes/s, per-op overhead,
    and its link to host memory (for offloading saved values); and what its allocator holds beyond
    the tensors (`fxmem.price.memory.AllocatorModel`): every block rounded up to `block_bytes`, one BLAS
    workspace of `blas_workspace_bytes` per graph that runs a matmul (forward; autograd's backward
    thread), and a scratch of its output's size for each op in `scratch_ops` (aten op names).
    `gpu`: a CUDA device, whose attention kernels are priced where the graph was traced on the CPU."""

    name: str
    flops_per_s: float
    fp32_flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    memory_bytes: int | None = None
    host_link: HostLink | None = None
    block_bytes: int = 1
    blas_workspace_bytes: int = 0
    scratch_ops: tuple[str, ...] = ()
    gpu: bool = False
    # What running a step costs beyond its kernels (`fxmem.run.step_timer` measures them): per view op (the
    # generated code's dispatch), per step (wrappers, autograd engine) and per parameter tensor (gradient
    # accumulation, bookkeeping). 0 on the GPU presets, where the host runs ahead of the kernels.
    view_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    param_overhead_s: float = 0.0

    def with_link(self, link: "HostLink | str") -> "DeviceSpec":
        """This device with another host link (a `HostLink` or a preset name such as "nvlink-c2c")."""
        return replace(self, host_link=HostLink.from_name(link) if isinstance(link, str) else link)

    @classmethod
    def from_name(cls, name: str) -> "DeviceSpec":
        try:
            return DEVICE_PRESETS[name.lower()]
        except KeyError:
            raise KeyError(f"unknown device {name!r}; presets: {', '.join(sorted(DEVICE_PRESETS))}") from None

    def workspace_bytes(self) -> int:
        """Bytes of one BLAS workspace: `blas_workspace_bytes`, or what CUBLAS_WORKSPACE_CONFIG
        (":SIZE_KIB:COUNT" pairs) asks for on a device that has one (0 on the CPU)."""
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        if not self.blas_workspace_bytes or not config:
            return self.blas_workspace_bytes
        fields = config.split(":")[1:]
        try:
            if not fields or len(fields) % 2:
                raise ValueError
            return sum(int(fields[i]) * 1024 * int(fields[i + 1]) for i in range(0, len(fields), 2))
        except ValueError:
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG={config!r}: expected :SIZE_KIB:COUNT pairs, "
                             "e.g. :4096:8") from None

    def flop_rate(self, dtype: torch.dtype | None) -> float:
        return self.flops_per_s if dtype in (torch.float16, torch.bfloat16) else self.fp32_flops_per_s

    def seconds(self, flops: int, bytes_moved: int, dtype: torch.dtype | None = None) -> float:
        return self.op_overhead_s + max(flops / self.flop_rate(dtype), bytes_moved / self.bytes_per_s)

    def fixed_seconds(self, num_parameters: int) -> float:
        """A step's cost beyond its ops: per step, and per parameter tensor it trains."""
        return self.step_overhead_s + self.param_overhead_s * num_parameters


MIB = 2**20
# The CUDA caching allocator rounds every block up to 512 bytes. cuBLAS keeps one workspace per
# handle and stream (CUBLAS_WORKSPACE_CONFIG overrides): 32 MiB on sm90 and newer, ":4096:2:16:8"
# (8.125 MiB) before; the allocator traces of one H100 step show two (forward and backward thread).
# Softmax backward on CUDA allocates a scratch of its output's size for the op's duration.
CUDA_DEVICE = dict(gpu=True, block_bytes=512, scratch_ops=("_softmax_backward_data",))
SM80_WORKSPACE, SM90_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8, 32 * MIB

DEVICE_PRESETS: Mapping[str, DeviceSpec] = MappingProxyType({
    # A 2-core laptop/CI-class CPU; per-op dispatch overhead dominates small ops. A step's fixed costs as
    # `fxmem.run.step_timer` measured them on such a machine (2026-11-26), rounded.
    "cpu": DeviceSpec("cpu", 1.0e11, 1.0e11, 15 * GB, 8e-6, None, HOST_LINKS["memcpy"], view_overhead_s=5e-6,
                      step_overhead_s=5e-4, param_overhead_s=5e-5),
    # Dense tensor-core peaks (no sparsity) and HBM bandwidth from the vendors' data sheets;
    # host links as the SXM/PCIe boards ship (H100/H200 SXM: PCIe Gen5; GH200 is h100 + nvlink-c2c).
    "a100": DeviceSpec("a100", 312e12, 156e12, 2039 * GB, 5e-6, 80 * 2**30, HOST_LINKS["pcie4"],
        blas_workspace_bytes=SM80_WORKSPACE, **CUDA_DEVICE),
    "h100": DeviceSpec("h100", 989e12, 494e12, 3350 * GB, 4e-6, 80 * 2**30, HOST_LINKS["pcie5"],
        blas_workspace_bytes=SM90_WORKSPACE, **CUDA_DEVICE),
    "h200": DeviceSpec("h200", 989e12, 494e12, 4800 * GB, 4e-6, 141 * 2**30, HOST_LINKS["pcie5"],
        blas_workspace_bytes=SM90_WORKSPACE, **CUDA_DEVICE),
    "gh200": DeviceSpec("gh200", 989e12, 494e12, 4000 * GB, 4e-6, 96 * 2**30, HOST_LINKS["nvlink-c2c"],
        blas_workspace_bytes=SM90_WORKSPACE, **CUDA_DEVICE),
    "l4": DeviceSpec("l4", 121e12, 60e12, 300 * GB, 5e-6, 24 * 2**30, HOST_LINKS["pcie4"],
        blas_workspace_bytes=SM80_WORKSPACE, **CUDA_DEVICE),
    "rtx4090": DeviceSpec("rtx4090", 165e12, 82e12, 1008 * GB, 5e-6, 24 * 2**30, HOST_LINKS["pcie4"],
           blas_workspace_bytes=SM80_WORKSPACE, **CUDA_DEVICE),
})


# GPU name fragments (lower case, as torch.cuda.get_device_name gives them) -> preset; GH200 before H200.
GPU_PRESETS = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("l4", "l4"),
               ("4090", "rtx4090"))


def preset_for(device: torch.device | str) -> DeviceSpec:
    """The preset of the device a model lives on: a GPU by its name (an unknown GPU gets the a100
    preset under its own name and memory), the CPU preset otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEVICE_PRESETS["cpu"]
    name = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    memory = props.total_memory
    for fragment, preset in GPU_PRESETS:
        if fragment in name.lower():
            return replace(DEVICE_PRESETS[preset], memory_bytes=memory)
    workspace = SM90_WORKSPACE if getattr(props, "major", 8) >= 9 else SM80_WORKSPACE
    return replace(DEVICE_PRESETS["a100"], name=name, memory_bytes=memory, blas_workspace_bytes=workspace)


@dataclass(frozen=True)
class NodeCost:
    """One node's costs. `saved_bytes`: storage bytes it keeps alive for backward when saved (0 for views).
    `fallback`: an op with no FLOP formula, priced by the memory traffic it causes alone; `kernel`: the
    GPU kernel it is priced as, where the graph holds the CPU's attention kernel ("" otherwise)."""

    name: str
    op: str
    module: str
    out_bytes: int
    saved_bytes: int
    flops: int
    seconds: float
    is_view: bool
    fallback: bool = False
    kernel: str = ""


@dataclass(frozen=True)
class CostTable:
    device: DeviceSpec
    nodes: Mapping[str, NodeCost] = field(default_factory=dict)

    def __getitem__(self, name: str) -> NodeCost:
        return self.nodes[name]

    def total_flops(self) -> int:
        return sum(c.flops for c in self.nodes.values())

    def total_seconds(self) -> float:
        return sum(c.seconds for c in self.nodes.values())

    def fallback_ops(self) -> tuple[str, ...]:
        """The ops (by name) priced by memory traffic for want of a FLOP formula."""
        return tuple(sorted({c.op for c in self.nodes.values() if c.fallback}))

    def kernels(self) -> dict[str, str]:
        """Graph op -> the GPU kernel priced in its place."""
        return {c.op: c.kernel for c in self.nodes.values() if c.kernel}


def is_view(node: torch.fx.Node) -> bool:
    """True when every tensor the node yields shares storage with an input of its op
    (for `getitem`, an input of the multi-output op it picks from)."""
    outs = tensors_of(node)
    if node.op != "call_function" or not outs:
        return False
    source = node
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
    inputs = {storage_key(t) for n in source.all_input_nodes for t in tensors_of(n)}
    return all(storage_key(t) in inputs for t in outs)


def _count_flops(node: torch.fx.Node) -> int:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet not in flop_registry and packet not in FLOP_FORMULAS:
        return 0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fake_mode = detect_fake_mode(tuple(t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                                       if isinstance(t, torch.Tensor)))
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with fake_mode or torch.device("meta"), counter:
        target(*args, **kwargs)
    return int(counter.get_total_flops())


def estimate(gm: torch.fx.GraphModule, device: DeviceSpec | None = None,
             backward: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset(),
             timer: Callable[[torch.fx.Node], float | None] | None = None, fused: bool = False) -> CostTable:
    """Cost every call_function node of `gm`; `backward` names the joint graph's backward nodes,
    so a forward node read by one of them reports the bytes eager autograd would save for it.
    `timer(node)` gives a node's measured seconds (`fxmem.price.kernel_timer`), where it can; the
    device's roofline prices the rest. On a GPU `device`, an attention node on CPU tensors is priced
    as the kernel the GPU runs for it (same FLOPs by PyTorch's formula; the math path's score traffic).
    `fused` (the graph runs as Inductor's code): a pointwise op costs no time, being fused into the
    kernel of its producer or consumer, so recomputing it costs no kernel and no memory traffic."""
    device = device or DEVICE_PRESETS["cpu"]
    table: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        outs = tensors_of(node)
        view = is_view(node)
        out_bytes = 0 if view else sum({storage_key(t): storage_bytes(t) for t in outs}.values())
        flops, seconds, fallback, kernel = 0, 0.0, False, None
        if fused and is_pointwise(node):
            pass  # no kernel of its own: no time, and its FLOPs are no matmul's
        elif view and not fused and node.target is not operator.getitem:
            seconds = device.view_overhead_s  # no kernel, but a dispatched op
        elif not (view or node.target is operator.getitem):
            in_bytes = sum(t.numel() * t.element_size() for n in node.all_input_nodes for t in tensors_of(n))
            flops = _count_flops(node)
            fallback = in_bytes + out_bytes > 0 and needs_fallback(node)
            if device.gpu and outs and outs[0].device.type == "cpu":
                kernel = gpu_attention_kernel(node)
            extra = kernel.extra_bytes if kernel is not None else 0
            measured = timer(node) if timer is not None and kernel is None else None
            seconds = measured if measured is not None else \
                device.seconds(flops, in_bytes + out_bytes + extra, outs[0].dtype if outs else None)
        saved = out_bytes if any(u in backward for u in node.users) and node not in backward else 0
        cost = NodeCost(node.name, _op_name(node), module_path(node), out_bytes, saved, flops, seconds, view,
                        fallback, kernel.name if kernel is not None else "")
        tags(node)[COST] = cost
        table[node.name] = cost
    return CostTable(device, MappingProxyType(table))


def is_pointwise(node: torch.fx.Node) -> bool:
    """An aten op that torch tags pointwise (elementwise: Inductor fuses it with its neighbours)."""
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", None) or str(target)
    return str(getattr(target, "_name", name)).replace("aten::", "")
