"""The memory simulator against MemTracker on the graphs AOTAutograd actually runs."""
from __future__ import annotations

import torch
from functorch.compile import aot_module
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from fxmem.measure import measure_peak_bytes
from fxmem.price.memory import simulate_step


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(128, 512)
        self.bn = torch.nn.BatchNorm1d(512)
        self.drop = torch.nn.Dropout(0.1)
        self.b = torch.nn.Linear(512, 128)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.a(x))))
        return torch.tanh(self.b(h)).sum()


def test_simulated_peak_matches_memtracker():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(256, 128)
    for partition in (default_partition, min_cut_rematerialization_partition):
        predicted = {}

        def simulate(joint, inputs, *, num_fwd_outputs, **kw):
            fw, bw = partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
            predicted["peak"] = simulate_step(fw, bw, num_fwd_outputs).peak
            return fw, bw

        compiled = aot_module(model, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=simulate)
        measured = measure_peak_bytes(compiled, (x,))
        assert abs(predicted["peak"] - measured) <= 0.01 * measured, (partition.__name__, predicted, measured)
