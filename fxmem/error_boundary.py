"""Errors at fxmem's public boundary: one readable message and a traceback that ends at fxmem's own frame.

`public` wraps the functions a user calls (`fxmem.plan`, `fxmem.optimize`, an optimized module's call,
`fxmem.estimate`, ...); `for_dynamo` does the same for the torch.compile backend. What is raised is
sorted three ways:
- fxmem's own refusals (an `FxmemError`, or a `raise` statement in fxmem's code, e.g. a ValueError on
  an argument): the message is the whole story, so the traceback stops at the public function and the
  exception it was raised while handling is not printed (still there as `__context__`); a cause that
  carries torch's error (`TraceError`) keeps its message and the frames of the user's code only.
- errors of the user's code (the model's forward or `loss_fn`, reached through AOTAutograd or
  torch.export): the traceback keeps the user's frames and drops torch's and fxmem's.
- anything else (an error inside fxmem or torch itself): untouched, with every frame.
`FXMEM_FULL_TRACEBACK=1` turns all of this off. Reads and writes nothing else.
"""
from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import sys
import sysconfig
import threading
import types
import warnings
from typing import Any, Callable, TypeVar

from fxmem.errors import FxmemError

FULL_TRACEBACK = "FXMEM_FULL_TRACEBACK"
NOTE = f"(fxmem left out the frames inside torch and fxmem; {FULL_TRACEBACK}=1 shows them)"
F = TypeVar("F", bound=Callable[..., Any])
_calls = threading.local()  # how deep in public functions this thread is (fxmem.plan inside max_batch_size)


def public(fn: F) -> F:
    """`fn` with errors shortened as the module docstring says, where it is called by the user (a public
    function fxmem calls itself raises as it is: fxmem may catch it, and the outer call shortens it)."""
    @functools.wraps(fn)
    def at_boundary(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_calls, "depth", 0)
        _calls.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if depth or not shorten(exc):
                raise
            error = exc
        finally:
            _calls.depth = depth
        raise error  # fxmem's error, its traceback shortened (FXMEM_FULL_TRACEBACK=1 keeps every frame)
    return at_boundary  # type: ignore[return-value]


def for_dynamo(backend: F) -> F:
    """A torch.compile backend whose errors reach the user as `public`'s do. Dynamo wraps a backend's error
    in BackendCompilerFailed with its own frames, except a `ShortenTraceback`, which it cuts at
    `first_useful_frame`: the error is raised as its own type made a ShortenTraceback too."""
    @functools.wraps(backend)
    def at_boundary(*args: Any, **kwargs: Any) -> Any:
        try:
            return backend(*args, **kwargs)
        except Exception as exc:
            if not shorten(exc):
                raise
            error = _passed_through_dynamo(exc, sys._getframe())
        raise error  # fxmem's error, its traceback shortened (FXMEM_FULL_TRACEBACK=1 keeps every frame)
    return at_boundary  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _dynamo_class(cls: type) -> type:
    from torch._dynamo.exc import ShortenTraceback

    return type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _passed_through_dynamo(exc: Exception, frame: types.FrameType) -> Exception:
    """`exc` as an instance of `_dynamo_class(type(exc))`, whose traceback Dynamo cuts at `frame`."""
    cls = _dynamo_class(type(exc))
    try:
        exc.__class__ = cls
    except TypeError:  # a built-in exception type's instance: made again with its arguments
        made = cls(*exc.args)
        made.__cause__, made.__context__, made.__suppress_context__ = exc.__cause__, exc, True
        made._fxmem_kind = getattr(exc, "_fxmem_kind", None)  # type: ignore[attr-defined]
        made.with_traceback(exc.__traceback__)
        exc = made
    exc.first_useful_frame = frame  # type: ignore[attr-defined]
    exc._torch_dynamo_tracer_output = None  # type: ignore[attr-defined]
    exc.frame_exec_strategy = None  # type: ignore[attr-defined]
    return exc


