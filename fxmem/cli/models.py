"""How `fxmem-plan` finds and builds the model it plans: a zoo preset or a `package.module:factory`,
optionally on the meta device, refusing in one line (CliError) a model the host cannot hold.

Reads the zoo (`fxmem.models`), the user's factory module and the host's free memory (/proc/meminfo,
the cgroup's limit); writes nothing.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any, Callable


class CliError(Exception):
    """A message for the person at the terminal; the command exits with status 2."""



def _zoo_overrides(name: str, seq_len: int | None) -> dict[str, int]:
    from fxmem import models

    if seq_len is None:
        return {}
    if not hasattr(models.preset_config(name), "block_size"):
        seq = [m for m in models.list_models() if hasattr(models.preset_config(m), "block_size")]
        raise CliError(f"--seq-len applies to sequence models ({', '.join(seq)}), not {name}")
    return {"block_size": seq_len}


def _factory_fn(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"cannot read {spec!r} as package.module:factory (e.g. mypkg.models:make)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a factory next to the user's files, as with python -m
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CliError(f"cannot import {module_name!r} for {spec!r}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"{module_name} has no callable {attr!r} (from {spec!r})")
    return factory


def model_factory(spec: str, seq_len: int | None = None, meta: bool = False
                  ) -> Callable[[int | None], tuple[Any, tuple]]:
    """`make(batch_size) -> (model, example_inputs)` for a zoo preset (the model is built once) or a
    user factory, called as factory(batch_size=N, seq_len=L) with the arguments given; with `meta`,
    under `torch.device("meta")` (no weights made; the inputs a factory makes are meta tensors too)."""
    import torch

    from fxmem import models

    building = (lambda: torch.device("meta")) if meta else contextlib.nullcontext

    if ":" not in spec:
        if spec not in models.list_models():
            raise CliError(f"unknown model {spec!r}. Presets: {', '.join(models.list_models())}; "
                           "or give package.module:factory")
        overrides = _zoo_overrides(spec, seq_len)
        if not meta:
            _check_host_memory(spec, overrides, seq_len)
        with building():
            model = models.from_name(spec, **overrides)
        return lambda batch: (model, models.example_inputs(spec, batch, **overrides))
    factory = _factory_fn(spec)

    def make(batch: int | None) -> tuple[Any, tuple]:
        kwargs = {k: v for k, v in (("batch_size", batch), ("seq_len", seq_len)) if v is not None}
        try:
            with building():
                made = factory(**kwargs)
        except Exception as exc:  # the user's code: say which call failed, in one line
            call = f"{factory.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
            hint = " (a factory takes batch_size= and seq_len= when those flags are given)" \
                if isinstance(exc, TypeError) and "argument" in str(exc) else ""
            raise CliError(f"{spec}: {call} raised {type(exc).__name__}: {exc}{hint}") from None
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
            got = type(made[0] if isinstance(made, tuple) and len(made) == 2 else made).__name__
            raise CliError(f"{spec} must return (model, example_inputs) with an nn.Module model, got {got}")
        return made[0], tuple(made[1]) if isinstance(made[1], (tuple, list)) else (made[1],)

    return make


def available_memory_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, or the cgroup's limit less its use if lower."""
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append(int(limit) - int(g.read()))
    return min(found) if found else None


def _check_host_memory(spec: str, overrides: dict[str, int], seq_len: int | None) -> None:
    """Planning runs on fake tensors, but the model is built for real: its parameters and buffers (a
    causal mask grows with the square of --seq-len), the buffers twice while the graph is captured.
    Counted on the meta device first; more than the machine has left is refused before building."""
    import torch

    from fxmem import models
    from fxmem.errors import fmt_bytes

    with torch.device("meta"):
        model = models.from_name(spec, **overrides)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = {name: b.numel() * b.element_size() for name, b in model.named_buffers()}
    need = params + 2 * sum(buffers.values())
    available = available_memory_bytes()
    if available is None or need <= available:
        return
    what = f"{spec} at --seq-len {seq_len}" if seq_len is not None else spec
    largest = max(buffers, key=buffers.__getitem__, default=None)
    detail = (f"buffers {fmt_bytes(sum(buffers.values()))}, held twice while capturing; the largest, {largest}, "
              f"is {fmt_bytes(buffers[largest])}") if buffers else ""
    raise CliError(f"building {what} for planning needs about {fmt_bytes(need)} of host memory (parameters "
                   f"{fmt_bytes(params)}" + (f", {detail}" if detail else "") + f"), more than the "
                   f"{fmt_bytes(available)} available; use a smaller " + ("--seq-len" if seq_len else "model")
                   + ", --meta (planning needs no weights), or a machine with more memory")
