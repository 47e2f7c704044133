"""Plans kept on disk, so that a plan made once is not made again: in a second process, for the same
model, inputs, budget, target and fxmem/torch versions, as torch.compile's FX graph cache keeps its code.

An entry is keyed by everything a plan depends on: the joint graph's fingerprint (op, target, shape and
dtype of every node), every field of the request that decides or describes the plan, the versions of
torch and OR-Tools, and a digest of fxmem's own source files (a plan made by other code is made again).
Reads and writes `<dir>/plans/<key>.json` under `FXMEM_CACHE_DIR` (default: `$XDG_CACHE_HOME/fxmem`,
else `~/.cache/fxmem`); `FXMEM_CACHE=0` turns it off, as does `cache=False` on a request. An entry that
is unreadable, of another schema or for another graph is planned again with one line saying so; a folder
that cannot be written plans without the cache and warns once. Writes are atomic (a file renamed into
place), so processes planning side by side never read half an entry.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import pathlib
import warnings
from typing import Any, Callable

from fxmem.errors import PlanMismatchError
from fxmem.user_cache import cache_dir, write_atomic
from fxmem.planner.plan import Plan

log = logging.getLogger("fxmem")

ENTRY_SCHEMA = 1


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of fxmem's source files (its passes included): plans made by other code are not reused."""
    import fxmem
    import fxmem.passes

    digest = hashlib.sha256()
    for folder in sorted({*fxmem.__path__, *fxmem.passes.__path__}):
        for path in sorted(pathlib.Path(folder).rglob("*.py")):
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import torch

    try:
        from ortools import __version__ as ortools_version
    except ImportError:  # pragma: no cover - ortools is a dependency
        ortools_version = "none"
    return {"torch": torch.__version__, "ortools": ortools_version, "fxmem_code": code_digest()}


def _plain(value: Any) -> Any:
    """A request field as JSON: dataclasses as dicts, the rest as it is or its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def entry_key(fingerprint: str, request: Any, extra: dict[str, Any] | None = None) -> tuple[str, dict]:
    """The cache key of a plan for the joint graph `fingerprint` under `request` (a PlanRequest, whose
    `plan` and `cache` fields do not decide the plan), and the fields it hashes."""
    fields = {f.name: _plain(getattr(request, f.name)) for f in dataclasses.fields(request)
              if f.name not in ("plan", "cache")}
    keyed = {"fingerprint": fingerprint, "request": fields, "versions": _versions(), "extra": extra or {}}
    text = json.dumps(keyed, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32], keyed


def cached_plan(fingerprint: str, request: Any, make: Callable[[], Plan],
                extra: dict[str, Any] | None = None) -> Plan:
    """The plan kept for this graph and request, else `make()`'s, kept for next time."""
    folder = cache_dir() if getattr(request, "cache", True) else None
    if folder is None:
        return make()
    key, keyed = entry_key(fingerprint, request, extra)
    path = folder / "plans" / f"{key}.json"
    plan = _read(path, fingerprint)
    if plan is not None:
        log.info("fxmem: plan read from the cache (%s)", path)
        return plan
    plan = make()
    _write(path, {"schema": ENTRY_SCHEMA, "key": keyed, "plan": json.loads(plan.to_json())})
    return plan


def _read(path: pathlib.Path, fingerprint: str) -> Plan | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("fxmem: cache entry %s cannot be read (%s); planning again", path, exc)
        return None
    try:
        entry = json.loads(text)
        if entry.get("schema") != ENTRY_SCHEMA:
            raise PlanMismatchError(f"entry schema {entry.get('schema')!r}, this fxmem writes {ENTRY_SCHEMA}")
        plan = Plan.from_json(json.dumps(entry["plan"]), source=str(path))
        if plan.fingerprint != fingerprint:
            raise PlanMismatchError("it was made for another graph")
    except (ValueError, KeyError, TypeError, AttributeError, PlanMismatchError) as exc:
        warnings.warn(f"fxmem: ignoring the cache entry {path}: {exc}; planning again", stacklevel=2)
        return None
    return plan


def _write(path: pathlib.Path, entry: dict) -> None:
    write_atomic(path, entry, "plans are not cached")
