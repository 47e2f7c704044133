"""What Inductor's code holds: the step's memory simulated on the buffers Inductor makes, after fusion.

Inductor fuses pointwise chains into their consumers, so most values of a planned graph never exist;
a simulation of the unfused graph (`fxmem.memory.simulate_step`) overstates the step (1.5-1.7x on the
test GPTs). Here each planned graph is lowered and scheduled by Inductor's own pipeline, stopped after
fusion (`config._post_fusion_custom_pass`), before any code is made: its kernels in the order they run
(Inductor's reordering for peak memory applied), the buffers each one writes and reads. `simulate_fused`
then walks forward and backward as `simulate_step` does, on those buffers: parameters and inputs held
throughout, a buffer freed after its last reader unless the graph returns it, backward's inputs (the
saved values) freed after their last reader, gradients and what the caller holds kept to the end.
Not modelled: Inductor holds a freed buffer until a later one of its size reuses it, where its own
estimate says that costs no peak (gpt-tiny: 1.1% under the CPU allocator's peak for that).

Reads Inductor's scheduler nodes (a prototype IR: `ScheduledGraph` keeps only names and byte counts,
so a change there breaks this module alone). Writes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx

from fxmem.memory import EXACT, AllocatorModel, MemoryTimeline, Walker, graph_outputs, storages_of


@dataclasses.dataclass(frozen=True)
class ScheduledGraph:
    """One graph as Inductor runs it: `kernels` in order, each (buffers written with their bytes, names
    read); `outputs` what it returns, by name."""

    kernels: tuple[tuple[tuple[tuple[str, int], ...], tuple[str, ...]], ...]
    outputs: tuple[str, ...]


def _hint(expr: Any) -> int:
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    if hasattr(sizevars, "optimization_hint"):
        return int(sizevars.optimization_hint(expr, fallback=0))
    return int(sizevars.size_hint(expr, fallback=0))


def _buffer_bytes(buf: Any) -> int:
    """Bytes Inductor allocates for a scheduler buffer: its layout's storage (padded strides counted);
    none for a multi-output kernel's tuple (its parts are buffers of their own) or a buffer without data."""
    from torch._inductor.ir import MultiOutputLayout, NoneLayout

    layout = buf.node.layout
    if isinstance(layout, (NoneLayout, MultiOutputLayout)):
        return 0
    try:
        numel = layout.storage_size()
    except (AttributeError, NotImplementedError):
        numel = buf.node.get_numel()
    return _hint(numel) * layout.dtype.itemsize


def scheduled_graph(nodes: Sequence[Any]) -> ScheduledGraph:
    """The `ScheduledGraph` of Inductor's fused scheduler nodes (called inside Inductor's lowering), in the
    order its code runs them. A buffer a kernel mutates in place keeps its first name (Inductor renames it
    at each mutation); one a kernel keeps to itself (`_stays_in_kernel`) is not listed. On CPU, Inductor's
    C++ code runs fused nodes that follow one another (no aten kernel between) as one function, made
    after their outputs are all allocated and followed by the frees of what they read last: one kernel here."""
    from torch._inductor.virtualized import V

    nodes = _run_order(nodes)
    real = dict(nodes[0].scheduler.mutation_real_name) if nodes else {}
    name = lambda n: real.get(n, n)  # noqa: E731
    kernels: list[tuple[list[tuple[str, int]], set[str]]] = []
    where: dict[str, int] = {}  # the kernel writing each buffer
    joins = False  # whether the last kernel is a C++ function the next fused node joins
    for node in nodes:
        written, reads = [], {name(dep.name) for dep in node.read_writes.reads}
        for b in node.get_outputs():
            parent = _multi_output_parent(b)
            nbytes = 0 if b.get_name() in real else _buffer_bytes(b)
            if parent is not None and parent in where:  # made by the kernel that makes the tuple it is part of
                kernels[where[parent]][0].append((name(b.get_name()), nbytes))
            elif not _stays_in_kernel(node, b):
                written.append((name(b.get_name()), nbytes))
        cpp = _cpp_fused(node)
        if cpp and joins:
            kernels[-1][0].extend(written)
            kernels[-1][1].update(reads)
        else:
            kernels.append((written, reads))
        joins = cpp
        where.update({n: len(kernels) - 1 for n, _ in written})
    return ScheduledGraph(tuple((tuple(w), tuple(sorted(r))) for w, r in kernels),
                          tuple(name(n) for n in V.graph.get_output_names()))


def _cpp_fused(node: Any) -> bool:
    """Whether `node` is fused code that Inductor's C++ backend groups with its neighbours (CPU)."""
    from torch._inductor import config as inductor_config

    device = node.get_device()
    return (device is not None and device.type == "cpu" and inductor_config.cpu_backend == "cpp"
            and not (node.is_extern() or node.is_template() or node.is_foreach()) and bool(node.get_outputs()))


def _stays_in_kernel(node: Any, buf: Any) -> bool:
    """Whether Inductor's kernel for `node` keeps `buf` to itself (in registers, never allocated): its readers
    are all inside that kernel and the graph does not return it (Inductor's `remove_kernel_local_buffers`),
    except on CPU a reduction's result, which Inductor's C++ code stores (measured: LayerNorm's and
    BatchNorm's statistics, softmax's max and sum, read only inside their kernel, are allocated)."""
    if node.is_extern() or node.is_template():
        return False
    inside = {n.get_name() for n in node.get_nodes()}
    if not node.scheduler.can_buffer_be_removed_through_fusion(buf.get_name(), inside):
        return False
    return not (_cpp_fused(node) and buf.defining_op.is_reduction())


