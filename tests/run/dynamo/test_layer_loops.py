"""`fxmem.run.dynamo.layer_loops`: the survey of a step that runs every layer of a LayerDrop loop, from the
survey of a step that skipped some."""
from __future__ import annotations

import torch.nn as nn

from fxmem.run.dynamo.layer_loops import every_layer


def _params(module):
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)


def test_skipped_layers_are_added_after_the_last_layer_that_ran():
    net = _Net()
    embed, head = _params(net.embed), _params(net.head)
    layers = [_params(layer) for layer in net.layers]
    survey = [embed, layers[1], layers[3], head]  # layers 0 and 2 skipped
    calls, added = every_layer(net, survey)
    assert calls == [embed, layers[1], layers[3], layers[0], layers[2], head]
    assert added == {frozenset(layers[1]): 2, frozenset(layers[3]): 2}


def test_a_graph_spanning_the_layers_and_a_step_running_all_are_left_alone():
    net = _Net()
    every = {}
    for layer in net.layers:
        every.update(_params(layer))
    assert every_layer(net, [_params(net.embed), every, _params(net.head)]) == \
        ([_params(net.embed), every, _params(net.head)], {})  # the loop is inside one graph
    survey = [_params(net.embed)] + [_params(layer) for layer in net.layers] + [_params(net.head)]
    assert every_layer(net, survey) == (survey, {})


def test_layers_of_another_class_in_the_list_are_not_counted():
    net = _Net()
    net.layers.append(nn.LayerNorm(8))  # one of its class: not a repeated layer
    layers = [_params(layer) for layer in net.layers]
    calls, added = every_layer(net, [layers[0]])
    assert calls == layers[:4] and added == {frozenset(layers[0]): 3}
