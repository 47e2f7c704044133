"""Optimizer state (fxmem/price/optimizer_state.py): what torch.optim allocates, from an optimizer's class and
options, its state, or a name."""
from __future__ import annotations

import pytest
import torch

from fxmem.price.optimizer_state import NAMED, bytes_per_param_byte, state_bytes


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
        self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.b(self.a(x).relu())).sum()


def _trainable(net):
    return [p for p in net.parameters() if p.requires_grad]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps), lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True), lambda ps: torch.optim.Adagrad(ps),
], ids=["adam", "adamw-amsgrad", "sgd", "sgd-momentum", "rmsprop", "adagrad"])
def test_inferred_optimizer_state_is_what_torch_allocates(make):
    net = _Net()
    optimizer = make(_trainable(net))
    inferred = state_bytes(optimizer)
    net(torch.randn(4, 8)).backward()
    optimizer.step()
    assert state_bytes(optimizer) == inferred  # now counted from optimizer.state


def test_unknown_optimizer_without_state_is_a_clear_error():
    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(ValueError, match="take one step first"):
        state_bytes(Mine(_Net().parameters()))


@pytest.mark.parametrize("name", sorted(NAMED))
def test_names_mean_what_their_optimizers_allocate(name):
    net = _Net()
    kind, options = NAMED[name]
    optimizer_class = {c.__name__.lower(): c for c in vars(torch.optim).values() if isinstance(c, type)}[kind]
    optimizer = optimizer_class(_trainable(net), lr=0.1, **options)
    net(torch.randn(4, 8)).backward()
    optimizer.step()
    param_bytes = sum(p.numel() * p.element_size() for p in _trainable(net))
    assert state_bytes(optimizer) == bytes_per_param_byte(name) * param_bytes
    assert bytes_per_param_byte(optimizer) == bytes_per_param_byte(name)


@pytest.mark.parametrize("bad", ["lion", -1.0, True])
def test_bad_optimizer_names_are_refused(bad):
    with pytest.raises(ValueError, match="optimizer must be one of"):
        bytes_per_param_byte(bad)


def test_optimizer_state_counts_in_the_step_budget():
    """With optimizer=, its state is in the plan's peaks and the budget: the step plus the state,
    measured by MemTracker with the optimizer tracked, stays within the budget."""
    import copy

    import fxmem
    from fxmem import models
    from fxmem.measure import _StepTracker, training_step

    torch.manual_seed(0)
    model, (x, y) = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    state = state_bytes(optimizer)
    alone = fxmem.plan(model, (x, y))
    with_state = fxmem.plan(model, (x, y), optimizer=optimizer)
    assert with_state.optimizer_state_bytes == state == 2 * sum(p.numel() * 4 for p in model.parameters())
    assert with_state.predicted_peak_bytes == alone.predicted_peak_bytes + state
    assert fxmem.plan(model, (x, y), optimizer="adamw").optimizer_state_bytes == state
    assert "optimizer state" in with_state.table()
    budget = alone.predicted_peak_bytes  # fits the step alone, not with the state: recompute makes room
    optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / 2**30, optimizer="adamw", time_limit_s=2)
    opt = torch.optim.AdamW(optimized.parameters())
    training_step(optimized, (x, y))
    opt.step()  # the state now exists, as in training
    opt.zero_grad(set_to_none=True)
    tracker = _StepTracker()
    tracker.track_external(optimized, opt, x, y)
    with tracker:
        training_step(optimized, (x, y))
    measured = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert optimized.plans[0].recompute and measured <= budget
    with pytest.raises(fxmem.InfeasibleBudgetError, match="optimizer state"):
        fxmem.plan(model, (x, y), budget_gb=state / 2**30, optimizer=optimizer)
