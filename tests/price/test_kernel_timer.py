"""Kernel timing (fxmem/price/kernel_timer.py) and its use by the planner: measured seconds per op
signature, cached; the roofline for what cannot be measured; the preset chosen from the device."""
from __future__ import annotations

import types

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.price.cost import DEVICE_PRESETS, estimate, preset_for
from fxmem.run.inductor.step import has_cxx_compiler
from fxmem.price.kernel_timer import COMPUTE_NUMEL, KernelTimer
from tests.conftest import joint_of


def _joint():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    return joint_of(model, torch.randn(32, 64))[0]


def test_each_signature_is_timed_once_and_used_by_the_cost_table():
    joint = _joint()
    timer = KernelTimer("cpu")
    costs = estimate(joint, timer=timer.seconds)
    mms = [n for n in joint.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    assert mms and all(costs[n.name].seconds == timer.seconds(n) > 0 for n in mms)
    signatures = len(timer.cache)
    assert timer.measured <= signatures <= len([n for n in joint.graph.nodes if n.op == "call_function"])
    estimate(joint, timer=timer.seconds)
    assert len(timer.cache) == signatures  # the second pass measures nothing new


def test_what_cannot_be_timed_keeps_the_roofline():
    joint = _joint()
    roofline = estimate(joint)
    costs = estimate(joint, timer=lambda node: None)
    assert {n: c.seconds for n, c in costs.nodes.items()} == {n: c.seconds for n, c in roofline.nodes.items()}
    huge = KernelTimer("cpu", max_bytes=1)
    assert all(huge.seconds(n) is None for n in joint.graph.nodes)


def test_plan_says_where_its_times_come_from():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    assert fxmem.plan(model, inputs).timing == "cpu roofline"
    calibrated = fxmem.plan(model, inputs, calibrate=True)
    assert "measured on cpu" in calibrated.timing and "measured" in calibrated.table()


def test_preset_follows_the_gpu_name(monkeypatch):
    assert preset_for("cpu") == DEVICE_PRESETS["cpu"]
    props = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    for name, preset in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GH200 480GB", "gh200"),
                         ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert preset_for("cuda:0").name == preset
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    unknown = preset_for("cuda:0")
    assert unknown.name == "Some Future GPU" and unknown.memory_bytes == 80 * 2**30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: kernels timed on the GPU")
def test_gpu_plans_are_timed_on_the_gpu():
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny").cuda()
    inputs = [x.cuda() for x in models.example_inputs("gpt-tiny")]
    plan = fxmem.plan(model, inputs)
    assert "measured on cuda" in plan.timing and plan.device != "cpu"


def test_a_gpu_plan_traced_on_cpu_says_what_may_differ():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    plan = fxmem.plan(model, inputs, target="h100")
    assert plan.graph_device == "cpu" and "traced on CPU for h100" in " ".join(plan.table().split())
    assert "traced on CPU" not in fxmem.plan(model, inputs).table()


def test_kernels_are_timed_outside_the_tracers_python_dispatcher_and_modes():
    """The planner runs inside AOTAutograd's tracing: a kernel timed there would be timed through the Python
    dispatcher and any active dispatch mode, many times slower than the step runs it."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen = []

    def op(x):
        seen.append((torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher),
                     _get_current_dispatch_mode()))
        return x + 1

    class Redirecting(torch.overrides.TorchFunctionMode):  # a tracer's torch-function mode may change an op
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.rand, torch.randn, torch.Tensor.add, torch.Tensor.__add__, torch.exp):
                raise RuntimeError(f"{func} timed through a torch-function mode")
            return func(*args, **(kwargs or {}))

    timer, x, exp = KernelTimer("cpu"), torch.empty(4), _unary(torch.ops.aten.exp.default, 100)
    with enable_python_dispatcher(), Watching(), Redirecting():
        assert timer._measure(op, (x,), {}) > 0
        assert timer.compute_seconds(exp) > 0, timer.failed
    assert seen and all(state == (False, None) for state in seen)


def _unary(op, numel):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(numel)
    node = graph.call_function(op, (x,))
    node.meta["val"] = torch.empty(numel)
    return node


def test_a_unary_ops_arithmetic_is_timed_per_element_and_a_binary_ops_is_not():
    """compute_seconds: what a tanh costs beyond its traffic, per element made; an add's hides under its bytes."""
    timer = KernelTimer("cpu")
    small, large = _unary(torch.ops.aten.tanh.default, 1000), _unary(torch.ops.aten.tanh.default, 3000)
    assert timer.compute_seconds(small) > 0, timer.failed
    assert timer.compute_seconds(large) == pytest.approx(3 * timer.compute_seconds(small))  # timed once per op and dtype
    assert len(timer.per_element) == 1
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    assert timer.compute_seconds(graph.call_function(torch.ops.aten.add.Tensor, (a, b))) == 0.0


def test_a_timer_answers_the_fastest_time_its_process_measured(monkeypatch):
    """A slow spell of the machine can cover one timer's windows: a later timer's slower figure is not used."""
    from fxmem.price import kernel_timer

    monkeypatch.setattr(kernel_timer, "_TIMES_MEASURED", {})  # as if no timer had met mm before
    (mm, *_) = [n for n in _joint().graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    first = KernelTimer("cpu").seconds(mm)
    slower = KernelTimer("cpu")
    monkeypatch.setattr(slower, "_measure", lambda *args: 10 * first)
    assert slower.seconds(mm) == first and slower.measured == 1
    faster = KernelTimer("cpu")
    monkeypatch.setattr(faster, "_measure", lambda *args: first / 2)
    assert faster.seconds(mm) == first / 2 and KernelTimer("cpu").seconds(mm) <= first / 2


def test_only_the_first_timers_to_meet_a_signature_measure_it(monkeypatch):
    """Fitting a plan makes a timer per try: after MEASUREMENTS timers have measured a signature, later ones
    answer the fastest of theirs without running the op again."""
    from fxmem.price import kernel_timer

    monkeypatch.setattr(kernel_timer, "_TIMES_MEASURED", {})
    monkeypatch.setattr(kernel_timer, "_MEASURED", {})
    (mm, *_) = [n for n in _joint().graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    runs = []
    for seconds in [3e-3, 1e-3, 2e-3][:kernel_timer.MEASUREMENTS] + [1e-9]:
        timer = KernelTimer("cpu")
        monkeypatch.setattr(timer, "_measure", lambda *args, s=seconds: runs.append(s) or s)
        fastest = timer.seconds(mm)
        assert timer.measured == 1
    assert runs == [3e-3, 1e-3, 2e-3][:kernel_timer.MEASUREMENTS] and fastest == min(runs)



def _recorded_flushes(monkeypatch, events: list) -> None:
    """The timer's cache flush replaced by one that appends "flush" to `events`."""
    from fxmem.price import kernel_timer

    class Flush:
        def zero_(self):
            events.append("flush")

    monkeypatch.setattr(kernel_timer, "_flush_buffer", lambda device: Flush())


def test_an_op_on_a_cpu_is_timed_call_by_call_after_the_caches_are_flushed(monkeypatch):
    """In a step a matmul's operands were mostly made long before it runs; back to back, it finds them in cache.
    Each timed call follows a write of a buffer larger than the last-level cache, and the flush is not timed."""
    from fxmem.price import kernel_timer

    events: list = []
    _recorded_flushes(monkeypatch, events)
    tick = 1e-6
    clock = iter(range(1000))
    monkeypatch.setattr(kernel_timer.time, "perf_counter", lambda: next(clock) * tick)

    def op(x):
        events.append("op")

    timer = KernelTimer("cpu")
    assert timer._cold_window(op, (None,), {}) == pytest.approx(tick)  # each call alone: one tick, the flush untimed
    assert events == ["flush", "op"] * kernel_timer.COLD_CALLS
    events.clear()
    tick = 2 * kernel_timer.MIN_SECONDS
    assert timer._cold_window(op, (None,), {}) == pytest.approx(tick) and events == ["flush", "op"]  # a long kernel


def test_only_ops_on_operands_larger_than_a_cores_cache_are_timed_cold(monkeypatch):
    """A small op's cost is its dispatch, which runs hot in a step: timed after a flush, a one-element op cost
    microseconds more, and the step's fixed overheads measured as the rest came out 0."""
    from fxmem.price import kernel_timer

    flushes: list = []
    _recorded_flushes(monkeypatch, flushes)
    timer, neg = KernelTimer("cpu"), torch.ops.aten.neg.default
    assert timer._time(neg, (torch.ones(16),), {}) > 0 and not flushes
    assert timer._time(neg, (torch.ones(kernel_timer.COLD_MIN_BYTES // 4),), {}) > 0 and flushes


def test_a_random_draw_is_priced_per_element_as_inductor_draws():
    """Dropout under Inductor draws from a seed inside fused code (a Philox engine per element on a CPU): that
    costs far more than its bytes, and is timed as Inductor compiles it."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_random)

    def draw(numel):
        graph = torch.fx.Graph()
        seed = graph.placeholder("seed")
        node = graph.call_function(torch.ops.prims.inductor_random.default, ([numel], seed, "rand"))
        node.meta["val"] = torch.empty(numel)
        return node

    timer = KernelTimer("cpu")
    assert timer.compute_seconds(draw(1000)) > 0, timer.failed
    assert timer.compute_seconds(draw(4000)) == pytest.approx(4 * timer.compute_seconds(draw(1000)))


def test_per_element_arithmetic_is_timed_on_one_thread_and_shared_by_the_steps_threads(monkeypatch):
    """A parallel kernel waits at its barrier for a core another process holds (a whole time slice a call), so
    either op of a pair can seem the faster: the pair runs on one thread, and its figure is shared by the
    step's threads, which are restored afterwards."""
    seen = []

    def window(self, op, args, kwargs):
        seen.append(torch.get_num_threads())
        return 2e-3 if op is torch.ops.aten.exp.default else 1e-3

    monkeypatch.setattr(KernelTimer, "_window", window)
    ops = lambda x: (torch.ops.aten.neg.default, torch.ops.aten.exp.default)  # noqa: E731
    before = torch.get_num_threads()
    try:
        figures = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            figures[threads] = KernelTimer("cpu")._per_element(ops, torch.float32)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {1}
    assert figures[1] == pytest.approx(1e-3 / COMPUTE_NUMEL) and figures[2] == pytest.approx(figures[1] / 2)


@pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor on CPU needs a C++ compiler")
def test_a_bool_stored_by_fused_code_is_priced_per_element_beyond_its_byte():
    """Inductor's C++ code stores a bool mask through 64-lane vectors in loops of 16 floats: several ns an
    element here, where a float costs a tenth of one. Timed as Inductor compiles both, once per kind."""
    timer = KernelTimer("cpu")
    stored = timer.access_seconds("store", torch.bool, 1000)
    assert stored > 0, timer.failed
    assert timer.access_seconds("store", torch.bool, 3000) == pytest.approx(3 * stored)
    assert set(timer.per_element) == {("store", torch.bool)}