def _run_order(nodes: Sequence[Any]) -> list[Any]:
    """`nodes` (fused) in the order Inductor's code runs them: after the post-fusion pass Inductor
    reorders them to lower its own estimate of the peak (`config.reorder_for_peak_memory`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.memory import reorder_for_peak_memory
    from torch.utils._ordered_set import OrderedSet
    from torch._inductor.virtualized import V

    if not nodes or not inductor_config.reorder_for_peak_memory:
        return list(nodes)
    scheduler = nodes[0].scheduler
    return reorder_for_peak_memory(list(nodes), scheduler.name_to_buf, scheduler.name_to_fused_node,
                                   OrderedSet(V.graph.graph_inputs.keys()), OrderedSet(V.graph.get_output_names()))


def _multi_output_parent(buf: Any) -> str | None:
    """The buffer of the multi-output kernel (a fallback to an aten op returning several tensors) that
    `buf` is one output of, else None: that kernel allocates all of its outputs while its inputs live."""
    from torch._inductor.ir import MultiOutput

    node = buf.node
    if not isinstance(node, MultiOutput) or not node.inputs:
        return None
    return node.inputs[0].get_name()


class _Scheduled(Exception):
    def __init__(self, graph: ScheduledGraph):
        super().__init__("scheduled")
        self.graph = graph


def schedule_only(record: Callable[[ScheduledGraph], None]) -> Callable[..., Any]:
    """An `inner_compile` for `compile_fx` that lowers and fuses a graph, hands its `ScheduledGraph`
    to `record`, and makes no code (what it returns must never run)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    def stop(nodes):
        raise _Scheduled(scheduled_graph(nodes))

    def inner_compile(gm, example_inputs, **kwargs):
        try:
            with inductor_config.patch(_post_fusion_custom_pass=stop):
                compile_fx_inner(gm, example_inputs, **kwargs)
        except _Scheduled as done:
            record(done.graph)
        except Exception as error:  # Inductor wraps what a pass raises
            cause = _scheduled_in(error)
            if cause is None:
                raise
            record(cause.graph)
        return _never_run

    return inner_compile


def _scheduled_in(error: BaseException | None) -> _Scheduled | None:
    """The `_Scheduled` that `error` wraps (Inductor re-raises what its passes raise), else None."""
    seen = set()
    while error is not None and id(error) not in seen and not isinstance(error, _Scheduled):
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return error


def _never_run(*_args):
    raise RuntimeError("fxmem: a graph scheduled to measure its memory was run")


def simulate_fused(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, fused_fw: ScheduledGraph,
                   fused_bw: ScheduledGraph, num_user_outputs: int, allocator: AllocatorModel = EXACT
                   ) -> MemoryTimeline:
    """The step's live bytes as Inductor's code for `fw` and `bw` (planned graphs, scheduled as
    `fused_fw`, `fused_bw`) holds them; `num_user_outputs` as in `simulate_step`."""
    static: dict[Hashable, int] = {}
    fw_inputs = {n.name: n for n in fw.graph.find_nodes(op="placeholder")}
    for node in fw_inputs.values():
        static.update(storages_of(node))
    walker = Walker(static, allocator, allocator.workspaces(fw.graph.nodes, bw.graph.nodes))

    # forward: inputs are the step's (held throughout), buffers die after their last reader
    fw_keys = {name: ("fw", name) for written, _ in fused_fw.kernels for name, _ in written}
    inputs = {("input", name) for name in fw_inputs}  # held by the step throughout
    fw_keys.update({name: ("input", name) for name in fw_inputs})
    returned = {fw_keys[n] for n in fused_fw.outputs if n in fw_keys}
    _walk(walker, fused_fw, fw_keys, "forward", keep=returned | inputs)
    walker.retain(returned | inputs)

    # backward's inputs: the values forward returned (by the planned graphs' names), then the tangents
    fx_outputs = graph_outputs(fw)
    by_fx_name = {n.name: fw_keys[b] for n, b in zip(fx_outputs, fused_fw.outputs)
                  if isinstance(n, torch.fx.Node) and b in fw_keys}
    held_by_user = {fw_keys[b] for b in fused_fw.outputs[:num_user_outputs] if b in fw_keys}
    bw_keys: dict[str, Hashable] = {}
    for node in bw.graph.find_nodes(op="placeholder"):
        if node.name in by_fx_name:
            bw_keys[node.name] = by_fx_name[node.name]
        else:  # a tangent: autograd makes it before backward runs
            walker.allocate({("tangent", node.name): sum(storages_of(node).values())})
            bw_keys[node.name] = ("tangent", node.name)
    bw_keys.update({name: ("bw", name) for written, _ in fused_bw.kernels for name, _ in written})
    grads = {bw_keys[n] for n in fused_bw.outputs if n in bw_keys}
    _walk(walker, fused_bw, bw_keys, "backward", keep=held_by_user | grads | inputs)
    return walker.timeline()


def _walk(walker: Walker, graph: ScheduledGraph, keys: dict[str, Hashable], phase: str, keep: set[Hashable]
          ) -> None:
    """Run `graph`'s kernels in order as Inductor's code does: every buffer a kernel writes is allocated
    before it (Inductor's in-place reuse is off: `inductor_step.NO_INPLACE`); a buffer or freeable input
    dies after its last reader unless in `keep` (what the graph returns among it)."""
    last: dict[Hashable, int] = {}
    for i, (written, read) in enumerate(graph.kernels):
        for name in read:
            if name in keys:
                last[keys[name]] = i
    for i, (written, read) in enumerate(graph.kernels):
        walker.allocate({keys[name]: nbytes for name, nbytes in written})
        walker.record(written[0][0] if written else f"kernel{i}", phase)
        for key in {keys[n] for n in read if n in keys} | {keys[n] for n, _ in written}:
            if last.get(key, i) == i and key not in keep:
                walker.live.pop(key, None)
