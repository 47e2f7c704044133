"""Kernel prices measured once, kept on disk: a later plan (in this process or another) reads the seconds
measured before for the same op and argument signature on the same device, instead of timing it again, so
plans priced by measurement (`calibrate`) are the same in every run.

Reads and writes `<dir>/prices/<device>.json` under `fxmem.user_cache.cache_dir()` (`FXMEM_CACHE=0`: nothing
kept), one file per device kind and name (`torch.cuda.get_device_name`, the CPU's model), keyed within by
torch's version and the op's signature. `fxmem.price.kernel_timer` asks `recorded` before timing and `record`s
what it settles on; `flush` writes what is new (the planner calls it after pricing a graph; what is left, at exit). A file that
cannot be read or is not a record is ignored with one warning and written anew.
"""
from __future__ import annotations

import atexit
import functools
import json
import platform
import re
import warnings
from typing import Hashable

import torch

from fxmem.user_cache import cache_dir, write_atomic

SCHEMA = 1
_loaded: dict[str, dict[str, float]] = {}  # file name -> its prices, as read and recorded since
_dirty: set[str] = set()
_at_exit: list = []


@functools.lru_cache(maxsize=None)
def device_name(device: str) -> str:
    """The file a device's prices live in: its kind and model (two GPUs of one model share their prices)."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        model = torch.cuda.get_device_name(torch.device(device))
    else:
        model = _cpu_model()
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{kind}-{model}").strip("-")[:100]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(signature: Hashable) -> str:
    return f"{torch.__version__}|{signature!r}"


def _prices(device: str) -> dict[str, float] | None:
    folder = cache_dir()
    if folder is None:
        return None
    name = device_name(device)
    if name not in _loaded:
        path = folder / "prices" / f"{name}.json"
        try:
            data = json.loads(path.read_text())
            if data.get("schema") != SCHEMA or not isinstance(data.get("seconds"), dict):
                raise ValueError(f"schema {data.get('schema')!r}, this fxmem writes {SCHEMA}")
            _loaded[name] = {k: float(v) for k, v in data["seconds"].items()}
        except FileNotFoundError:
            _loaded[name] = {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            warnings.warn(f"fxmem: ignoring the kernel prices in {path}: {exc}; timing again", stacklevel=3)
            _loaded[name] = {}
    return _loaded[name]


def recorded(device: str, signature: Hashable) -> float | None:
    """The seconds kept for `signature` (an op and its arguments' shapes, strides, dtypes) on `device`."""
    prices = _prices(device)
    return None if prices is None else prices.get(_key(signature))


def record(device: str, signature: Hashable, seconds: float) -> None:
    """Keep `seconds` for `signature` on `device` (written by `flush`)."""
    prices = _prices(device)
    if prices is not None and prices.get(_key(signature)) != seconds:
        prices[_key(signature)] = seconds
        if not _dirty and not _at_exit:
            _at_exit.append(atexit.register(flush))  # what a plan's pricing did not flush, at the process's end
        _dirty.add(device_name(device))


def flush() -> None:
    """Write the prices recorded since the last flush."""
    folder = cache_dir()
    if folder is None:
        _dirty.clear()
        return
    for name in sorted(_dirty):
        write_atomic(folder / "prices" / f"{name}.json", {"schema": SCHEMA, "seconds": _loaded[name]},
                     "kernel prices are not kept")
    _dirty.clear()


def forget() -> None:
    """Drop what was read (tests; a new process)."""
    _loaded.clear()
    _dirty.clear()
