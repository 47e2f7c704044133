"""passes/dropout_backward.py: under CPU bf16 autocast, dropout trains bit-identical to eager."""
from __future__ import annotations

import copy

import pytest
import torch
from fxmem.passes.dropout_backward import eager_dropout_backward

import fxmem
from fxmem import models
from fxmem.errors import InfeasibleBudgetError
from tests.conftest import GIB, assert_trains_like


class Dropped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.dropout(torch.relu(self.fc1(x)), 0.1, self.training))


def _joint(model, x):
    from functorch.compile import aot_module
    from torch._dynamo.backends.debugging import boxed_nop
    joints = []

    def partition(joint, inputs, **kw):
        joints.append(copy.deepcopy(joint))
        from torch._functorch.partitioners import default_partition
        return default_partition(joint, inputs, **kw)

    compiled = aot_module(model, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    compiled(x).sum().backward()
    return joints[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewrites_only_half_precision(dtype):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
        joint = _joint(Dropped(), torch.randn(16, 32))
    assert eager_dropout_backward(joint) == (1 if dtype is torch.bfloat16 else 0)
    targets = {n.target for n in joint.graph.nodes}
    assert (torch.ops.aten.native_dropout_backward.default in targets) == (dtype is torch.float32)


def _least(model, inputs) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        fxmem.plan(model, inputs, budget_gb=1e-6, time_limit_s=1)  # a reference point for the budget
    return info.value.min_budget_bytes


def test_bf16_autocast_with_dropout_is_bit_identical_to_eager():
    """gpt-tiny has dropout 0.1 in attention, residual and MLP: with nothing recomputed and at a budget
    that recomputes, gradients under bf16 autocast equal eager's bit for bit (they were 1.5e-3 off)."""
    torch.manual_seed(0)
    model = models.from_name("gpt-tiny").train()
    inputs = models.example_inputs("gpt-tiny", 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fxmem.plan(model, inputs, budget_gb=100, time_limit_s=5).baseline_peak_bytes
        low = (_least(model, inputs) + eager) // 2
        for budget in (100 * GIB, low):
            optimized = fxmem.optimize(copy.deepcopy(model), budget_gb=budget / GIB, time_limit_s=1)
            assert_trains_like(copy.deepcopy(model), optimized, inputs)
            if budget == low:
                assert optimized.plans[0].recompute
