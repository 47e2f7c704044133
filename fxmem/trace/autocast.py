"""Where backward runs relative to `torch.autocast`, and the backward graph traced for it.

Eager's backward runs under the autocast active where `backward()` is called; AOTAutograd traces the
backward once, under `torch._functorch.config.backward_pass_autocast`; at torch's default
("same_as_forward") fxmem traces it outside autocast, where PyTorch advises running it (`expected_state`). Most backward graphs do not depend on it (a matmul autocast ran in bf16 has a
bf16 backward either way), but fp32 matmuls that forward ran with autocast excluded do: CPU
`scaled_dot_product_attention` with dropout runs its math kernel, which computes in fp32, and eager
runs those matmuls' backward in bf16 under autocast and in fp32 outside it. The engine watches where
each step's backward runs (`watch_backward`); when that is not where the graph was traced, it traces
the joint graph again for where it ran (on fake tensors) and, if that graph differs, warns once and
plans the signature again for the backward seen. Reads the live autocast state and torch's config; writes nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

DEVICES = ("cpu", "cuda")
State = tuple  # ((device_type, dtype), ...) of the autocasts enabled; () is no autocast


def live_state() -> State:
    """The autocasts enabled here and now."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in DEVICES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: State) -> Iterator[None]:
    """Autocast exactly as `state` says (the devices enabled here and not in `state` are switched off)."""
    wanted = dict(state)
    with contextlib.ExitStack() as stack:
        for device in dict(live_state()).keys() | wanted.keys():
            stack.enter_context(torch.autocast(device, dtype=wanted.get(device), enabled=device in wanted))
        yield


def describe(state: State) -> str:
    """' autocast(cpu:bfloat16)' for an autocast state, '' for none (the input signature's spelling)."""
    on = [f"{d}:{str(dtype).replace('torch.', '')}" for d, dtype in state]
    return f" autocast({', '.join(on)})" if on else ""


def where(state: State) -> str:
    """'outside autocast' or 'under autocast(cpu:bfloat16)', for messages."""
    return f"under{describe(state)}" if state else "outside autocast"


def traced_state(forward: State, config: Any = None) -> State:
    """The autocast AOTAutograd traces backward under, for a forward under `forward`, with
    `backward_pass_autocast` = `config` (None: torch's current setting)."""
    config = torch._functorch.config.backward_pass_autocast if config is None else config
    if config == "same_as_forward":
        return forward
    if config == "off":
        return ()
    return tuple((kw.get("device_type", kw.get("device")), kw.get("dtype") or torch.get_autocast_dtype(
        kw.get("device_type", kw.get("device")))) for kw in config)


def expected_state(forward: State, config: Any = None) -> State:
    """Where a step's backward is planned to run before it is seen: where torch's `backward_pass_autocast`
    says, where it is set; at its default ("same_as_forward"), outside autocast, as PyTorch advises and as
    `Trainer` and Accelerate call it, so the usual loop is eager's from its first step."""
    config = torch._functorch.config.backward_pass_autocast if config is None else config
    return () if config == "same_as_forward" else traced_state(forward, config)


def config_for(backward: State, forward: State) -> Any:
    """The `backward_pass_autocast` setting that traces backward under `backward`."""
    if backward == forward:
        return "same_as_forward"
    if not backward:
        return "off"
    return [{"device_type": d, "dtype": dtype} for d, dtype in backward]


def signature_suffix(backward: State, forward: State) -> str:
    """'' when backward is traced where forward runs; else where it is traced (it is part of the plan)."""
    return "" if backward == forward else f", backward {where(backward)}"


def watch_backward(outputs: Iterable[Any], seen: Callable[[State], None]) -> None:
    """Call `seen(live_state())` when backward reaches the autograd nodes that made `outputs` (the
    engine runs them under the autocast active where `backward()` was called)."""
    nodes = {id(t.grad_fn): t.grad_fn for t in torch.utils._pytree.tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grads: seen(live_state()))


def mismatch_warning(model: str, traced: State, ran: State, forward: State) -> str:
    """The warning for a backward that ran elsewhere than where its graph was traced, and depends on it."""
    return (f"fxmem: {model}'s backward ran {where(ran)} and its graph was planned for backward {where(traced)}, so "
            f"this step's gradients differ from eager's in rounding; the next call plans for backward {where(ran)} "
            f"(or set torch._functorch.config.backward_pass_autocast = {config_for(ran, forward)!r} before the "
            "first step; docs/autocast.md)")
