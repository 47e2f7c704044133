"""Cost model: FLOPs from FlopCounterMode, saved bytes read off the joint graph, roofline time."""
from __future__ import annotations

import pytest
import torch

from fxmem.price.cost import DEVICE_PRESETS, DeviceSpec, estimate
from fxmem.price.joint_problem import split_joint
from tests.conftest import joint_of


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_flops_bytes_and_time():
    joint, num_fwd_outputs = joint_of(TwoLinears(), torch.randn(16, 64))
    split = split_joint(joint, num_fwd_outputs)
    costs = estimate(joint, DEVICE_PRESETS["cpu"], backward=set(split.backward))
    addmm = [c for c in costs.nodes.values() if c.op.startswith("addmm")]
    assert sorted(c.flops for c in addmm) == [2 * 16 * 128 * 32, 2 * 16 * 64 * 128]
    relu = next(c for c in costs.nodes.values() if c.op.startswith("relu"))
    assert relu.flops == 0 and relu.seconds > DEVICE_PRESETS["cpu"].op_overhead_s, "memory-bound ops are not free"
    assert relu.saved_bytes == 16 * 128 * 4 and relu.module == ""
    views = [c for c in costs.nodes.values() if c.is_view]
    assert views and all(c.saved_bytes == 0 for c in views)
    assert all(c.seconds == (0 if c.op == "getitem" else DEVICE_PRESETS["cpu"].view_overhead_s) for c in views)
    assert DEVICE_PRESETS["cpu"].view_overhead_s > 0, "a view moves no bytes, but the generated code dispatches it"
    assert costs.total_flops() == sum(c.flops for c in costs.nodes.values()) > 3 * 2 * 16 * 64 * 128


def test_fused_prices_pointwise_ops_at_no_time_and_keeps_their_bytes():
    """Under Inductor a pointwise op runs inside a neighbour's kernel: recomputing it costs no time,
    while what it saves for backward is unchanged and matmuls cost what they did."""
    joint, num_fwd_outputs = joint_of(TwoLinears(), torch.randn(16, 64))
    backward = set(split_joint(joint, num_fwd_outputs).backward)
    eager = estimate(joint, DEVICE_PRESETS["cpu"], backward=backward)
    fused = estimate(joint, DEVICE_PRESETS["cpu"], backward=backward, fused=True)
    relu = next(name for name, c in eager.nodes.items() if c.op.startswith("relu"))
    assert eager[relu].seconds > 0 and fused[relu].seconds == 0
    assert fused[relu].saved_bytes == eager[relu].saved_bytes == 16 * 128 * 4
    for name, c in eager.nodes.items():
        if c.op.startswith(("addmm", "mm", "sum")):
            assert fused[name].seconds == c.seconds and fused[name].flops == c.flops, name


def test_device_presets():
    h100 = DeviceSpec.from_name("H100")
    assert h100.flop_rate(torch.bfloat16) > h100.flop_rate(torch.float32)
    assert h100.seconds(10**12, 0, torch.bfloat16) < DEVICE_PRESETS["cpu"].seconds(10**12, 0)
    with pytest.raises(KeyError, match="presets"):
        DeviceSpec.from_name("tpu9000")
