"""fxmem: fit a PyTorch training step into a memory budget at the least recompute cost.

    plan = fxmem.plan(model, example_inputs=(x,), budget_gb=8.0)
    print(plan.table())
    model2 = fxmem.optimize(model, plan=plan)      # or fxmem.optimize(model, budget_gb=8.0)

The public API, and nothing else. Names are imported on first use, so `import fxmem` (and the
torch-free solvers under `fxmem.solve`) load without torch.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "plan": "fxmem.api", "optimize": "fxmem.api", "OptimizedModule": "fxmem.engine",
    "pipeline_stage": "fxmem.pipeline", "capture": "fxmem.capture", "Plan": "fxmem.plan",
    "DeviceSpec": "fxmem.cost", "HostLink": "fxmem.cost",
    "FxmemError": "fxmem.errors", "InfeasibleBudgetError": "fxmem.errors", "TraceError": "fxmem.errors",
    "PlanMismatchError": "fxmem.errors", "CallError": "fxmem.errors", "LossFnError": "fxmem.step_module",
    "PolicyError": "fxmem.policies",
    "estimate": "fxmem.estimate", "Estimate": "fxmem.estimate", "max_batch_size": "fxmem.capacity",
    "fit_batch": "fxmem.batch_fit", "BatchFit": "fxmem.batch_fit",
    "check_plan": "fxmem.check", "pack_buffers": "fxmem.solve.packing", "Packing": "fxmem.solve.packing",
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


class _Package(types.ModuleType):
    """Three public functions share their name with a submodule (`plan`, `estimate`, `capture`).
    Importing such a submodule would set the package attribute to the module; the function wins."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
