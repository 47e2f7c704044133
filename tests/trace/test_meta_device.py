"""Models built on the meta device plan exactly as the same model with weights: same eager and
predicted peaks, same least budget, to the byte; with meta or CPU inputs; a plan made on meta applies
to the model with weights and its measured peak fits the budget. `fxmem.optimize` refuses them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxmem
from fxmem import models
from fxmem.price.cost import DEVICE_PRESETS
from fxmem.measure import measure_peak_bytes
from fxmem.trace.meta_device import is_meta_model, planning_device
from tests.conftest import GIB

GPT = dict(block_size=32, n_layer=2, n_embd=24, vocab_size=65)  # gpt-small's family, tiny
BATCH = 8
# The greedy solver decides the same way on every run (the others are time-limited searches)
FIXED = dict(solver="greedy", time_limit_s=1)


def _gpt(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return models.from_name("gpt-small", **GPT)


def _least(model, inputs, **kwargs) -> int:
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, **kwargs)
    return info.value.min_budget_bytes


def _rows(plan):
    """What the planner was given: per value its op, module, bytes kept if saved, FLOPs and seconds."""
    return [(r.name, r.op, r.module, r.bytes, r.flops, r.seconds) for r in plan.nodes]


def _same_plans(real, meta, inputs, meta_inputs, meta_kwargs=None, **kwargs):
    """Eager step, least budget and the plan halfway between them: equal for both models, to the byte
    (`meta_kwargs` replace `kwargs` for the meta model). Returns the least and the meta model's plan halfway."""
    real_kwargs, kwargs = kwargs, {**kwargs, **(meta_kwargs or {})}
    eager = fxmem.plan(real, inputs, eager_meter=True, **real_kwargs)
    meta_eager = fxmem.plan(meta, meta_inputs, eager_meter=True, **kwargs)
    assert (meta_eager.fingerprint, meta_eager.baseline_peak_bytes, meta_eager.breakdown, meta_eager.eager_peak_bytes,
            meta_eager.graph_device, _rows(meta_eager)) == \
        (eager.fingerprint, eager.baseline_peak_bytes, eager.breakdown, eager.eager_peak_bytes, eager.graph_device,
         _rows(eager))
    assert eager.breakdown["gradients"] == sum(p.numel() * p.element_size() for p in real.parameters())
    least = _least(real, inputs, **real_kwargs)
    assert _least(meta, meta_inputs, **kwargs) == least < eager.baseline_peak_bytes
    halfway = (least + eager.baseline_peak_bytes) // 2 / GIB
    at, meta_at = fxmem.plan(real, inputs, halfway, **real_kwargs), fxmem.plan(meta, meta_inputs, halfway, **kwargs)
    assert (meta_at.predicted_peak_bytes, meta_at.recompute) == (at.predicted_peak_bytes, at.recompute)
    assert at.recompute and at.predicted_peak_bytes <= at.budget_bytes
    return least, meta_at


def test_gpt_on_meta_plans_like_gpt_with_weights():
    real, meta = _gpt("cpu"), _gpt("meta")
    assert is_meta_model(meta) and not is_meta_model(real)
    inputs = models.example_inputs("gpt-small", BATCH, **GPT)
    least, halfway = _same_plans(real, meta, inputs, inputs, **FIXED)
    at_least = fxmem.plan(meta, inputs, least / GIB, **FIXED)
    for plan in (halfway, at_least):  # made on meta, run with weights: it applies, and the step fits its budget
        assert measure_peak_bytes(fxmem.optimize(real, plan=plan), inputs) <= plan.budget_bytes


def test_gpt_on_meta_for_a_gpu_counts_its_workspaces_and_gradients():
    real, meta = _gpt("cpu"), _gpt("meta")
    inputs = models.example_inputs("gpt-small", BATCH, **GPT)
    want, got = fxmem.plan(real, inputs, target="h100"), fxmem.plan(meta, inputs, target="h100")
    assert got.breakdown == want.breakdown and got.baseline_peak_bytes == want.baseline_peak_bytes
    assert got.breakdown["BLAS workspaces"] == 2 * DEVICE_PRESETS["h100"].workspace_bytes()
    assert _least(meta, inputs, target="h100", **FIXED) == _least(real, inputs, target="h100", **FIXED)


def test_transformers_llama_on_meta_plans_like_llama_with_weights():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))

    def cross_entropy(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())

    kwargs = dict(loss_fn=cross_entropy, example_target=ids, **FIXED)
    meta_ids = ids.to("meta")  # the input is the target too: one tensor, as for the model with weights
    _, halfway = _same_plans(real, meta, (ids,), (meta_ids,), {"example_target": meta_ids}, **kwargs)
    optimized = fxmem.optimize(real, plan=halfway, loss_fn=cross_entropy)
    assert measure_peak_bytes(optimized, (ids,), {"target": ids}) <= halfway.budget_bytes
    # the model's own loss (labels=), CPU inputs to the meta model
    labels = {"example_kwargs": {"labels": ids}}
    assert fxmem.plan(meta, (ids,), **labels).baseline_peak_bytes == fxmem.plan(real, (ids,), **labels).baseline_peak_bytes


def test_estimate_of_a_meta_model_counts_what_the_model_with_weights_does():
    real, meta = _gpt("cpu"), _gpt("meta")
    inputs = models.example_inputs("gpt-small", BATCH, **GPT)
    want, got = fxmem.estimate(real, inputs), fxmem.estimate(meta, tuple(x.to("meta") for x in inputs))
    assert got.rows() == want.rows() and got.by_module == want.by_module and got.gradients > 0


def test_meta_model_with_cpu_inputs_and_meta_inputs():
    meta = _gpt("meta")
    inputs = models.example_inputs("gpt-small", BATCH, **GPT)
    on_cpu = fxmem.plan(meta, inputs)
    on_meta = fxmem.plan(meta, tuple(x.to("meta") for x in inputs))
    assert on_cpu.baseline_peak_bytes == on_meta.baseline_peak_bytes and on_cpu.graph_device == "cpu"
    assert all(p.is_meta for p in meta.parameters())  # planning left the model as it was


def test_optimize_refuses_a_meta_model_in_one_line():
    meta = _gpt("meta")
    for call in (lambda: fxmem.optimize(meta, budget_gb=1.0),
                 lambda: fxmem.optimize(meta, budget_gb=1.0, loss_fn=F.cross_entropy)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "meta device" in message and "fxmem.plan(" in message


def test_planning_device_is_the_targets_kind_where_this_machine_has_it():
    assert planning_device(DEVICE_PRESETS["cpu"]) == torch.device("cpu")
    gpu = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert planning_device(DEVICE_PRESETS["h100"]) == gpu


def test_pipeline_stages_of_a_meta_model_plan_like_the_model_with_weights():
    real, meta = _gpt("cpu"), _gpt("meta")
    inputs = models.example_inputs("gpt-small", BATCH, **GPT)
    want = fxmem.plan(real, inputs, 1.0, num_stages=2, **FIXED)
    got = fxmem.plan(meta, inputs, 1.0, num_stages=2, **FIXED)
    assert got.pipeline == want.pipeline and got.predicted_peak_bytes == want.predicted_peak_bytes
