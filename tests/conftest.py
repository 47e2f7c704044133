"""Shared test helpers: run a training step on two modules and compare them with eager."""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

from functorch.compile import aot_module
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import default_partition

from fxmem.measure import training_step

GIB = 2**30
# Every test plans afresh (and subprocesses they start inherit this): a plan read from a cache would hide
# what a test checks of planning. tests/planner/test_plan_cache.py turns the cache on where it tests it.
os.environ["FXMEM_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _no_decisions_kept():
    """Nor does a test inherit the decisions an earlier one kept for other shapes (fxmem.planner.shape_reuse)."""
    from fxmem.planner import shape_reuse
    from fxmem.run.dynamo import step_least

    shape_reuse.forget()
    step_least.forget()  # nor the least a refused torch.compile step kept for its next compile
    yield


def step(module, inputs, kwargs=None, seed=1234):
    torch.manual_seed(seed)
    for p in module.parameters():
        p.grad = None
    return training_step(module, inputs, kwargs)


@contextlib.contextmanager
def deterministic():
    """torch's deterministic algorithms (warnings only where an op has none), for exact comparisons: with
    many CPU threads, index_put with accumulate (the backward of nearest upsampling as traced graphs
    decompose it) adds in an order that varies from run to run, where eager's upsample kernel does not."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def assert_trains_like(reference, optimized, inputs, kwargs=None, *, atol=0.0, rtol=0.0, ordered=False):
    """Same outputs, gradients and buffers after one step with the same RNG seed; with `ordered`, under
    torch's deterministic algorithms (for a step whose graphs are first compiled here: a graph compiled
    outside refuses to run its backward under them)."""
    with deterministic() if ordered else contextlib.nullcontext():
        ref_out = step(reference, inputs, kwargs)
        out = step(optimized, inputs, kwargs)
    ref_leaves = [t for t in torch.utils._pytree.tree_leaves(ref_out) if isinstance(t, torch.Tensor)]
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert len(ref_leaves) == len(leaves)
    for a, b in zip(ref_leaves, leaves):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    ref_params = dict(reference.named_parameters())
    for name, p in optimized.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    ref_buffers = dict(reference.named_buffers())
    for name, b in optimized.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def twin():
    """twin(model) -> an identical deep copy, for eager reference runs."""
    return copy.deepcopy


def joint_of(model, x):
    """The joint graph AOTAutograd traces for model(x), and its number of forward outputs."""
    seen = {}

    def keep(joint, inputs, *, num_fwd_outputs, **kw):
        seen["joint"], seen["n"] = joint, num_fwd_outputs
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    aot_module(model, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=keep)(x)
    return seen["joint"], seen["n"]
