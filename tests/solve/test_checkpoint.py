"""solve/recompute/checkpoint.py: every layer checkpointed, as a decision on the problem alone."""
from __future__ import annotations

from fxmem.solve.problem import is_valid, peak_bytes
from fxmem.solve.recompute.checkpoint import checkpoint_layers
from fxmem.solve.recompute.exact import exact_min_peak
from fxmem.solve.recompute.layers import find_layers
from fxmem.solve.recompute.least import least_peak
from tests.solve.test_layers import stack
from tests.solve.test_solve import eager_peak


def test_keeps_what_leaves_each_layer_and_recomputes_the_rest():
    problem = stack(4)
    layers = find_layers(problem)
    decision = checkpoint_layers(problem, layers)
    assert is_valid(problem, decision)
    names = {problem.names[i] for i in decision}
    for k in range(4):
        assert f"x{k}" not in names  # the layer's output, read by the next layer (or the head)
        assert {f"ln{k}", f"r{k}", f"up{k}", f"g{k}", f"s{k}"} <= names  # what stays inside the layer
        assert f"drop{k}" not in names  # random: kept
    assert peak_bytes(problem, decision) < eager_peak(problem)


def test_least_peak_is_never_above_checkpointing_every_layer():
    problem = stack(6)
    checkpointed = peak_bytes(problem, checkpoint_layers(problem, find_layers(problem)))
    least = least_peak(problem, 5.0)
    assert least.peak <= checkpointed
    assert least.peak >= exact_min_peak(problem, 20.0)[0] >= least.lower_bound
