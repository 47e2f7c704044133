"""Offload pass: saved values go to host memory after their last forward use and come back before
their first backward use, on side streams (one per direction) so the copies overlap compute.

Reads the forward and backward graphs the recompute pass extracted, the offloaded node names and
each node's estimated seconds; rewrites them in place: forward copies the value out after its last
use (`copy_out`), keeps the device copy referenced until the copy is predicted to end
(`release`), and returns the host copy in its place; backward issues the copy back (`copy_in`)
early enough to hide it (same first-in first-out link model as `fxmem.solve.problem.transfer_schedule`)
and waits for it (`wait_in`) just before the first use. Host-side nodes carry
`meta["fxmem"]["host"] = True` (the memory simulator does not count them). On a CPU the copies
are plain host copies, so the semantics are testable anywhere. `tag_offload` marks joint nodes
`meta["should_offload"]`, the key torch's own activation-offloading pass reads under compile.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx

from fxmem.passes.runner import StepGraphs
from fxmem.solve.problem import copies_in, copies_out
from fxmem.meta_keys import DECISION, HOST, NAMESPACE, OFFLOAD, tags

_STREAMS: dict[torch.device, tuple] = {}


def _side_streams(device: torch.device) -> tuple:
    """(device-to-host, host-to-device) side streams of a CUDA device, made once."""
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]


def copy_out(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and asynchronous on the device-to-host stream for CUDA tensors."""
    if t.device.type != "cuda" or not torch.cuda.is_available():
        return t.to("cpu", copy=True)
    d2h, _ = _side_streams(t.device)
    d2h.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(d2h):
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
    t.record_stream(d2h)  # the allocator reuses t's memory only once the copy has ended
    return host


def release(device_copy: torch.Tensor, host: torch.Tensor) -> None:
    """Holds the device copy until this point of the graph (when its copy out is predicted to end)."""
    return None


