"""passes/rng.py: random ops recomputed with the generator state they drew from. Masks are the same as
eager's, so training is bit-identical, and the generator ends the step where eager's does."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import fxmem
import fxmem.planner.planner
from fxmem.measure import measure_peak_bytes
from fxmem.passes.rng import run_and_save_rng_state, run_with_rng_state
from tests.conftest import GIB, assert_trains_like, step


class _DropoutCnn(nn.Module):
    """Conv, BatchNorm, ReLU, Dropout blocks: without replay the dropout outputs are always kept."""

    def __init__(self, width: int = 32, blocks: int = 3):
        super().__init__()
        layers = [nn.Conv2d(3, width, 3, padding=1)]
        for _ in range(blocks):
            layers += [nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.2), nn.Conv2d(width, width, 3, padding=1)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def _least(model, inputs) -> int:
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, time_limit_s=2)
    return info.value.min_budget_bytes


def _cnn():
    torch.manual_seed(0)
    return _DropoutCnn().train(), (torch.randn(8, 3, 16, 16),)


@pytest.fixture(scope="module")
def cnn_bounds():
    """The dropout CNN's eager peak, least budget replaying random ops and least keeping every mask,
    planned once for the tests below."""
    model, inputs = _cnn()
    return fxmem.plan(model, inputs).baseline_peak_bytes, _least(model, inputs), _least_kept(model, inputs)


@pytest.fixture
def replays(monkeypatch):
    """How many random ops each planned step saves a state for, and replays in backward."""
    seen = []
    plan = fxmem.planner.planner.Planner.__call__

    def counting(self, joint, inputs, **kwargs):
        fw, bw = plan(self, joint, inputs, **kwargs)
        seen.append((sum(n.target is run_and_save_rng_state for n in fw.graph.nodes),
                     sum(n.target is run_with_rng_state for n in bw.graph.nodes)))
        return fw, bw

    monkeypatch.setattr(fxmem.planner.planner.Planner, "__call__", counting)
    return seen


def test_recomputed_dropout_draws_eagers_masks(replays, cnn_bounds):
    model, inputs = _cnn()
    eager, least, _ = cnn_bounds
    budget = least + (eager - least) // 10
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=budget / GIB, time_limit_s=1)
    _three_steps_like_eager(reference, optimized, model, inputs)  # masks, gradients, BatchNorm stats, generator
    saves, replayed = replays[-1]
    assert saves == replayed > 0
    assert measure_peak_bytes(optimized, inputs) <= budget


def _after_eager_step(reference, inputs):
    """The generator state after one eager step from assert_trains_like's seed."""
    twin = copy.deepcopy(reference)
    step(twin, inputs)
    return torch.get_rng_state()


def test_dropout_models_plan_lower_than_keeping_every_mask(cnn_bounds):
    """The BatchNorm+dropout CNN could not go below about 60% of its eager peak while dropout outputs
    were kept; with replay its least budget is lower."""
    eager, replayed, kept = cnn_bounds
    assert replayed < kept
    print(f"least budget: {kept / eager:.0%} of eager keeping masks, {replayed / eager:.0%} replaying")


def _least_kept(model, inputs) -> int:
    """The least budget with random ops always kept (as before passes/rng.py)."""
    from fxmem.run.engine import plan_step
    from fxmem.planner.planner import PlanRequest

    with pytest.raises(fxmem.InfeasibleBudgetError) as kept:
        plan_step(model, inputs, {}, PlanRequest(budget_bytes=1, replay_random=False, time_limit_s=2))
    return kept.value.min_budget_bytes


def _three_steps_like_eager(reference, optimized, model, inputs):
    for _ in range(3):
        assert_trains_like(reference, optimized, inputs)
        assert torch.equal(torch.get_rng_state(), _after_eager_step(reference, inputs))
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad


def test_compile_backend_replays_dropout(replays, cnn_bounds):
    """torch.compile(backend="fxmem") with eager kernels runs the same passes: below the least budget
    that keeps every mask, dropout is recomputed and training is eager's bit for bit."""
    model, inputs = _cnn()
    _, least, kept = cnn_bounds
    assert least < kept
    probe = copy.deepcopy(model)  # the least the backend names for its own graph (its search may land a
    probe.compile(backend="fxmem", options={"budget_gb": 1 / GIB, "inner": "aot_eager", "time_limit_s": 5})
    with pytest.raises(fxmem.InfeasibleBudgetError) as named:  # little above fxmem.plan's on a busy machine)
        step(probe, inputs)
    budget = named.value.min_budget_bytes
    assert budget < kept  # below the least found keeping every mask
    reference = copy.deepcopy(model)
    model.compile(backend="fxmem", options={"budget_gb": budget / GIB, "inner": "aot_eager", "time_limit_s": 1})
    _three_steps_like_eager(reference, model, model, inputs)
    saves, replayed = replays[-1]
    assert saves == replayed > 0
    assert measure_peak_bytes(model, inputs) <= budget


def test_gpt_with_dropout_below_least_keeping_masks(replays):
    """The zoo's gpt-tiny (dropout 0.1 after attention, projections and MLP) at a budget no plan
    keeping every dropout output meets: trains like eager, within budget."""
    import models

    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny").train(), models.example_inputs("gpt-tiny")
    kept, least = _least_kept(model, inputs), _least(model, inputs)
    assert least < kept
    budget = (least + kept) // 2
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=budget / GIB, time_limit_s=1)
    _three_steps_like_eager(reference, optimized, model, inputs)
    saves, replayed = replays[-1]
    assert saves == replayed > 0
    assert measure_peak_bytes(optimized, inputs) <= budget


def test_states_simulated_for_a_gpu_are_cudas_wherever_traced(monkeypatch):
    """The candidates the planner simulates save each recomputed dropout's generator state as on the device
    planned for: on the CPU its 5056 bytes on the device; for a GPU, from the same graph traced on the CPU,
    CUDA's seed and offset on the host. (A model with CPU weights and the same model on meta, traced on CUDA
    where the machine has a GPU, then name the same least budget for the h100.)"""
    from fxmem.price.memory import on_host, tensors_of

    states = []
    replay = fxmem.planner.planner.replay_random_ops

    def seeing(fw, bw, *args, **kwargs):
        count = replay(fw, bw, *args, **kwargs)
        states.extend(n for n in fw.graph.nodes if n.target is operator.getitem and n.name.endswith("_rng_state"))
        return count

    monkeypatch.setattr(fxmem.planner.planner, "replay_random_ops", seeing)
    model, inputs = _cnn()
    for target, host, nbytes in (("cpu", False, torch.get_rng_state().numel()), ("h100", True, 16)):
        states.clear()
        with pytest.raises(fxmem.InfeasibleBudgetError):  # the least budget's search recomputes dropouts
            fxmem.plan(model, inputs, budget_gb=1e-6, target=target, time_limit_s=1)
        assert states and all(on_host(s) == host and tensors_of(s)[0].numel() == nbytes for s in states), target