def shorten(exc: BaseException) -> bool:
    """Trim `exc` (its traceback, what is printed of its context and cause) in place for raising again
    from a public function; False: leave it as it is."""
    if os.environ.get(FULL_TRACEBACK, "") not in ("", "0"):
        return False
    kind = getattr(exc, "_fxmem_kind", None) or kind_of(exc)
    if kind == "internal":
        return False
    exc._fxmem_kind = kind  # type: ignore[attr-defined]
    exc.__suppress_context__ = True
    if kind == "own":
        exc.with_traceback(None)
        if exc.__cause__ is not None:
            _user_frames_only(exc.__cause__)
    else:
        _user_frames_only(exc)
    return True


def kind_of(exc: BaseException) -> str:
    """"own" (fxmem refused), "user" (raised in the user's code) or "internal" (anything else)."""
    if isinstance(exc, FxmemError):
        return "own"
    frames = list(_frames(exc.__traceback__))
    outer = [tb for tb in frames if not _in(tb, _torch_dirs())]  # where torch was called from, innermost last
    if not outer or isinstance(exc, AssertionError):
        return "internal"
    last = outer[-1]
    if not _in(last, _fxmem_dirs()):
        return "user"
    raised_here = last is frames[-1] and linecache.getline(
        last.tb_frame.f_code.co_filename, last.tb_lineno).lstrip().startswith("raise")
    return "own" if raised_here else "internal"


def _user_frames_only(exc: BaseException) -> None:
    """Keep the frames of `exc` (and of the causes it chains) that are not torch's, fxmem's or Python's."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = list(_frames(exc.__traceback__))
        kept = [tb for tb in frames if not _internal(tb)]
        if len(kept) < len(frames) and NOTE not in getattr(exc, "__notes__", ()):
            exc.add_note(NOTE)
        tb = None
        for old in reversed(kept):
            tb = types.TracebackType(tb, old.tb_frame, old.tb_lasti, old.tb_lineno)
        exc.with_traceback(tb)
        exc.__suppress_context__ = True
        exc = exc.__cause__


def _frames(tb: types.TracebackType | None):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _in(tb: types.TracebackType, folders: tuple[str, ...]) -> bool:
    return os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(folders)


def _internal(tb: types.TracebackType) -> bool:
    """A frame of torch, fxmem (not its model zoo), Python's standard library, or code torch generated."""
    filename = tb.tb_frame.f_code.co_filename
    if filename.startswith("<"):  # code made with exec/eval: the user's only as a script's own (`python -c`)
        return tb.tb_frame.f_globals.get("__name__") != "__main__"
    path = os.path.realpath(filename)
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return (is_library_file(path) and not path.startswith(_zoo_dirs())) or \
        (path.startswith(_stdlib_dirs()) and not installed)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, naming the innermost frame outside torch and fxmem (the user's `loss.backward()`, for a warning
    raised inside backward), not fxmem's own line."""
    frame, level = sys._getframe(1), 2
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def is_library_file(filename: str) -> bool:
    """True for a source file of torch or of fxmem itself (its passes and model zoo included), by where the
    packages are loaded from (not by folder names: a user's own code may live in a folder called fxmem or
    torch). The one rule for "library code"; tracebacks keep a zoo model's frames all the same, as the
    user's model (`_internal`)."""
    return os.path.realpath(filename).startswith(_library_dirs())


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    return tuple(sorted(set(_torch_dirs() + _fxmem_dirs() + _zoo_dirs())))


@functools.lru_cache(maxsize=1)
def _torch_dirs() -> tuple[str, ...]:
    import functorch
    import torch

    return _folders(torch.__path__, functorch.__path__)


@functools.lru_cache(maxsize=1)
def _fxmem_dirs() -> tuple[str, ...]:
    """fxmem's package and its passes (each a folder of its own), not its model zoo."""
    return _folders(*_subpackage_paths("fxmem", "fxmem.passes"))


@functools.lru_cache(maxsize=1)
def _zoo_dirs() -> tuple[str, ...]:
    return _folders(*_subpackage_paths("fxmem.models"))


def _subpackage_paths(*names: str) -> list:
    """Where fxmem's packages are loaded from, found without loading them."""
    return [importlib.util.find_spec(name).submodule_search_locations for name in names]


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[str, ...]:
    return tuple({os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "") for k in ("stdlib", "platstdlib")})


def _folders(*paths: Any) -> tuple[str, ...]:
    return tuple(sorted({os.path.join(os.path.realpath(d), "") for path in paths for d in path}))
