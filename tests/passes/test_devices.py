"""Multi-device placement: the contiguous-region DP against brute force, and placed models that
train exactly like eager on CPU (`devices=["cpu", "cpu"]`: the moves run, as no-ops)."""
from __future__ import annotations

import copy
import random
from itertools import combinations_with_replacement

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.solve.placement import PlacementError, place_regions
from tests.conftest import GIB, assert_trains_like, step


def _brute(seconds, memory, budgets):
    """Least bottleneck over all contiguous placements (device k takes a run, possibly empty)."""
    n, d = len(seconds), len(budgets)
    best = None
    for cuts in combinations_with_replacement(range(n + 1), d - 1):
        bounds = [0, *cuts, n]
        runs = [range(bounds[k], bounds[k + 1]) for k in range(d)]
        if any(sum(memory[u] for u in run) > budgets[k] for k, run in enumerate(runs)):
            continue
        value = max(sum(seconds[u] for u in run) for run in runs)
        best = value if best is None else min(best, value)
    return best


def test_placement_matches_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        n, d = rng.randint(1, 7), rng.randint(1, 3)
        seconds = [rng.randint(1, 9) * 1.0 for _ in range(n)]
        memory = [rng.randint(1, 9) for _ in range(n)]
        budgets = [rng.randint(5, 25) for _ in range(d)]
        expected = _brute(seconds, memory, budgets)
        if expected is None:
            with pytest.raises(PlacementError, match="raise budget_gb"):
                place_regions(seconds, memory, budgets)
            continue
        got = place_regions(seconds, memory, budgets)
        assert got.bottleneck_s == expected
        assert list(got.device) == sorted(got.device), "regions are contiguous and in device order"
        assert all(m <= b for m, b in zip(got.memory, budgets))
        assert got == place_regions(seconds, memory, budgets), "deterministic"


def test_placement_balances_time():
    got = place_regions([1.0] * 8, [1] * 8, [100, 100])
    assert got.device == (0, 0, 0, 0, 1, 1, 1, 1)
    assert place_regions([1.0] * 4, [5] * 4, [5, 100]).device == (0, 1, 1, 1)


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_placed_model_trains_like_eager(name):
    torch.manual_seed(0)
    model, inputs = models.from_name(name), models.example_inputs(name)
    reference = copy.deepcopy(model)
    placed = fxmem.optimize(model, budget_gb=1.0, devices=["cpu", "cpu"])
    for _ in range(2):
        assert_trains_like(reference, placed, inputs)
    plan = placed.plan
    assert [e.device for e in plan.devices] == ["cpu", "cpu"]
    assert all(e.modules for e in plan.devices), "both devices get a region"
    first, second = plan.devices
    assert plan.device_of(first.modules[0]) == "cpu"
    # Each device runs its own region, the second from where the first ends, each with its own plan.
    regions = placed._regions
    assert [r.device for r in regions] == ["cpu", "cpu"] and regions[0].last == regions[1].first
    assert all(p is not None and p.budget_bytes == GIB for p in placed.region_plans)
    text = plan.table()
    assert "predicted peak" in text and second.modules[-1] in text


def test_device_of_names_each_region():
    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    placed = fxmem.optimize(model, budget_gb=1.0, devices=["cpu:0", "cpu:1"])
    placed(*inputs)
    plan = placed.plan
    assert plan.device_of("blocks.0.attn.c_attn") == "cpu:0"
    assert plan.device_of("lm_head") == "cpu:1"
    assert fxmem.Plan.from_json(plan.to_json()).device_of("lm_head") == "cpu:1"
    assert fxmem.plan(model, inputs).device_of("lm_head") is None


def test_tight_budget_splits_and_too_small_refuses():
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 1024)
    whole = fxmem.optimize(copy.deepcopy(model), budget_gb=1.0, devices=["cpu", "cpu"])
    whole(*inputs)
    total = sum(e.peak_bytes for e in whole.plan.devices)
    tight = int(0.6 * total)  # neither device can hold the whole model
    placed = fxmem.optimize(model, budget_gb=tight / GIB, devices=["cpu", "cpu"])
    placed(*inputs)
    assert all(e.modules and e.peak_bytes <= tight for e in placed.plan.devices)
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.optimize(copy.deepcopy(model), budget_gb=1e-6, devices=["cpu", "cpu"])(*inputs)
    least = refused.value.min_budget_bytes
    assert least > refused.value.budget_bytes, refused.value
    met = fxmem.optimize(copy.deepcopy(model), budget_gb=least / GIB, devices=["cpu", "cpu"])
    met(*inputs)  # the least named is met by the next call
    assert all(e.peak_bytes <= least for e in met.plan.devices)
    with pytest.raises(ValueError, match="one per device"):
        fxmem.optimize(model, budget_gb=[1.0], devices=["cpu", "cpu"])


def _untied(model):
    """The GPT with its own lm_head weight (a copy of the tied embedding's)."""
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model


def _placements_allowed(model, inputs, devices):
    """The units' labels, and the placements on `devices` that read no tensor on two devices."""
    from fxmem.passes.shard import tag_units
    from fxmem.dist.regions import keeps_shared_together, placements, unit_reads

    gm = fxmem.capture(model, inputs)
    labels = [u.label for u in tag_units(gm, model)]
    reads = unit_reads(gm, len(labels))
    return labels, [b for b in placements(len(labels), len(devices)) if keeps_shared_together(reads, devices, b)]


