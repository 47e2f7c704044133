"""torch.compile(backend="fxmem"): budgets met (measured), training exact, graph breaks share the budget."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem import models
from fxmem.backend import fxmem_backend, has_cxx_compiler, plan_path, plans_for
from fxmem.measure import measure_peak_bytes, training_step
from fxmem.planner.plan_facts import HELD
from tests.conftest import GIB, assert_trains_like

BATCH = {"mlp-tiny": 1024}


def _setup(name):
    torch.manual_seed(0)
    return models.from_name(name), models.example_inputs(name, BATCH.get(name))


def _range(model, inputs):
    eager = fxmem.plan(model, inputs)
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, time_limit_s=2)  # a reference point for the budget
    return eager.baseline_peak_bytes, info.value.min_budget_bytes


def _compiled(model, options):
    """Compile in place (nn.Module.compile) so parameter names match the eager twin."""
    model.compile(backend="fxmem", options=options)
    return model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_aot_eager_budget_met_and_training_exact(name):
    model, inputs = _setup(name)
    eager_peak, lowest = _range(model, inputs)
    budget = int(eager_peak - 0.7 * (eager_peak - lowest))
    reference = copy.deepcopy(model)
    options = {"budget_gb": budget / GIB, "inner": "aot_eager", "time_limit_s": 2}
    compiled = _compiled(model, options)
    assert_trains_like(reference, compiled, inputs)
    (plan,) = plans_for(options)
    assert plan.recompute and plan.predicted_peak_bytes <= budget
    measured = measure_peak_bytes(compiled, inputs)
    assert measured <= budget, f"{name}: measured {measured} > budget {budget}"
    assert measured < eager_peak


@pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor on CPU needs a C++ compiler")
def _backend_minimum(model, inputs, inner) -> int:
    """The least feasible budget of the graph this backend captures, from its InfeasibleBudgetError."""
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        training_step(_compiled(copy.deepcopy(model), {"budget_gb": 1e-6, "inner": inner, "time_limit_s": 1}),
                      inputs)
    error = info.value
    while error is not None and not isinstance(error, fxmem.InfeasibleBudgetError):
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    assert error is not None, info.value
    torch._dynamo.reset()
    return error.min_budget_bytes


def test_inductor_below_eager_peak(tmp_path):
    torch.manual_seed(0)  # no dropout: Inductor draws random numbers its own way
    model, inputs = models.from_name("gpt-tiny", dropout=0.0, n_layer=1), tuple(models.example_inputs("gpt-tiny", 4))
    # Inductor decomposes the joint graph further, so its graph has its own eager peak and minimum.
    probe = {"budget_gb": 1.0, "inner": "inductor"}
    training_step(_compiled(copy.deepcopy(model), probe), inputs)
    keep_all = plans_for(probe)[0].predicted_peak_bytes  # the fused step, nothing recomputed
    lowest = _backend_minimum(model, inputs, "inductor")
    assert lowest < keep_all
    budget = (lowest + keep_all) // 2
    reference = copy.deepcopy(model)
    options = {"budget_gb": budget / GIB, "inner": "inductor", "time_limit_s": 1,
               "plan_out": str(tmp_path / "plan.json")}
    compiled = _compiled(model, options)
    assert_trains_like(reference, compiled, inputs, atol=1e-4, rtol=1e-4)
    (plan,) = plans_for(options)  # fitted to the fused step, recorded once
    assert plan.recompute and plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes == plan.timelines["inductor"].peak  # the plan predicts the fused step
    assert plan.inner == "inductor"  # planned, priced and recorded as Inductor runs it (pointwise ops fused)
    assert fxmem.Plan.load(plan_path(tmp_path / "plan.json", 0)) == plan
    # the CPU allocator sees Inductor's buffers (MemTracker does not): within budget, the prediction within 2%
    measured = measure_peak_bytes(compiled, inputs, allocator=True)
    assert measured <= budget and abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured


class TwoHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.b = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))

    def forward(self, x, targets):
        h = self.a(x)
        torch._dynamo.graph_break()
        return nn.functional.cross_entropy(self.b(h), targets)


def test_graph_break_shares_the_budget():
    """Each graph is planned for the whole budget with what the other graph holds added: the second
    graph's plan counts the first graph's parameters and saved values, so the step fits."""
    torch.manual_seed(0)
    model = TwoHalves()
    inputs = (torch.randn(512, 32), torch.randint(10, (512,)))
    reference = copy.deepcopy(model)
    opts = {"budget_gb": 1.0, "inner": "aot_eager"}
    _compiled(copy.deepcopy(model), opts)(*inputs).backward()
    unconstrained = plans_for(opts)
    assert len(unconstrained) == 2, "the graph break must give two graphs"
    g0, g1 = unconstrained
    first_params = sum(p.numel() * 4 for p in model.a.parameters())
    assert g1.breakdown[HELD] >= first_params + g0.saved_bytes
    assert g1.predicted_peak_bytes > g0.predicted_peak_bytes  # the step peaks in graph 1 (with graph 0's memory)
    budget = g1.predicted_peak_bytes - g1.saved_bytes // 8  # graph 1 must recompute
    options = {"budget_gb": budget / GIB, "inner": "aot_eager", "time_limit_s": 2}
    compiled = _compiled(model, options)
    assert_trains_like(reference, compiled, inputs)
    first, second = plans_for(options)
    assert first.budget_bytes == second.budget_bytes == budget
    assert first.predicted_peak_bytes <= budget and second.predicted_peak_bytes <= budget and second.recompute
    measured = measure_peak_bytes(compiled, inputs)
    predicted = max(first.predicted_peak_bytes, second.predicted_peak_bytes)  # the step's peak, seen from each graph
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    assert measured <= budget, f"measured {measured} > budget {budget}"


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_transformers_gpt2_equal_gradients(inner):
    transformers = pytest.importorskip("transformers")
    if inner == "inductor" and not has_cxx_compiler():
        pytest.skip("Inductor needs a C++ compiler")
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(128, (4, 32))
    kwargs = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    options = {"budget_gb": 1.0, "inner": inner, "time_limit_s": 5}
    tolerance = 0.0 if inner == "aot_eager" else 1e-4
    assert_trains_like(reference, _compiled(model, options), (), kwargs, atol=tolerance, rtol=tolerance)
    assert plans_for(options)


def test_budget_sweep_saves_less_as_budget_falls():
    model, inputs = _setup("mlp-tiny")
    eager_peak, lowest = _range(model, inputs)
    saved = []
    for fraction in (1.0, 0.5, 0.1):
        torch._dynamo.reset()
        options = {"budget_gb": (lowest + fraction * (eager_peak - lowest)) / GIB, "inner": "aot_eager",
                   "time_limit_s": 5}
        training_step(_compiled(copy.deepcopy(model), options), inputs)
        (plan,) = plans_for(options)
        saved.append(plan.saved_bytes)
    assert saved == sorted(saved, reverse=True) and saved[0] > saved[-1], saved


@pytest.mark.parametrize("options", [{}, {"budget_gb": -1.0}, {"budget_gb": 0}, {"budget_gb": "2"}])
def test_bad_budget_is_a_value_error(options):
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="budget_gb"):
        fxmem_backend(gm, [torch.randn(1, 2)], options=options)


def test_bad_budget_through_torch_compile():
    model, inputs = _setup("mlp-tiny")
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": -1.0, "inner": "aot_eager"})
    with pytest.raises(Exception, match="budget_gb must be a positive number"):
        compiled(*inputs)


def test_infeasible_budget_reaches_the_user():
    model, inputs = _setup("mlp-tiny")
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": 1e-6, "inner": "aot_eager",
                                                              "time_limit_s": 2})
    with pytest.raises(Exception) as info:
        training_step(compiled, inputs)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    errors = [e for e in chain if isinstance(e, fxmem.InfeasibleBudgetError)]
    assert errors and errors[0].min_budget_bytes > 1e-6 * GIB
    assert "is below the minimum" in str(info.value) and "raise budget_gb to at least" in str(info.value)


def test_entry_point_registered_without_importing_fxmem():
    code = ("import sys, torch; print('fxmem' in torch._dynamo.list_backends()); "
            "m = torch.nn.Linear(4, 4); "
            "c = torch.compile(m, backend='fxmem', options={'budget_gb': 1.0, 'inner': 'aot_eager'}); "
            "c(torch.randn(2, 4)).sum().backward(); print(m.weight.grad is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("on_cuda", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_prices_for_the_device_the_inputs_live_on(on_cuda):
    """Without a `device` option the plan is priced for the inputs' device: the GPU's own preset on CUDA."""
    from fxmem.price.cost import preset_for
    device = torch.device("cuda" if on_cuda else "cpu")
    model, inputs = _setup("mlp-tiny")
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    options = {"budget_gb": 1.0, "inner": "aot_eager", "time_limit_s": 5}
    _compiled(model, options)(*inputs).sum().backward()
    (plan,) = plans_for(options)
    assert plan.device == preset_for(device).name


def test_dynamic_shapes_get_a_clear_error_and_static_compiles_plan_each_shape():
    model, _ = _setup("gpt-tiny")
    reference = copy.deepcopy(model)
    options = {"budget_gb": 1.0, "inner": "aot_eager", "time_limit_s": 2}
    model.compile(backend="fxmem", dynamic=False, options=options)
    for batch in (4, 2):  # a second shape: Dynamo recompiles, fxmem plans it on its own
        assert_trains_like(reference, model, models.example_inputs("gpt-tiny", batch_size=batch))
    assert len(plans_for(options)) == 2
    torch._dynamo.reset()
    dynamic = torch.compile(copy.deepcopy(reference), backend="fxmem", dynamic=True, options=options)
    with pytest.raises(Exception, match="dynamic sizes .* compile with dynamic=False"):
        dynamic(*models.example_inputs("gpt-tiny", batch_size=4))


@pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor needs a C++ compiler")
def test_inductor_fallback_random_recomputes_dropout_with_eagers_masks(monkeypatch):
    """Under torch._inductor.config.fallback_random Inductor draws eager's random numbers; the plan may
    then recompute dropout, replayed through torch's rng ops Inductor runs as fallback kernels. At the
    least budget, which recomputes dropout, loss and gradients are eager's up to Inductor's float
    rounding (measured: 1 ulp on the loss, 4.5e-8 on gradients)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, use_cache=False,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(128, (2, 32))
    kwargs = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:  # planning only: the least budget of the first graph
            training_step(_compiled(copy.deepcopy(model), {"budget_gb": 1e-6, "time_limit_s": 1}), (), kwargs)
        error = info.value
        while error is not None and not isinstance(error, fxmem.InfeasibleBudgetError):
            error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
        torch._dynamo.reset()
        budget = error.min_budget_bytes * 21 // 20
        saves = _count_rng_saves(monkeypatch)
        compiled = _compiled(model, {"budget_gb": budget / GIB, "time_limit_s": 1})
        assert_trains_like(reference, compiled, (), kwargs, atol=1e-6, rtol=1e-5)
        measured = measure_peak_bytes(compiled, (), kwargs, warmup=False)  # sees torch's rng ops whole
    assert measured <= budget, f"measured {measured} > budget {budget}"
    assert saves[0] > 0  # the first graph recomputes dropout, replayed through torch's rng op


