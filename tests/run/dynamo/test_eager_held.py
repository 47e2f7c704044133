"""fxmem.run.dynamo.eager_held: what eager code between graphs keeps for backward, counted by storage."""
import torch

from fxmem.run.dynamo.eager_held import EagerHeld


def test_a_graph_call_counts_what_the_eager_code_before_it_saved_once_and_not_its_own_inputs():
    cut = torch.randn(4, 5, requires_grad=True)  # what the graph before returned (counted by the ledger)
    held = EagerHeld()
    held.exclude([cut])
    y = cut.exp()  # saves its result: 80 bytes the eager code keeps
    index = torch.tensor([0, 2])  # saved by the indexing: 16 bytes
    z = y[index]  # the next graph's input (counted by the ledger, not here)
    held.graph_called(0, [z, 7])
    assert held.at_graph == {0: 80 + 16} and held.last == 0
    held.graph_called(1, [z.sum()])  # the same history again: no byte counted twice
    assert held.at_graph[1] == 80 + 16  # sum saves sizes, not tensors


def test_the_tail_counts_the_eager_loss_saved_and_its_backward_without_touching_parameters():
    weight = torch.nn.Parameter(torch.ones(3))
    cut = torch.randn(3, requires_grad=True)
    held = EagerHeld()
    held.exclude([weight, cut])
    held.graph_called(0, [cut])
    loss = (cut.exp() * weight).sum()  # exp saves its result (12 bytes); the product saves both sides
    tail = held.tail(loss, [cut])
    assert tail >= 12 + 12  # what it saved, and at least the gradient it makes for `cut`
    assert weight.grad is None and cut.grad is None