def test_tied_weights_keep_their_readers_on_one_device():
    """GPT's lm_head reads the embedding's weight: on two devices, no placement splits its readers (a tensor
    lives on one device); regions on one device share it, and untied, the model splits anywhere."""
    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    labels, allowed = _placements_allowed(model, inputs, ["cuda:0", "cpu"])  # nothing runs: no GPU needed
    n, wte, head = len(labels), labels.index("wte"), labels.index("lm_head")
    assert allowed and all((wte < cut) == (head < cut) for _, cut, _ in allowed)
    assert {(0, 0, n), (0, n, n)} <= set(allowed), "everything on one device or the other"
    assert len(_placements_allowed(model, inputs, ["cpu", "cpu:1"])[1]) == n + 1
    assert len(_placements_allowed(_untied(model), inputs, ["cuda:0", "cpu"])[1]) == n + 1


def test_planning_inputs_go_where_the_model_is():
    """A placed model is planned before its regions move: the inputs, wherever the caller put them, are
    planned on the device of the model's parameters (here the meta device stands for a second one)."""
    from fxmem.dist.placement import planning_inputs

    ids = torch.zeros(2, 8, dtype=torch.long)
    with torch.device("meta"):
        model = torch.nn.Embedding(10, 4)
    (moved,), kwargs = planning_inputs(model, (ids,), {"mask": ids, "n": 3})
    assert moved.device.type == "meta" and kwargs["mask"].device.type == "meta" and kwargs["n"] == 3
    assert planning_inputs(torch.nn.Embedding(10, 4), (ids,), {})[0][0] is ids, "already there: not copied"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a second device")
def test_placed_across_cuda_and_cpu_trains_like_eager():
    torch.manual_seed(0)
    # No dropout: CPU and CUDA draw different random numbers. Untied: a tied embedding and lm_head keep the
    # whole GPT on one device (test_tied_weights_keep_their_readers_on_one_device).
    model, inputs = _untied(models.from_name("gpt-tiny", dropout=0.0)), models.example_inputs("gpt-tiny")
    reference = copy.deepcopy(model).cuda()
    placed = fxmem.optimize(model, budget_gb=1.0, devices=["cuda:0", "cpu"])
    cuda_inputs = [x.cuda() for x in inputs]
    torch.manual_seed(1)
    expected = reference(*cuda_inputs)
    expected.backward()
    torch.manual_seed(1)
    got = placed(*cuda_inputs)
    got.backward()
    assert {p.device.type for p in model.parameters()} == {"cuda", "cpu"}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref[name].grad.cpu(), atol=1e-5, rtol=1e-5)


def _region_peaks(placed, args, kwargs):
    """Each device's measured peak: its region's step alone (forward, then backward from the sum of
    what it passes on), on the values the region before it passed, with an independent meter."""
    from fxmem.trace.capture import flat_graph_inputs
    from fxmem.measure import measure_peak_bytes

    values, peaks = flat_graph_inputs(placed._graph, args, kwargs), []
    for runner in placed._runners:
        if runner is None:
            peaks.append(0)
            continue
        inputs = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v for v in values]
        peaks.append(measure_peak_bytes(runner, inputs, warmup=False))
        out = runner(*inputs)
        values = list(out) if isinstance(out, (tuple, list)) else [out]
    return peaks


def test_llama_on_two_devices_recomputes_inside_each_region_at_six_tenths_of_eager():
    """At 0.6 of the whole step's eager peak per device, a device's region recomputes under its budget;
    the placed model trains like eager and each device's measured peak is within the budget."""
    transformers = pytest.importorskip("transformers")
    from fxmem.measure import measure_peak_bytes

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (4, 128))
    kwargs = {"labels": ids}
    budget = int(0.6 * measure_peak_bytes(copy.deepcopy(model), (ids,), kwargs))
    reference = copy.deepcopy(model)
    placed = fxmem.optimize(model, budget_gb=budget / GIB, devices=["cpu", "cpu"], time_limit_s=1)
    ref_out, out = step(reference, (ids,), kwargs), step(placed, (ids,), kwargs)
    torch.testing.assert_close(out.loss, ref_out.loss, atol=0, rtol=0)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    plans = placed.region_plans
    assert all(p is not None for p in plans) and any(p.recompute for p in plans), "recompute inside a region"
    for k, peak in enumerate(_region_peaks(placed, (ids,), kwargs)):
        assert peak <= budget, f"device {k}: measured {peak} > budget {budget}"


def test_each_region_is_priced_as_its_device(monkeypatch):
    """Without target=, a region is planned for the device it runs on (a GPU's preset holds its cuBLAS
    workspaces), not for the device the model was on when placed; here 'cpu:1' stands for an H100."""
    from fxmem.price.cost import DEVICE_PRESETS

    monkeypatch.setattr(fxmem.dist.placement, "preset_for",
                        lambda d: DEVICE_PRESETS["h100" if str(d) == "cpu:1" else "cpu"])
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    reference = copy.deepcopy(model)
    placed = fxmem.optimize(model, budget_gb=1.0, devices=["cpu", "cpu:1"])
    assert_trains_like(reference, placed, inputs)
    first, second = placed.region_plans
    assert (first.device, second.device) == ("cpu", "h100")
    assert "BLAS workspaces" in second.breakdown and "BLAS workspaces" not in first.breakdown
    given = fxmem.optimize(copy.deepcopy(reference), budget_gb=1.0, devices=["cpu", "cpu:1"], target="cpu")
    given(*inputs)
    assert [p.device for p in given.region_plans] == ["cpu", "cpu"], "target= prices every region"
