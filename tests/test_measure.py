"""fxmem.measure: the CPU allocator's view (allocator=True) agrees with MemTracker on an eager step, where
every tensor is allocated through the dispatcher both see."""
from __future__ import annotations

import torch

from fxmem import models
from fxmem.measure import measure_peak_bytes


def test_allocator_view_equals_memtracker_on_an_eager_step():
    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny", dropout=0.0), tuple(models.example_inputs("gpt-tiny"))
    tracked = measure_peak_bytes(model, inputs)
    both = measure_peak_bytes(model, inputs, allocator=True)
    assert tracked > sum(p.numel() * p.element_size() for p in model.parameters())
    assert tracked <= both <= tracked * 1.001  # the allocator also sees a few bytes no tensor holds
