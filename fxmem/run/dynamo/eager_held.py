"""What the eager code between a step's Dynamo graphs keeps for its backward, which no graph's plan decides.

Dynamo runs the Python between its graphs eagerly (a loss after a data-dependent `masked_select`, a mask drawn
with NumPy): its ops save tensors for their backward as eager PyTorch does, and those stay alive until the
step's backward reaches them, while every later graph runs. The ledger (`fxmem.run.dynamo.ledger`) sees only
what graphs take and return; this module counts the rest, on the probe of the step (`fxmem.run.dynamo.step`):
at each graph call, the saved tensors of the autograd history its inputs carry back to the graphs before it
(the probe cuts each graph's outputs from autograd, so the history of one region of eager code ends at the
graph before), and, after the last graph, the eager code's saved tensors and what its backward allocates.

Reads the probe's graph inputs and outputs and its loss; writes nothing. Counted by storage, less the model's
parameters and buffers and every tensor a graph takes or returns (the ledger counts those), so no byte is
counted twice; a region's saved tensors count from the graph after it to the step's end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from fxmem.run.dynamo.ledger import _storage


@dataclass
class EagerHeld:
    """The eager code's saved bytes, met graph call by graph call on the probe."""

    excluded: set[int] = field(default_factory=set)  # storages the ledger counts: state, graph inputs, outputs
    saved: dict[int, int] = field(default_factory=dict)  # storage -> bytes, saved by eager ops so far
    at_graph: dict[int, int] = field(default_factory=dict)  # graph record index -> eager saved bytes as it runs
    last: int | None = None  # the last graph called

    def exclude(self, tensors: Iterable[Any]) -> None:
        """Storages counted elsewhere (the model's state; what a graph takes or returns)."""
        self.excluded.update(_storage(t)[0] for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta)

    def graph_called(self, index: int, inputs: Iterable[Any]) -> None:
        """Graph `index` is called with `inputs`: the eager history they carry joins the count."""
        inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        self._collect(t.grad_fn for t in inputs)
        self.exclude(inputs)
        self.at_graph[index] = max(self.at_graph.get(index, 0), self.bytes())
        self.last = index

    def bytes(self) -> int:
        return sum(b for ptr, b in self.saved.items() if ptr not in self.excluded)

    def tail(self, loss: torch.Tensor, cut: list[torch.Tensor]) -> int:
        """Bytes the eager code after the last graph adds at the start of backward: what it saved, and the most
        its backward allocates on the way to the graphs' outputs (`cut`; no parameter gets a gradient). The probe's
        last use of its history: that backward frees it."""
        from torch.distributed._tools.mem_tracker import MemTracker

        before = self.at_graph.get(self.last, 0) if self.last is not None else 0
        self._collect([loss.grad_fn])
        saved = self.bytes() - before
        wanted = [t for t in cut if t.requires_grad]
        if not wanted:
            return saved
        tracker = MemTracker()
        with tracker:
            grads = torch.autograd.grad(loss, wanted, allow_unused=True)
            del grads
        return saved + max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())

    def _collect(self, roots: Iterable[Any]) -> None:
        """Walk the autograd history from `roots` (holding no node after: a node holds its saved tensors)."""
        stack, visited = [fn for fn in roots if fn is not None], set()
        while stack:
            fn = stack.pop()
            if fn in visited:
                continue
            visited.add(fn)
            for name in dir(fn):
                if name.startswith("_saved_"):
                    try:
                        value = getattr(fn, name)
                    except RuntimeError:  # freed already (a backward ran through it)
                        continue
                    for t in value if isinstance(value, (tuple, list)) else (value,):
                        if isinstance(t, torch.Tensor) and not t.is_meta:
                            ptr, nbytes = _storage(t)
                            self.saved[ptr] = nbytes
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
