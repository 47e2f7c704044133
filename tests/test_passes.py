"""The pass runner names the failing pass and the passes before it; the recompute pass tags."""
from __future__ import annotations

import pytest
import torch

from fxmem.passes.runner import PassError, run_passes


def test_runner_names_failing_pass():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))

    def first(g):
        return g

    def broken(g):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"pass broken failed \(after first\): boom"):
        run_passes(gm, [first, broken])
    assert run_passes(gm, [first]) is gm
