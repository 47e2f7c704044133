"""The budget of one training step split by Dynamo into several graphs: what the rest of the step holds.

Reads each graph's example inputs as the `torch.compile` backend receives them (real tensors: its
parameters, buffers and activations), the plan made for it, the tensors its runs return, and,
when `fxmem.run.dynamo.step` gives them, the model and a survey of the step (`survey_step`: which
parameters each graph call of one step uses, in order). Returns, for the next graph to plan, the
bytes the rest of the step holds on the device while that graph's forward runs and while its
backward runs (`Ledger.held_for`), which the planner adds to its simulation
(`AllocatorModel.holding`). Writes nothing.

While graph k runs forward, the device also holds: every parameter and buffer of the model (those
of graph k counted by its own plan), the values earlier graphs saved for their backward, and the
tensors earlier graphs took or returned that are still alive when graph k starts (the batch, the
activations passed on). While graph k runs backward, add the gradients that later graphs' backward
already produced (backward runs the graphs in reverse order). Counted by storage, so a tensor
passed from one graph to the next, or a weight two graphs share, is counted once. Without the
model, other graphs' parameters are counted from the graphs planned so far; without the survey,
no later graph's gradients are known (`fxmem.optimize` gives both).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fxmem.planner.plan import Plan

Storages = dict[int, int]  # storage data pointer -> bytes


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), int(s.nbytes())


def _is_state(value: Any, source: Any) -> bool:
    """A parameter or buffer of the compiled module (Dynamo lifts them as graph inputs)."""
    return isinstance(value, torch.nn.Parameter) or "_buffers" in repr(source)


@dataclass
class GraphRecord:
    """One planned graph of a torch.compile call: what it holds of the step."""

    index: int
    frame: Any
    budget_bytes: int
    state: Storages = field(default_factory=dict)  # its parameters and buffers
    grads: Storages = field(default_factory=dict)  # its parameters that get a gradient
    inputs: Storages = field(default_factory=dict)  # its other tensor inputs
    seen: list[tuple[weakref.ref, int, int]] = field(default_factory=list)  # inputs and outputs, weakly
    held: tuple[int, int] = (0, 0)
    plan: Plan | None = None
    path: str | None = None
    calls: int = 0  # forward calls of this graph so far (a loop with a graph break calls one graph per layer)
    breaks: bool = False  # Dynamo ended it at a graph break: more graphs of its frame follow
    planner: Any = None  # the planner that planned it (its joint graph kept: `fxmem.run.dynamo.step_least`)
    refused: bool = False  # the budget was below its least: planned at its least, refused with the step's

    @classmethod
    def of(cls, index: int, frame: Any, budget: int, example_inputs: Sequence[Any],
           sources: Sequence[Any] = ()) -> "GraphRecord":
        record = cls(index, frame, budget)
        sources = list(sources) + [None] * (len(example_inputs) - len(sources))
        for value, source in zip(example_inputs, sources):
            if not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            ptr, nbytes = _storage(value)
            if _is_state(value, source):
                record.state[ptr] = nbytes
                if value.requires_grad:
                    record.grads[ptr] = nbytes
            else:
                record.inputs[ptr] = nbytes
                record.see(value)
        return record

    def see(self, value: torch.Tensor) -> None:
        """Remember a tensor this graph took or returned, without keeping it alive."""
        if isinstance(value, torch.Tensor) and not value.is_meta and not isinstance(value, torch.nn.Parameter):
            ptr, nbytes = _storage(value)
            self.seen.append((weakref.ref(value), ptr, nbytes))

    @property
    def saved_bytes(self) -> int:
        return self.plan.saved_bytes if self.plan is not None else 0


def survey_step(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Storages]:
    """Run forward once through Dynamo, without autograd and without a trace (buffers and random
    states put back): per graph call in order, the parameters it uses that get gradients."""
    from fxmem.trace.capture import untouched

    calls: list[Storages] = []

    def recorder(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        def run(*inputs: Any) -> Any:
            calls.append(dict(_storage(t) for t in inputs if isinstance(t, torch.nn.Parameter) and t.requires_grad))
            return gm.forward(*inputs)
        return run

    with untouched(model), torch.no_grad():
        torch.compile(model, backend=recorder)(*args, **kwargs)
    return calls


@dataclass
class Ledger:
    """The graphs planned so far by one torch.compile call (one `options` dict)."""

    budget_bytes: int
    model: torch.nn.Module | None = None
    survey: list[Storages] | None = None  # per graph call of one step, in order: the parameters it uses
    model_name: str = ""  # the name plans of this step carry
    records: list[GraphRecord] = field(default_factory=list)
    shares: Any = None  # the step's graphs at their least, when the budget is shared (fxmem.run.dynamo.shared_budget)
    runs: dict[int, int] = field(default_factory=dict)  # graph index -> calls a step makes of it, if not one
    eager: dict[int, int] = field(default_factory=dict)  # graph index -> what eager code keeps as it runs
    tail: tuple[int | None, int] = (None, 0)  # (the last graph, what the eager code after it adds in backward)

    def latest(self) -> list[GraphRecord]:
        """The newest record per frame (a recompilation of a frame replaces its entry)."""
        by_frame: dict[Any, GraphRecord] = {}
        for r in self.records:
            by_frame[r.frame if r.frame is not None else id(r)] = r
        return list(by_frame.values())

    def position(self, record: GraphRecord) -> int:
        """Where `record`'s graph runs in the step: the index of its frame's first record (a recompilation
        of a frame, as after a guard fails in a later step, runs where the graph it replaces ran)."""
        if record.frame is None:
            return record.index
        return next((r.index for r in self.records if r.frame == record.frame), record.index)

    def held_for(self, record: GraphRecord, count_saved: bool = True) -> tuple[int, int]:
        """Bytes the rest of the step holds while `record`'s graph runs forward, and backward; without
        `count_saved`, less what earlier graphs keep for their backward (the part a plan decides)."""
        others = [r for r in self.latest() if r.frame != record.frame or r.frame is None]
        state: Storages = {}
        if self.model is not None:
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                ptr, nbytes = _storage(t)
                state[ptr] = nbytes
        for r in others:
            state.update(r.state)
        own = record.state.keys() | record.inputs.keys()
        alive: Storages = {}
        for r in others:
            for ref, ptr, nbytes in r.seen:
                if ref() is not None and ptr not in own and ptr not in state:
                    alive[ptr] = nbytes
        position = self.position(record)
        forward = sum(b for p, b in state.items() if p not in own) + sum(alive.values()) \
            + (self.earlier_saved(record) if count_saved else 0) + self.eager.get(position, 0)
        tail = self.tail[1] if position == self.tail[0] else 0
        return forward, forward + sum(self.later_grads(record).values()) + tail

    def earlier_saved(self, record: GraphRecord) -> int:
        """Bytes the graphs that run before `record`'s keep for their backward while it runs
        (a graph a loop calls once per layer, once per run)."""
        others = [r for r in self.latest() if r.frame != record.frame or r.frame is None]
        first: dict[Any, int] = {}
        for r in self.records:
            first.setdefault(r.frame if r.frame is not None else id(r), r.index)
        order = first.get(record.frame if record.frame is not None else id(record), record.index)
        # a recompiled frame runs as often as the graph it replaces
        return sum(r.saved_bytes * self.runs.get(self.position(r), 1) for r in others
                   if first.get(r.frame if r.frame is not None else id(r), r.index) < order)

    def later_grads(self, record: GraphRecord) -> Storages:
        """Gradients later graph calls of the step produce before this graph's backward runs."""
        if not self.survey:
            return {}
        done = sum(1 for r in self.records if r is not record and r.plan is not None)
        position = next((i for i in range(done, len(self.survey)) if self.survey[i].keys() == record.grads.keys()),
                        next((i for i, s in enumerate(self.survey) if s.keys() == record.grads.keys()), None))
        if position is None:
            return {}
        later: Storages = {}
        for call in self.survey[position + 1:]:  # a weight this graph shares (tied) has its gradient already:
            later.update(call)  # this graph's backward makes a second one and adds it in
        return later

    @property
    def plans(self) -> list[Plan]:
        return [r.plan for r in self.records if r.plan is not None]
