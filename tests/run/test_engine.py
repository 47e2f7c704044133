"""The engine's optimized module as a user meets it: the output types the model returns, and its first
call (the one that plans) inside PyTorch's own memory meter."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import fxmem
from fxmem import models
from fxmem.measure import measure_peak_bytes
from tests.conftest import assert_trains_like


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return {"loss": h.square().mean(), "parts": [h.sum(), (h.relu(), h.tanh())]}


def test_outputs_have_the_models_types():
    torch.manual_seed(0)
    model, x = DictOut(), torch.randn(4, 8)
    out = fxmem.optimize(copy.deepcopy(model), budget_gb=1.0)(x)
    want = model(x)
    assert type(out) is dict and type(out["parts"]) is list and type(out["parts"][1]) is tuple
    assert torch.utils._pytree.tree_structure(out) == torch.utils._pytree.tree_structure(want)
    out["step"] = 1  # a plain dict: the caller may add to it
    assert_trains_like(model, fxmem.optimize(copy.deepcopy(model), budget_gb=1.0), (x,))


def test_first_call_inside_memtracker_plans_and_is_metered():
    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    eager_peak = fxmem.plan(model, inputs).baseline_peak_bytes
    optimized = fxmem.optimize(model, budget_gb=0.85 * eager_peak / 2**30, time_limit_s=2)
    tracker = MemTracker()
    tracker.track_external(optimized, *inputs)
    with tracker:  # the call that captures, plans and compiles the step
        optimized(*inputs).backward()
    first = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    plan = optimized.plans[0]
    assert plan.recompute and first <= plan.budget_bytes
    assert abs(first - measure_peak_bytes(optimized, inputs, warmup=False)) <= 0.02 * first


@pytest.mark.parametrize("loss", ["labels", "loss_fn"])
def test_the_call_that_plans_a_transformers_model_measures_as_the_calls_after_it(loss):
    """A transformers GPT-2 (captured by torch.export) at 0.8x eager's measured peak, every call measured from
    fresh gradients, the first included: the call that plans holds no more than the next (no fake stand-in
    metered as a parameter, no output kept alive past the step), and each is within the budget."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 1000, (4, 64))
    if loss == "labels":
        kwargs, extra = {"input_ids": ids, "labels": ids}, {}
    else:
        kwargs = {"input_ids": ids, "target": ids}
        extra = {"loss_fn": lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())}
    eager = measure_peak_bytes(copy.deepcopy(model), (), {"input_ids": ids, "labels": ids})
    budget = 0.8 * eager
    optimized = fxmem.optimize(model, budget_gb=budget / 2**30, time_limit_s=2, **extra)
    calls = [measure_peak_bytes(optimized, (), kwargs, warmup=False) for _ in range(3)]
    assert optimized.plan.recompute and max(calls) <= budget, (calls, budget)
    assert calls[0] == calls[1] == calls[2]


def test_inputs_are_let_go_at_backward_as_eager_does():
    """A step's input made by an op before it (a block's input under FSDP2, fxmem.fsdp) is freed once backward
    has passed through the step, while the loss (and with it the autograd graph) is still referenced: as eager."""
    import weakref

    torch.manual_seed(0)
    first, block = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    freed = []
    for step in (block, fxmem.optimize(copy.deepcopy(block), budget_gb=1.0)):
        for _ in range(2):  # the first call plans
            h = first(x)
            alive = weakref.ref(h)
            loss = step(h).square().sum()
            del h
            loss.backward()
        freed.append(alive() is None)
        del loss
    assert freed == [True, True]
