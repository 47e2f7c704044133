"""Runs a list of graph passes in order and checks the graph after each.

Reads and writes whatever the passes do; on failure names the pass that failed and the ones
that ran before it, and checks every result with `graph.lint()`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch.fx

GraphPass = Callable[..., torch.fx.GraphModule]


class PassError(RuntimeError):
    pass


def run_passes(gm: torch.fx.GraphModule, passes: Sequence[GraphPass], *args, **kwargs) -> torch.fx.GraphModule:
    done: list[str] = []
    for graph_pass in passes:
        name = getattr(graph_pass, "__name__", repr(graph_pass))
        try:
            result = graph_pass(gm, *args, **kwargs)
            result = gm if result is None else result
            result.graph.lint()
        except Exception as exc:
            after = f" (after {', '.join(done)})" if done else ""
            raise PassError(f"pass {name} failed{after}: {exc}") from exc
        gm = result
        done.append(name)
    return gm
