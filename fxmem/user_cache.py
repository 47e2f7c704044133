"""The folder fxmem keeps what it made for next time (plans, measured kernel prices), and its atomic writes.

`FXMEM_CACHE_DIR` (default: `$XDG_CACHE_HOME/fxmem`, else `~/.cache/fxmem`); `FXMEM_CACHE=0` turns every
record off. Reads the environment; writes files under that folder, each renamed into place (processes side
by side never read half a file); a folder that cannot be written warns once and is not written again.
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
import warnings

_warned_unwritable: set[str] = set()


def cache_dir() -> pathlib.Path | None:
    """Where plans and prices are kept, or None where the cache is off (`FXMEM_CACHE=0`)."""
    if os.environ.get("FXMEM_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    chosen = os.environ.get("FXMEM_CACHE_DIR")
    if chosen:
        return pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "fxmem"


def write_atomic(path: pathlib.Path, entry: dict, what: str) -> bool:
    """Write `entry` as JSON at `path` (a file renamed into place); False, with one warning per folder saying
    `what` ("plans are not cached"), where the folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            json.dump(entry, tmp, sort_keys=True, indent=1)
        os.replace(tmp.name, path)
        return True
    except OSError as exc:
        folder = str(path.parent.parent)
        if folder not in _warned_unwritable:
            _warned_unwritable.add(folder)
            warnings.warn(f"fxmem: {what}: {folder} cannot be written ({exc}); set FXMEM_CACHE_DIR to a writable "
                          "folder, or FXMEM_CACHE=0 to run without a cache", stacklevel=3)
        return False
