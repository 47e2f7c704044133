"""A model's rank simulated on fake tensors: a copy of the model whose parameters and buffers are fake
tensors, and fake example inputs, made under one `FakeTensorMode` that stays active while the rank runs.

Reads the model's tensors (their metadata only) and its example inputs; writes nothing and allocates
nothing: every tensor of the copy, of FSDP2's shards and gathered units and of the step is a fake, so a
rank of a model far larger than the host (an 8B Llama built on the meta device) is simulated in seconds.
A meta model's fakes are made on the planning device (`fxmem.trace.meta_device.planned_on`), so the step is
the one the model built with weights runs.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.trace.meta_device import planned_on


@contextlib.contextmanager
def fake_copy(model: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None,
              device: Any = None) -> Iterator[tuple[torch.nn.Module, tuple, dict]]:
    """Within this block, FakeTensorMode is active and yields (the model's copy on fakes, fake inputs,
    fake keyword inputs). A tensor given twice (input ids that are also the labels) is one fake.
    `device`: the `DeviceSpec` a meta model is planned for (its fakes' device, `planned_on`)."""
    from fxmem.price.cost import DeviceSpec
    spec = device if device is not None else DeviceSpec.from_name("cpu")
    with planned_on(model, spec), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        memo: dict[int, Any] = {}
        for p in model.parameters():
            memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = mode.from_tensor(b)
        twin = copy.deepcopy(model, memo)  # the tensors are already copied: the rest is module structure

        def fake(x: Any) -> Any:
            return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
        yield twin, pytree.tree_map(fake, tuple(inputs)), pytree.tree_map(fake, dict(kwargs or {}))
