"""The step's pass sequence: each pass is `(graphs, plan) -> graphs` over one training step's graphs.

Reads a `StepGraphs` (AOTAutograd's joint graph, and once the recompute pass has run, the forward and
backward graphs it extracted) and the `Plan` whose decisions the passes carry out; returns the
rewritten `StepGraphs`. On failure names the pass that failed and those that ran before it; checks
every graph a pass returns with `graph.lint()`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch.fx


@dataclass(frozen=True)
class StepGraphs:
    """One training step's graphs. `joint`: AOTAutograd's joint forward/backward graph, whose first
    `num_fwd_outputs` outputs the caller receives; `fw` / `bw`: the extracted forward and backward
    graphs (None until the recompute pass runs). `seconds`: estimated seconds per joint node and
    `host_link` (a `fxmem.price.cost.HostLink`): the offload pass's clock; `pool`: False, True or "all"
    (see passes/pool.py); `replay_ops`: see passes/rng.py."""

    joint: torch.fx.GraphModule
    num_fwd_outputs: int
    fw: torch.fx.GraphModule | None = None
    bw: torch.fx.GraphModule | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    host_link: Any = None
    pool: bool | str = False
    replay_ops: str = "functions"  # how passes/rng.py replays random ops: "functions", or "torch" for Inductor

    def replace(self, **changes: Any) -> "StepGraphs":
        return dataclasses.replace(self, **changes)


StepPass = Callable[[StepGraphs, Any], StepGraphs]


class PassError(RuntimeError):
    pass


def run_passes(graphs: StepGraphs, plan: Any, passes: Sequence[StepPass]) -> StepGraphs:
    """Run `passes` in order on `graphs` with `plan`; lint every graph each one returns."""
    done: list[str] = []
    for step_pass in passes:
        name = getattr(step_pass, "__name__", repr(step_pass))
        try:
            graphs = step_pass(graphs, plan)
            for gm in (graphs.joint, graphs.fw, graphs.bw):
                if gm is not None:
                    gm.graph.lint()
        except Exception as exc:
            after = f" (after {', '.join(done)})" if done else ""
            raise PassError(f"pass {name} failed{after}: {exc}") from exc
        done.append(name)
    return graphs