def copy_in(host: torch.Tensor, device: str) -> torch.Tensor:
    """`host` back on `device`: asynchronous on the host-to-device stream for CUDA devices."""
    target = torch.device(device)
    if target.type != "cuda" or not torch.cuda.is_available():
        return host.to(target, copy=True)
    d2h, h2d = _side_streams(target)
    h2d.wait_stream(d2h)  # the copy out of this value has ended
    with torch.cuda.stream(h2d):
        dev = host.to(target, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(h2d)
    dev.record_stream(torch.cuda.current_stream(target))
    dev._fxmem_ready = ready
    return dev


def wait_in(dev: torch.Tensor) -> torch.Tensor:
    """`dev` once its copy back has ended (the compute stream waits for that copy only)."""
    ready = dev.__dict__.pop("_fxmem_ready", None)
    if ready is not None:
        torch.cuda.current_stream(dev.device).wait_event(ready)
    return dev


def tag_offload(joint: torch.fx.GraphModule, offloaded: Iterable[str]) -> torch.fx.GraphModule:
    names = set(offloaded)
    for node in joint.graph.nodes:
        if node.name in names:
            tags(node)[DECISION] = "offload"
            node.meta["should_offload"] = True
    return joint


def _host_val(val):
    """A fake value like `val` with its own storage (the host copy)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty_like(val, device="meta")
    with mode:
        return torch.empty_like(val)


def _times(nodes: list[torch.fx.Node], seconds: Mapping[str, float]) -> list[float]:
    """Start time of each node, running them in order."""
    starts, now = [], 0.0
    for node in nodes:
        starts.append(now)
        now += seconds.get(node.name, 0.0) if node.op == "call_function" else 0.0
    return starts


def _at_time(nodes: list[torch.fx.Node], starts: list[float], when: float, lo: int, hi: int) -> int:
    """Index of the node running at `when`, clamped to [lo, hi]."""
    index = lo
    for i in range(lo, hi + 1):
        if starts[i] <= when:
            index = i
        else:
            break
    return index


def offload_pass(graphs: StepGraphs, plan: Any) -> StepGraphs:
    """The step's graphs with `plan.offload` copied to host memory and back, timed by
    `graphs.seconds` and `graphs.host_link`; joint nodes tagged `meta["should_offload"]`."""
    if not plan.offload:
        return graphs
    if graphs.host_link is None:
        raise ValueError(f"the plan offloads {len(plan.offload)} values but device {plan.device} has no host link; "
                         "give it one with DeviceSpec.with_link(...)")
    tag_offload(graphs.joint, plan.offload)
    fw, bw = offload(graphs.fw, graphs.bw, plan.offload, graphs.seconds, graphs.host_link.seconds)
    return graphs.replace(fw=fw, bw=bw)


def offload(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, offloaded: Iterable[str],
            seconds: Mapping[str, float], transfer_s: Callable[[int], float]
            ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Rewrite `fw` and `bw` so the saved values named in `offloaded` live on the host in between.
    `seconds[name]`: a node's estimated time; `transfer_s(nbytes)`: one copy over the host link."""
    saved = {n.name: n for n in bw.graph.find_nodes(op="placeholder") if n.users}
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    names = [n for n in offloaded if n in saved and n in fw_nodes]
    if not names:
        return fw, bw
    _rewrite_forward(fw, [fw_nodes[n] for n in names], seconds, transfer_s)
    _rewrite_backward(bw, [saved[n] for n in names], seconds, transfer_s)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return fw, bw


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return int(val.untyped_storage().nbytes())


def _rewrite_forward(fw: torch.fx.GraphModule, values: list[torch.fx.Node], seconds, transfer_s) -> None:
    graph, output = fw.graph, fw.graph.output_node()
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    starts = _times(nodes, seconds)
    last_use = {v: max([position[u] for u in v.users if u is not output] + [position[v]]) for v in values}
    issued = [starts[last_use[v]] + (seconds.get(nodes[last_use[v]].name, 0.0)) for v in values]
    ends = copies_out(issued, [transfer_s(_nbytes(v)) for v in values])
    for v, end in zip(values, ends):
        after = nodes[last_use[v]]
        with graph.inserting_after(after):
            host = graph.call_function(copy_out, (v,))
        host.meta["val"] = _host_val(v.meta["val"])
        host.meta[NAMESPACE] = {HOST: True, OFFLOAD: v.name}
        lo, hi = last_use[v] + 1, len(nodes) - 2  # hi: the last node before the output
        anchor = nodes[_at_time(nodes, starts, end, lo, hi) if lo <= hi else last_use[v]]
        with graph.inserting_after(host if anchor is after else anchor):
            graph.call_function(release, (v, host))
        output.args = tuple(torch.fx.node.map_arg(output.args, lambda n, v=v, h=host: h if n is v else n))


def _rewrite_backward(bw: torch.fx.GraphModule, placeholders: list[torch.fx.Node], seconds, transfer_s) -> None:
    graph = bw.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    starts = _times(nodes, seconds)
    first_body = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    first_use = {p: min(position[u] for u in p.users) for p in placeholders}
    begins = copies_in([starts[first_use[p]] for p in placeholders],
                       [transfer_s(_nbytes(p)) for p in placeholders])
    for p, begin in zip(placeholders, begins):
        users = list(p.users)
        issue = _at_time(nodes, starts, begin, first_body, first_use[p])
        with graph.inserting_before(nodes[issue]):
            dev = graph.call_function(copy_in, (p, str(p.meta["val"].device)))
        with graph.inserting_before(nodes[first_use[p]]):
            ready = graph.call_function(wait_in, (dev,))
        # The device copy stands for the saved value: backward views of it share its storage.
        dev.meta["val"] = ready.meta["val"] = p.meta["val"]
        p.meta[NAMESPACE] = {HOST: True, OFFLOAD: p.name}
        for user in users:
            user.replace_input_with(p, ready)
