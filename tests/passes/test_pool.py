"""passes/pool.py: pooled forward/backward graphs of zoo models compute exactly what the unpooled
graphs compute; the arena is the planned size; optimize(pool=True) trains like eager."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.trace.capture import capture
from fxmem.measure import measure_peak_bytes
from fxmem.passes.pool import copy_graph, out_overload, pool_graph, pool_stats
from fxmem.planner.planner import Planner, PlanRequest
from fxmem.run.engine import CompiledStep, model_state
from tests.conftest import assert_trains_like, deterministic

TINY = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "unet-tiny"]


def _compare_compiler(seen: list):
    """An AOTAutograd compiler that runs the pooled copy of each graph next to the graph itself."""

    def compile_graph(gm, _example_inputs):
        pooled = pool_graph(copy_graph(gm), time_limit_s=2.0)

        def run(args):
            args = list(args)
            rng = torch.get_rng_state()
            got = pooled(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            torch.set_rng_state(rng)
            want = gm(*args)
            seen.append((pooled, got, want))
            return want

        run._boxed_call = True
        return run

    return compile_graph


@pytest.mark.parametrize("name", TINY)
def test_pooled_graphs_compute_the_same_values(name):
    torch.manual_seed(0)
    model, inputs = models.from_name(name), models.example_inputs(name)
    seen: list = []
    step = CompiledStep(model, capture(model, inputs, {}), Planner(PlanRequest()),
                        compiler=_compare_compiler(seen))
    with deterministic():  # the same graph run twice adds in the same order (index_put with accumulate)
        step(dict(model_state(model)), inputs, {}).backward()
    assert len(seen) == 2  # forward and backward
    for pooled, got, want in seen:
        assert len(got) == len(want)
        for a, b in zip(got, want):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b)
        stats = pool_stats(pooled)
        assert stats.pooled > 0 and stats.pooled == stats.out_variant + stats.copied
        assert stats.lower_bound_bytes <= stats.arena_bytes < stats.no_reuse_bytes
        assert stats.arena_bytes == stats.lower_bound_bytes, "real graphs should pack to the bound"
        arenas = [n for n in pooled.graph.nodes if n.target is torch.ops.aten.empty.memory_format]
        assert len(arenas) == 1 and arenas[0].args[0] == [stats.arena_bytes]
        slots = [n for n in pooled.graph.nodes if "pool" in n.meta.get("fxmem", {})]
        assert len(slots) == stats.pooled


def test_pooled_values_live_in_the_arena():
    """Run a pooled forward graph node by node: every pooled value's storage is the arena's."""
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    graphs: list = []

    def grab(gm, _example):
        def run(args):
            graphs.append((gm, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return gm(*args)
        run._boxed_call = True
        return run

    CompiledStep(model, capture(model, inputs, {}), Planner(PlanRequest()),
                 compiler=grab)(dict(model_state(model)), inputs, {})
    gm, args = graphs[0]
    pooled = pool_graph(copy_graph(gm))
    env: dict = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Keep(pooled).run(*args)
    arena = next(v for n, v in env.items() if n.target is torch.ops.aten.empty.memory_format)
    assert arena.numel() == pool_stats(pooled).arena_bytes
    pooled_nodes = [n for n in env if "pool" in n.meta.get("fxmem", {})]
    assert pooled_nodes
    for node in pooled_nodes:
        assert env[node].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_out_overload_lookup():
    assert out_overload(torch.ops.aten.mm.default) == (torch.ops.aten.mm.out, "out")
    assert out_overload(torch.ops.aten.add.Tensor) == (torch.ops.aten.add.out, "out")
    assert out_overload(torch.ops.aten.native_layer_norm.default) is None  # three outputs
    assert out_overload(len) is None


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_optimize_with_pool_trains_like_eager(name):
    torch.manual_seed(0)
    model, inputs = models.from_name(name), models.example_inputs(name)
    reference = copy.deepcopy(model)
    pooled = fxmem.optimize(model, budget_gb=1.0, pool=True)
    assert_trains_like(reference, pooled, inputs)
    plan = pooled.plans[0]
    assert plan.pool.forward is not None and plan.pool.backward is not None
    assert plan.pool.backward.arena_bytes == plan.pool.backward.lower_bound_bytes > 0
    assert "pooled backward arena" in plan.table()
    assert fxmem.Plan.from_json(plan.to_json()) == plan
    # The pooled step's simulated peak (arenas held across their graphs) is what MemTracker sees.
    measured = measure_peak_bytes(pooled, inputs)
    assert abs(plan.pool.predicted_peak_bytes - measured) <= 0.01 * measured


def test_graph_without_fake_values_is_refused():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with pytest.raises(fxmem.FxmemError, match="meta\\['val'\\]"):
        pool_graph(gm)


def test_pooled_inference_graph_matches():
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    model = models.from_name("resnet-tiny").eval()
    x = models.example_inputs("resnet-tiny")[0]
    params = dict(model.named_parameters()) | dict(model.named_buffers())

    def infer(p, x):
        return torch.func.functional_call(model, p, (x,))

    with torch.no_grad():
        gm = make_fx(infer, tracing_mode="fake")(params, x)
        want = gm(params, x)
        pooled = pool_graph(copy_graph(gm))
        got = pooled(params, x)
    stats = pool_stats(pooled)
    assert stats.pooled > 0 and stats.arena_bytes == stats.lower_bound_bytes
    assert torch.equal(got, want) and torch.equal(want, model(x).detach())


def test_keep_peak_pools_less_and_never_raises_the_step_more():
    torch.manual_seed(0)
    model, inputs = models.from_name("resnet-tiny"), models.example_inputs("resnet-tiny")
    every = fxmem.plan(model, inputs, pool="all")
    kept = fxmem.plan(model, inputs, pool=True)
    assert every.pool.backward.kept_for_peak == 0
    assert kept.pool.backward.kept_for_peak > 0
    assert kept.pool.backward.pooled < every.pool.backward.pooled
    assert kept.pool.predicted_peak_bytes <= every.pool.predicted_peak_bytes
    assert every.pool.predicted_peak_bytes > every.predicted_peak_bytes  # the arena is held


@pytest.mark.parametrize("bad", ["yes", 1.0, None])
def test_bad_pool_option_is_refused(bad):
    with pytest.raises(ValueError, match="pool must be"):
        fxmem.optimize(torch.nn.Linear(2, 2), budget_gb=1.0, pool=bad)
