"""A graph Dynamo runs once per layer of a loop, and the layers a step may skip (LayerDrop).

Reads the model and a survey of one step (`fxmem.run.dynamo.ledger.survey_step`: per graph call, the parameters
it uses). Returns the survey of the step that runs every layer, and how many more calls each looped
graph makes in that step than in the surveyed one. Writes nothing.

Where a loop over a `ModuleList` breaks the graph at every layer (LayerDrop's random `if` decides per
layer whether it runs), Dynamo runs the loop eagerly and calls one graph, a layer's forward, once per
layer that runs: each call keeps its own activations for backward, and how many calls a step makes
changes from step to step. A graph call whose parameters all lie in one layer of such a list may be
made once for every layer of the list of the same class; the layers the surveyed step skipped are
added after the last surveyed call of their list, so a plan for this survey covers every subset of
layers that a later step runs (a step running fewer layers holds less).
"""
from __future__ import annotations

from typing import Sequence

import torch

Storages = dict[int, int]  # storage data pointer -> bytes


def _storages(module: torch.nn.Module) -> Storages:
    out: Storages = {}
    for p in module.parameters():
        if p.requires_grad:
            out[p.untyped_storage().data_ptr()] = int(p.untyped_storage().nbytes())
    return out


def _layer_lists(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Per ModuleList (or Sequential) of the model, its children grouped by class, where a class has
    more than one child with trainable parameters."""
    groups: list[list[torch.nn.Module]] = []
    for container in model.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        by_class: dict[type, list[torch.nn.Module]] = {}
        for child in container.children():
            if _storages(child):
                by_class.setdefault(type(child), []).append(child)
        groups += [layers for layers in by_class.values() if len(layers) > 1]
    return groups


def every_layer(model: torch.nn.Module, survey: Sequence[Storages]) -> tuple[list[Storages], dict[frozenset, int]]:
    """(the survey of the step that runs every layer, per surveyed call's parameters: how many calls
    of its graph that step adds). Calls whose parameters span more than one layer are left alone."""
    calls = [dict(c) for c in survey]
    added: dict[frozenset, int] = {}
    for layers in _layer_lists(model):
        params = [_storages(layer) for layer in layers]
        seen = [k for k, call in enumerate(calls) if call and any(call.keys() == p.keys() for p in params)]
        if not seen:
            continue  # no graph runs one layer of this list alone: its loop is inside a graph
        missing = [p for p in params if not any(calls[k].keys() == p.keys() for k in seen)]
        if not missing:
            continue
        calls[seen[-1] + 1:seen[-1] + 1] = missing
        for k in seen:
            added[frozenset(calls[k].keys())] = len(missing)
    return calls, added
