"""What a plan reports of its joint graph (fxmem/planner/plan_facts.py): the gradients the step returns, the device
it was traced on, where its times come from."""
from __future__ import annotations

import torch

from fxmem.price.cost import DEVICE_PRESETS
from fxmem.price.kernel_timer import KernelTimer
from fxmem.planner.plan_facts import graph_device, timing, trained_parameters
from tests.conftest import joint_of


def test_one_gradient_per_trained_parameter_and_the_traced_device():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    joint, num_fwd_outputs = joint_of(model, torch.randn(4, 8))
    assert trained_parameters(joint, num_fwd_outputs) == 4
    model[0].weight.requires_grad_(False)
    joint, num_fwd_outputs = joint_of(model, torch.randn(4, 8))
    assert trained_parameters(joint, num_fwd_outputs) == 3
    assert graph_device(joint) == torch.device("cpu")


def test_timing_names_the_roofline_until_a_kernel_is_measured():
    timer = KernelTimer("cpu")
    assert timing(DEVICE_PRESETS["cpu"], None) == timing(DEVICE_PRESETS["cpu"], timer) == "cpu roofline"
    timer.measured = 3
    assert timing(DEVICE_PRESETS["cpu"], timer).startswith("3 kernels measured on cpu")
