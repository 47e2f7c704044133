"""fxmem: fit a PyTorch training step into a memory budget at the least recompute cost.

    plan = fxmem.plan(model, example_inputs=(x,), budget_gb=8.0)
    print(plan.table())
    model2 = fxmem.optimize(model, plan=plan)      # or fxmem.optimize(model, budget_gb=8.0)

The public API, and nothing else. Names are imported on first use, so `import fxmem` (and the
torch-free solvers under `fxmem.solve`) load without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "plan": "fxmem.api", "optimize": "fxmem.ranks", "OptimizedModule": "fxmem.run.engine",
    "pipeline_stage": "fxmem.dist.pipeline", "capture": "fxmem.trace.capture", "Plan": "fxmem.planner.plan",
    "DeviceSpec": "fxmem.price.cost", "HostLink": "fxmem.price.cost",
    "FxmemError": "fxmem.errors", "InfeasibleBudgetError": "fxmem.errors", "TraceError": "fxmem.errors",
    "PlanMismatchError": "fxmem.errors", "CallError": "fxmem.errors", "LossFnError": "fxmem.trace.step_module",
    "PolicyError": "fxmem.planner.policies",
    "estimate": "fxmem.tools.estimate", "Estimate": "fxmem.tools.estimate", "max_batch_size": "fxmem.tools.capacity",
    "fit_batch": "fxmem.tools.batch_fit", "BatchFit": "fxmem.tools.batch_fit",
    "Loss": "fxmem.planner.options", "Pipeline": "fxmem.planner.options", "Solver": "fxmem.planner.options",
    "check_plan": "fxmem.tools.check_plan", "pack_buffers": "fxmem.solve.packing", "Packing": "fxmem.solve.packing",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fxmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

