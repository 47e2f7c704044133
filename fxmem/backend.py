"""`torch.compile` backend: AOTAutograd with fxmem's planner as the partitioner, under a budget.

    model = torch.compile(model, backend="fxmem", options={"budget_gb": 2.0})

Dynamo hands each captured graph to `fxmem_backend`; AOTAutograd traces its joint forward/backward
graph and `fxmem.planner.planner.Planner` (the same planner `fxmem.plan`/`fxmem.optimize` use) picks what to
save and what to recompute so the simulated step fits the budget. The forward and backward graphs
then run through boxed_nop ("aot_eager") or Inductor ("inductor"; the plan is then fitted to the step
as Inductor fuses it, `fxmem.run.inductor.planning`, and predicts that step's peak and time). Random ops may be recomputed and draw
the numbers forward drew: eager's kernels replayed from a saved generator state (passes/rng.py), or
Inductor's own draws recomputed from the per-graph seeds the plan keeps (docs/compile-random.md).

Budget across graph breaks: one `torch.compile(...)` call has one ledger (`fxmem.run.dynamo.ledger`). Graph k
of a step is planned for the whole `budget_gb`, with what the rest of the step holds while its
forward and its backward run (other graphs' parameters and saved values, the tensors passed
between graphs, later graphs' gradients) added to its simulated memory, so each graph's predicted
peak is the step's peak while it runs. A recompilation of a frame replaces that frame's entry and,
where the step's graphs share the budget (`fxmem.run.dynamo.shared_budget`), keeps to the share of the graph it
replaces.
Reads nothing from disk; writes the plans to `plan_out` (one file per graph: `<stem>.<k>.json`) when asked.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fxmem.error_boundary import for_dynamo
from fxmem.run.dynamo.compile import compile_graph, has_cxx_compiler, ledger_of, plans_for, reset, settings_of
from fxmem.run.planners import plan_path, recording_planner

__all__ = ["fxmem_backend", "plans_for", "plan_path", "has_cxx_compiler"]


@for_dynamo
def fxmem_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None
                  ) -> Callable[..., Any]:
    """TorchDynamo backend: plan each captured graph's training step under `options["budget_gb"]`.

    options: budget_gb (required, GiB per training step, shared by all graphs of one step),
    inner ("inductor" when a C++ compiler is found, else "aot_eager"), time_limit_s (solver, default 10),
    plan_out (write each graph's plan to `<stem>.<k>.json`), verbose (print each plan's table),
    device (DeviceSpec or preset name used for pricing recompute; default: the preset of the device the
    graph's tensor inputs live on, e.g. "h100" for a model on an H100), solver (default "auto").
    """
    settings = settings_of(options)
    ledger = ledger_of(options, settings)
    return compile_graph(gm, example_inputs, settings, ledger, recording_planner(ledger, settings))

fxmem_backend.reset = reset  # type: ignore[attr-defined]  # called by torch._dynamo.reset()
