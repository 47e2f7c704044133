"""Joint graph -> MemoryProblem: what backward reads, what cannot be saved or recomputed."""
from __future__ import annotations

import operator

import torch
from torch._functorch.partitioners import default_partition

from fxmem.price.cost import DEVICE_PRESETS, estimate, is_view
from fxmem.price.memory import storages_of
from fxmem.solve.problem import eager_decision, saved_set
from fxmem.price.joint_problem import build_problem, split_joint
from tests.conftest import joint_of
from tests.price.test_memory import Net


def test_eager_decision_saves_what_autograd_saves():
    joint, num_fwd_outputs = joint_of(Net(), torch.randn(64, 128))
    split = split_joint(joint, num_fwd_outputs)
    lowered = build_problem(joint, split, estimate(joint, backward=set(split.backward)), 10**12)
    problem = lowered.problem
    ours = {k for i in saved_set(problem, eager_decision(problem)) for k in storages_of(lowered.nodes[i])}
    _, bw = default_partition(joint, [], num_fwd_outputs=num_fwd_outputs)
    forward = {n.name: n for n in split.forward}
    params = {k for p in split.primals for k in storages_of(p)}
    theirs = {k for n in bw.graph.find_nodes(op="placeholder") if n.name in forward
              for k in storages_of(forward[n.name])} - params
    assert ours == theirs  # the same storages kept (they keep a view where we keep its base)


def test_rules_for_random_views_and_written_back_inputs():
    joint, num_fwd_outputs = joint_of(Net(), torch.randn(64, 128))
    split = split_joint(joint, num_fwd_outputs)
    assert len(split.mutated) == 3  # BatchNorm running mean, running var, num_batches_tracked
    lowered = build_problem(joint, split, estimate(joint, backward=set(split.backward)), 10**12)
    kept = build_problem(joint, split, estimate(joint, backward=set(split.backward)), 10**12, replay_random=False)
    problem = lowered.problem
    for i, node in enumerate(lowered.nodes):
        if "dropout" in node.name and node.target is not operator.getitem:  # replayed (passes/rng.py), or kept
            assert problem.can_recompute[i] and not kept.problem.can_recompute[i], node.name
        if "batch_norm" in node.name and node.target is not operator.getitem:
            assert not problem.can_recompute[i], "reads running stats written back after forward"
        if is_view(node):
            assert not problem.can_save[i] and problem.size[i] == 0
    # the generator state each replayable dropout may save is in the base from the dropout on (5056 B on the CPU)
    dropouts = [n for n in split.forward if "dropout" in n.name and n.target is not operator.getitem]
    first = min(list(split.forward).index(n) for n in dropouts)
    extra = [b - k for b, k in zip(problem.base, kept.problem.base)]
    assert extra[first - 1] == 0 and extra[first] > 0 and extra[-1] == len(dropouts) * torch.get_rng_state().numel()
    assert max(problem.base) < 10**12 and len(problem.base) == len(split.forward) + len(split.backward)


def test_attention_without_dropout_is_recomputable_and_with_dropout_only_replayed():
    """Every scaled_dot_product kernel is tagged random for its dropout; with dropout_p=0 it draws
    nothing and may be recomputed (a GPT-2's least budget fell from 2.66 to 2.21 GiB with it)."""
    from fxmem.price.joint_problem import can_recompute

    def joint_nodes(dropout_p):
        class Attention(torch.nn.Module):
            def forward(self, q):
                return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p).sum()

        joint, _ = joint_of(Attention(), torch.randn(1, 2, 8, 4, requires_grad=True))
        random = [n for n in joint.graph.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
        assert random  # the attention kernel (and its dropout) are there
        return random

    assert all(can_recompute(n, replay=False) for n in joint_nodes(0.0))
    assert not any(can_recompute(n, replay=False) for n in joint_nodes(0.5))
    assert all(can_recompute(n) for n in joint_nodes(0.5))  # replayed with its generator state


def test_generator_states_in_the_base_are_the_devices_planned_for():
    """Each dropout that may be recomputed holds its generator state from the op on: the CPU's 5056 bytes on a
    CPU, nothing on a GPU (CUDA's state lives on the host), also where the graph was traced on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 32),
                                torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    joint, num_fwd_outputs = joint_of(model, torch.randn(8, 16))
    split = split_joint(joint, num_fwd_outputs)
    assert next(iter(joint.graph.find_nodes(op="placeholder"))).meta["val"].device.type == "cpu"
    base = {name: build_problem(joint, split, estimate(joint, DEVICE_PRESETS[name]), 0).problem.base
            for name in ("cpu", "h100")}
    added = [c - g for c, g in zip(base["cpu"], base["h100"])]
    assert added[-1] == 2 * torch.get_rng_state().numel() and min(added) == 0