def _count_rng_saves(monkeypatch) -> list[int]:
    """How many random ops each graph planned from now on saves a generator state for."""
    from torch._prims.rng_prims import run_and_save_rng_state

    import fxmem.planner.planner
    seen, plan = [], fxmem.planner.planner.Planner.__call__

    def counting(self, joint, inputs, **kwargs):
        fw, bw = plan(self, joint, inputs, **kwargs)
        seen.append(sum(n.target is run_and_save_rng_state for n in fw.graph.nodes))
        return fw, bw

    monkeypatch.setattr(fxmem.planner.planner.Planner, "__call__", counting)
    return seen


def test_plans_for_finds_the_plans_by_an_equal_options_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    options = {"budget_gb": 1.0, "inner": "aot_eager"}
    torch.compile(model, backend="fxmem", options=options)(torch.randn(8, 16)).sum().backward()
    (plan,) = plans_for(options)
    assert plans_for({"inner": "aot_eager", "budget_gb": 1.0}) == [plan]  # written again, in another order
    assert plans_for({"budget_gb": 2.0, "inner": "aot_eager"}) == []


def test_a_budget_the_graphs_meet_together_but_not_one_by_one_is_met_after_compiling_again():
    """The README's GPT-2 (`labels=`: two graphs, the loss after a graph break) at 0.015 GiB: planned one by one,
    the first graph keeps the room the loss's needs (the loss's graph alone was refused, naming 18.8 MiB, and at
    that budget again); the step's graphs together need less than the budget, so the error says to compile
    again, and compiled again (Dynamo reset) each call measures within the budget."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1024, use_cache=False, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 1024, (4, 128))
    kwargs, options = {"input_ids": ids, "labels": ids}, {"budget_gb": 0.015, "inner": "aot_eager"}
    with pytest.raises(fxmem.FxmemError, match="compile again"):
        training_step(_compiled(copy.deepcopy(model), options), (), kwargs)
    torch._dynamo.reset()
    compiled = _compiled(copy.deepcopy(model), dict(options))
    calls = [measure_peak_bytes(compiled, (), kwargs, warmup=False) for _ in range(2)]
    assert max(calls) <= 0.015 * GIB, calls


def test_the_least_a_refusal_prints_is_accepted_by_the_next_compile_and_met_on_every_call(tmp_path, monkeypatch):
    """A transformers GPT-2 (`labels=`) under `torch.compile(backend="fxmem")`: the budget the refusal tells the
    user to raise to, as printed, compiles; every call, the first included, measures within it, and the
    gradients are eager's (the loss in chunks: up to rounding). Each MemTracker adds global module hooks, which
    Dynamo guards on, so each measured call compiles again: the plan cache (on by default) reads the plan back.
    transformers' loss breaks the graph (its `loss_function` property logs), so the step is two graphs; unlike
    `fxmem.optimize`'s Dynamo path (`fxmem.run.dynamo.step`), the backend has no model to probe for the graphs
    after the one it plans."""
    import re

    monkeypatch.setenv("FXMEM_CACHE", "1")
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=1, n_head=4, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(1000, (4, 64))
    kwargs = {"input_ids": ids, "labels": ids}
    with pytest.raises(Exception) as info:
        training_step(_compiled(copy.deepcopy(model), {"budget_gb": 1e-6, "inner": "aot_eager", "time_limit_s": 2}),
                      (), kwargs)
    printed = float(re.search(r"raise budget_gb to at least ([0-9.]+)", str(info.value)).group(1))
    torch._dynamo.reset()
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    options = {"budget_gb": printed, "inner": "aot_eager", "time_limit_s": 2}
    compiled = _compiled(candidate, options)
    calls = [measure_peak_bytes(compiled, (), kwargs, warmup=False) for _ in range(3)]
    assert max(calls) <= printed * GIB, (calls, printed * GIB)
    assert plans_for(options)[0].recompute
    candidate.zero_grad(set_to_none=True)
    assert_trains_like(reference, compiled, (), kwargs, atol=1e-6, rtol=1e-5)
