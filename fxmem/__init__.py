"""fxmem: fit a PyTorch training step into a memory budget at the least recompute cost.

    plan = fxmem.plan(model, example_inputs=(x,), budget_gb=8.0)
    print(plan.table())
    model2 = fxmem.optimize(model, plan=plan)      # or fxmem.optimize(model, budget_gb=8.0)
"""
from fxmem.capture import capture
from fxmem.cost import DeviceSpec
from fxmem.errors import FxmemError, InfeasibleBudgetError, PlanMismatchError, TraceError
from fxmem.plan import Plan
from fxmem.runtime import OptimizedModule, optimize, plan
from fxmem import pipeline
from fxmem.pipeline import pipeline_stage

__version__ = "0.1.0"

__all__ = [
    "plan", "optimize", "pipeline_stage", "capture", "Plan", "DeviceSpec", "OptimizedModule",
    "FxmemError", "InfeasibleBudgetError", "TraceError", "PlanMismatchError", "__version__",
]
