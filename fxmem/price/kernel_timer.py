"""Kernel timing: how long each op of a graph takes on the device that is here, measured.

Reads graph nodes (their target and `meta["val"]` fake tensors: shapes, strides, dtypes, device);
runs each distinct op once per signature on real tensors made like its inputs (random floats,
ones for integers, so indices stay in range), warms up, then times it with the wall clock in three
windows, keeping the fastest (another process on the machine slows a window, never speeds one): the
time of one call as a training step sees it, the dispatch and launch overhead included. On a GPU a
window is back-to-back calls after a synchronisation (a GPU kernel shorter than its launch is
launch-bound); on a CPU, for operands of 2 MiB and more, the median of calls each timed alone after
the caches are flushed, as a step's kernels mostly find such operands out of cache.
Caches the seconds per signature; each timer answers the fastest its process has measured for a
signature (a virtual machine's kernels run up to 1.6x slower for seconds at a time, so one timer's windows can
all fall in a slow spell), measured by the first MEASUREMENTS timers to meet it; keeps them on disk (`fxmem.price.price_record`), so a later
plan, here or in another process, reads them rather than timing again. Per-element arithmetic (`compute_seconds`) is timed on one CPU
thread and shared by the step's threads: a parallel kernel beside another busy process is timed by the
scheduler, not by its arithmetic. Ops it cannot run, and ops whose tensors would
take more than `max_bytes`, are left to the caller's roofline estimate (`seconds` returns None).
"""
from __future__ import annotations

import contextlib
import operator
import statistics
import time
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from fxmem.price import price_record
from fxmem.price.memory import tensors_of

COMPUTE_NUMEL = 1 << 16  # elements an op's arithmetic is timed on: they stay in cache, so memory is not the limit
NARROW_NUMEL = 1 << 18  # elements one-byte loads and stores are timed on (on 1 << 16, a third of their cost here)
MIN_SECONDS = 2e-3  # time each signature for at least this long (more calls for short kernels)
MAX_CALLS = 50
_MEASURED: dict[Hashable, float] = {}  # (device, signature) -> the fastest seconds this process measured
_TIMES_MEASURED: dict[Hashable, int] = {}  # (device, signature) -> how many timers of this process measured it
MEASUREMENTS = 3  # timers of a process that measure a signature; later ones answer the fastest of theirs. Fitting
# one plan makes a timer per try (gpt-small under Inductor: 20 timers, 941 measurements, 190 s of its 540)
_COMPILED: dict[Hashable, tuple[Callable, Callable]] = {}  # (device, dtype, what) -> a pair Inductor compiled
COLD_CALLS = 5  # calls a window of an op on a CPU times, each after the caches are flushed
COLD_MIN_BYTES = 2 << 20  # operands (inputs) from this size are timed cold: a core's L2 here. A smaller op's cost is its
# dispatch, which runs hot in a step; timed after a flush (the interpreter's and dispatcher's state evicted too), a
# one-element op took microseconds more, and the overheads measured per step and per parameter came out 0
FLUSH_BYTES = 64 << 20  # written to flush a CPU's caches: twice this project's CPU's last-level cache (32 MiB L3)
_FLUSH: dict[str, torch.Tensor] = {}
ROUNDS = 3  # the fastest of this many windows: another process sharing the core slows some, never speeds one


