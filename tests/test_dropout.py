"""Dropout outputs become recomputable from their masks, bit-identically, and plans use that."""
from __future__ import annotations

import copy

import torch

import fxmem
from fxmem import models
from fxmem.passes.dropout import expose_dropout
from tests.conftest import assert_trains_like, joint_of

aten = torch.ops.aten


def _joint(p: float):
    model = models.from_name("mlp-tiny", dropout=p)
    return joint_of(model, models.example_inputs("mlp-tiny", 64)[0])[0]


def test_each_training_dropout_gets_a_product_of_input_and_mask():
    joint = _joint(0.1)
    kernels = list(joint.graph.find_nodes(op="call_function", target=aten.native_dropout.default))
    assert expose_dropout(joint) == len(kernels) == 2
    products = [n for n in joint.graph.nodes if n.meta.get("fxmem", {}).get("dropout_of")
                and isinstance(n.args[1], float)]
    assert len(products) == 2 and all(p.args[1] == 1 / 0.9 for p in products)
    for kernel in kernels:  # the kernel's float output is no longer read; its mask is
        out = [u for u in kernel.users if u.args[1] == 0]
        assert all(not u.users for u in out)


def test_no_dropout_no_rewrite():
    joint = _joint(0.0)
    before = len(joint.graph.nodes)
    assert expose_dropout(joint) == 0 and len(joint.graph.nodes) == before


def test_recomputed_dropout_trains_bit_identically():
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    try:
        fxmem.plan(model, inputs, budget_gb=1e-9, solver="greedy")
    except fxmem.InfeasibleBudgetError as err:
        lowest = err.min_budget_bytes
    plan = fxmem.plan(model, inputs, budget_gb=1.02 * lowest / 2**30, solver="greedy")  # deterministic
    products = {row["name"] for row in plan.nodes if row["name"].startswith("mul_tensor")}
    assert products & set(plan.recompute), "a tight plan recomputes a dropout product from its mask"
    assert_trains_like(copy.deepcopy(model), fxmem.optimize(model, plan=plan), inputs)