class KernelTimer:
    """Seconds per op on `device`, measured once per (op, argument signature)."""

    def __init__(self, device: torch.device | str, max_bytes: int = 1 << 30):
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        self.cache: dict[Hashable, float | None] = {}
        self.per_element: dict[Hashable, float] = {}
        self.measured = 0  # signatures this timer answered with a measurement (made here or earlier in the process)
        self.failed = ""  # why the last per-element timing could not run here

    def seconds(self, node: torch.fx.Node) -> float | None:
        """The measured seconds of one call of `node`'s op, or None when it cannot be measured."""
        if node.op != "call_function" or node.target is operator.getitem:
            return None
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)] + tensors_of(node)
        if not tensors or any(t.device.type != self.device.type for t in tensors):
            return None
        if sum(t.numel() * t.element_size() for t in tensors) > self.max_bytes:
            return None
        key = (node.target, _signature(args), _signature(kwargs))
        if key not in self.cache:
            where = (str(self.device), key)
            _read_record(where)
            if _TIMES_MEASURED.get(where, 0) < MEASUREMENTS:
                _TIMES_MEASURED[where] = _TIMES_MEASURED.get(where, 0) + 1
                self.cache[key] = _fastest(where, self._measure(node.target, args, kwargs))
            else:
                self.cache[key] = _MEASURED.get(where)
            self.measured += self.cache[key] is not None
        return self.cache[key]

    def compute_seconds(self, node: torch.fx.Node) -> float:
        """What `node`'s arithmetic costs inside fused code, where its operands never reach memory: its seconds
        per element on COMPUTE_NUMEL elements in cache beyond a baseline's (the launch and the traffic, which
        fused code prices once, by its bytes), times the elements it makes. A unary pointwise op (exp, tanh,
        log, ...) is timed against a negation. A random draw (dropout's, as Inductor draws it from a seed in
        fused code) is timed as Inductor compiles it, `x * (draw > 0.5)` against `x * (x > 0.5)`: Inductor's
        C++ code runs a Philox engine per element, not eager's generator (on a CPU here, 3-5 ns an element
        either way, run to run); as eager's `torch.rand` where Inductor cannot compile. 0 for other ops: a
        binary op's arithmetic (an add, a multiply) hides under its traffic."""
        made = node.meta.get("val")
        if not isinstance(made, torch.Tensor) or made.device.type != self.device.type:
            return 0.0
        if _random_draw(node):
            mode = node.args[2] if _is_op(node.target, "prims::inductor_random") else "rand"  # its schema's 3rd
            dtype = made.dtype if made.is_floating_point() else torch.float32
            key: Hashable = ("draw", mode, dtype)
            ops: Callable[[torch.Tensor], tuple[Callable, Callable]] = lambda x: _draw_kernels(x, mode)  # noqa: E731
        elif _unary_pointwise(node):
            source = node.args[0].meta.get("val")
            if not isinstance(source, torch.Tensor) or not source.is_floating_point():
                return 0.0
            key, dtype = (node.target, source.dtype), source.dtype
            ops = lambda x, target=node.target: (torch.ops.aten.neg.default, target)  # noqa: E731
        else:
            return 0.0
        return self._cached_per_element(key, ops, dtype, COMPUTE_NUMEL) * made.numel()

    def access_seconds(self, direction: str, dtype: torch.dtype, elements: int) -> float:
        """What fused code's loads or stores (`direction`) of `elements` values of a one-byte `dtype` cost
        beyond their bytes: per element, Inductor's code moving them (`x > 0.5` stored as a bool) less its
        code moving floats in their place, timed as Inductor compiles both. On this project's CPU (AVX-512),
        on one thread, 6.9 ns a bool stored and 1.2 loaded (a mask 90% True; 13.2 and 3.7 half True), against
        0.1 ns a float; 0 where they are no slower (a GPU) or cannot be compiled."""
        ops = lambda x: _narrow_kernels(x, direction, dtype)  # noqa: E731
        return self._cached_per_element((direction, dtype), ops, torch.float32, NARROW_NUMEL) * elements

    def _cached_per_element(self, key: Hashable, make_ops: Callable[[torch.Tensor], tuple[Callable, Callable]],
                            dtype: torch.dtype, numel: int) -> float:
        """`_per_element`'s figure for `key`, once per timer, the fastest its process measured; 0 where it
        cannot be timed here (that cost left out of the price)."""
        if key not in self.per_element:
            where = (str(self.device), "per element", key)
            seconds = None if _read_record(where) else self._per_element(make_ops, dtype, numel)
            self.per_element[key] = _fastest(where, seconds) or 0.0
        return self.per_element[key]

    def _per_element(self, make_ops: Callable[[torch.Tensor], tuple[Callable, Callable]],
                     dtype: torch.dtype, numel: int = COMPUTE_NUMEL) -> float | None:
        """Seconds per element of the second of `make_ops(x)`'s two ops beyond the first's, on x of `numel`
        elements; None where they cannot run or the second was no slower (not 0, which the process's
        fastest figure would keep for good: a later timer tries again)."""
        threads = torch.get_num_threads() if self.device.type == "cpu" else 1
        with _outside_tracing(), _one_thread(self.device):
            with torch.no_grad():
                x = torch.ops.aten.rand.default([numel], dtype=dtype, device=self.device) + 0.5
            try:  # x + 0.5 lies in every op's domain
                ops = make_ops(x)
                for op in ops:
                    op(x)
                self._sync()
                # windows of the two ops taken in turn: a slow spell of the machine slows both alike
                rounds = [[self._window(op, (x,), {}) for op in ops] for _ in range(2 * ROUNDS)]
            except Exception as error:
                self.failed = repr(error)
                return None
        baseline, op = (min(times) for times in zip(*rounds))
        if op <= baseline:  # not a figure to keep for the process: a later timer tries again
            self.failed = f"timed no slower than its baseline ({op:.3g} s against {baseline:.3g} s)"
            return None
        return (op - baseline) / numel / threads

    def _measure(self, target: Any, args: Any, kwargs: Any) -> float | None:
        with _outside_tracing():
            return self._time(target, args, kwargs)

    def _time(self, target: Any, args: Any, kwargs: Any) -> float | None:
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, self._real, (args, kwargs))
        nbytes = sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves((real_args, real_kwargs))
                     if isinstance(t, torch.Tensor))
        cold = self.device.type == "cpu" and nbytes >= COLD_MIN_BYTES
        window = self._cold_window if cold else self._window
        try:
            target(*real_args, **real_kwargs)  # warm-up: caches, autotuning, lazy initialisation
            self._sync()
            best = min(window(target, real_args, real_kwargs) for _ in range(ROUNDS))
        except Exception:  # an op that cannot run on made-up values: priced by the roofline instead
            return None
        return best

    def _window(self, target: Any, args: Any, kwargs: Any) -> float:
        """Seconds per call over back-to-back calls for at least MIN_SECONDS (one call of a long kernel)."""
        calls, started = 0, time.perf_counter()
        while calls < MAX_CALLS and (calls == 0 or time.perf_counter() - started < MIN_SECONDS):
            target(*args, **kwargs)
            calls += 1
            if calls == 1:
                self._sync()
                first = time.perf_counter() - started
                if first > MIN_SECONDS:  # a long kernel: one timed call is enough
                    return first
        self._sync()
        return (time.perf_counter() - started) / calls

    def _cold_window(self, target: Any, args: Any, kwargs: Any) -> float:
        """The median seconds of COLD_CALLS calls (fewer, for MIN_SECONDS in all), each timed alone after the
        caches are flushed (a buffer larger than the last-level cache written): in a step, a kernel's operands
        were mostly written or read long before it runs. Back to back, a matmul finds its operands in cache and
        runs faster than in the step (Llama 4x256's matmuls here: 157 ms a step timed back to back, 170 cold,
        169 in the step as profiled)."""
        flush = _flush_buffer(self.device)
        times: list[float] = []
        while len(times) < COLD_CALLS and sum(times) < MIN_SECONDS:  # a long kernel: one timed call is enough
            flush.zero_()
            started = time.perf_counter()
            target(*args, **kwargs)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def _real(self, fake: torch.Tensor) -> torch.Tensor:
        """A real tensor with `fake`'s shape, strides and storage: random floats, ones otherwise."""
        numel = max(1, fake.untyped_storage().nbytes() // fake.element_size())
        with torch.no_grad():
            if fake.is_floating_point() or fake.is_complex():
                flat = torch.rand(numel, dtype=fake.dtype, device=self.device)
            else:
                flat = torch.ones(numel, dtype=fake.dtype, device=self.device)
            return flat.as_strided(fake.shape, fake.stride(), fake.storage_offset())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _fastest(key: Hashable, seconds: float | None) -> float | None:
    """The fastest time this process measured for `key`, `seconds` included: a machine shared with other work
    runs a kernel slower for seconds at a time, so one timer's three windows can all fall in a slow spell.
    Kept on disk for later plans (`fxmem.price.price_record`)."""
    if seconds is not None:
        earlier = _MEASURED.get(key)
        _MEASURED[key] = seconds if earlier is None else min(earlier, seconds)
        price_record.record(key[0], key[1:], _MEASURED[key])
    return _MEASURED.get(key)


def _read_record(where: tuple) -> bool:
    """Take the seconds kept on disk for `where` (device, signature...) as measured as often as need be, where
    this process has not measured it; True where it now has them."""
    if where not in _MEASURED:
        kept = price_record.recorded(where[0], where[1:])
        if kept is None:
            return False
        _MEASURED[where], _TIMES_MEASURED[where] = kept, MEASUREMENTS
    return True


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """FLUSH_BYTES on `device`, made once a process: writing it evicts the caches."""
    if str(device) not in _FLUSH:
        _FLUSH[str(device)] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    return _FLUSH[str(device)]


def _draw_kernels(x: torch.Tensor, mode: str) -> tuple[Callable, Callable]:
    """Inductor's fused code for `x * (x > 0.5)` and for `x * (draw > 0.5)`, its draw made as Inductor makes it
    (from a seed, unless Inductor's `fallback_random` says eager's draw); eager's `torch.rand` / `randn`
    where Inductor cannot compile here (no C++ compiler)."""
    eager_draw = torch.ops.aten.randn.default if mode == "randn" else torch.ops.aten.rand.default

    def draw(y: torch.Tensor) -> torch.Tensor:
        return eager_draw(y.shape, dtype=y.dtype, device=y.device)

    return _compiled_pair(("draw", mode), (lambda y: (y * (y > 0.5),), lambda y: (y * (draw(y) > 0.5),)), x)


def _narrow_kernels(x: torch.Tensor, direction: str, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """Inductor's fused code that moves a float per element of `x`, and code that moves one of `dtype` in
    its place: stores `x * 1.1` against `(x > 0.6).to(dtype)`; loads `y` in `x * y * 1.1` against such a
    mask. `x` lies in [0.5, 1.5): the mask keeps 90% as a dropout's does (on this CPU the cost follows the
    mask's values: a bool stored costs twice as much where half are True)."""
    if direction == "store":
        return _compiled_pair(("store", dtype), (lambda y: (y * 1.1,), lambda y: ((y > 0.6).to(dtype),)), x)
    floats, narrow = x.clone(), (x > 0.6).to(dtype)
    pair = _compiled_pair(("load", dtype), (lambda y, z: (y * z * 1.1,), lambda y, z: (y * z * 1.1,)),
                          x, (floats, narrow))
    return (lambda y: pair[0](y, floats), lambda y: pair[1](y, narrow))


def _compiled_pair(key: Hashable, kernels: tuple[Callable, Callable], x: torch.Tensor,
                   others: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[Callable, Callable]:
    """`kernels` as Inductor compiles them for `x` (and the second argument `others` gives each), once a
    process; as they are where Inductor cannot compile here."""
    key = (str(x.device), x.dtype, key)
    if key not in _COMPILED:
        try:
            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.proxy_tensor import make_fx

            inputs = [[x]] * 2 if others is None else [[x, other] for other in others]
            with torch._guards.tracing(None):  # apart from the trace this planner may be running in
                _COMPILED[key] = tuple(compile_fx(make_fx(kernel)(*args), args)  # type: ignore[assignment]
                                       for kernel, args in zip(kernels, inputs))
        except Exception:
            _COMPILED[key] = kernels
    return _COMPILED[key]


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On a CPU, kernels run (and Inductor compiles them) on one thread: a parallel kernel waits at its barrier
    for a core another process holds, for a whole time slice (8-16 ms a call on 65536 elements here, either op
    of a pair, which made one op seem faster than its baseline); one thread's arithmetic is shared evenly by
    the step's threads (per element, 2 threads ran 0.93-0.94x one thread's figure halved, here)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _outside_tracing() -> Iterator[None]:
    """The planner runs inside Dynamo's and AOTAutograd's tracing, whose Python dispatcher and modes (dispatch
    modes, and torch-function modes such as `torch.device(...)`) would be timed too, or would change the op."""
    with torch._C._DisablePythonDispatcher(), _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _is_op(target: Any, name: str) -> bool:
    """Whether `target` is the op overload schema-named `name` ("prims::inductor_random"), by name: an
    overload object looked up again need not be the same object."""
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.name == name


def _random_draw(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers: an op torch tags seeded, or Inductor's draws from a seed."""
    if node.op != "call_function":
        return False
    return (torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
            or _is_op(node.target, "prims::inductor_random") or _is_op(node.target, "prims::inductor_randint"))


def _unary_pointwise(node: torch.fx.Node) -> bool:
    """Whether `node` is an elementwise aten op of one tensor and nothing else (exp, tanh, rsqrt, ...)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and len(node.args) == 1 and not node.kwargs
            and isinstance(node.args[0], torch.fx.Node))


def _signature(value: Any) -> Hashable:
    """What decides an op's speed: tensors by shape, strides and dtype; other arguments as they are."""
    def describe(x: Any) -> Hashable:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(describe(v) for v in x)
        if isinstance(x, dict):
            return tuple(sorted((k, describe(v)) for k, v in x.items()))
        try:
            hash(x)
            return x
        except TypeError:
            return repr(x)

    return describe(value)
