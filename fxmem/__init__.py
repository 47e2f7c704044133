"""fxmem: fit a PyTorch training step into a memory budget at the least recompute cost.

    plan = fxmem.plan(model, example_inputs=(x,), budget_gb=8.0)
    print(plan.table())
    model2 = fxmem.optimize(model, plan=plan)      # or fxmem.optimize(model, budget_gb=8.0)
"""
from fxmem.capture import capture
from fxmem.cost import DeviceSpec, HostLink
from fxmem.errors import FxmemError, InfeasibleBudgetError, PlanMismatchError, TraceError
from fxmem.plan import Plan
from fxmem.runtime import OptimizedModule, optimize, plan
from fxmem.estimate import Estimate, estimate
from fxmem.capacity import max_batch_size
from fxmem.check import check_plan
from fxmem.solve.pack import Packing, pack_buffers
from fxmem.pipeline import pipeline_stage

__version__ = "0.1.0"

__all__ = [
    "plan", "optimize", "pipeline_stage", "capture", "Plan", "DeviceSpec", "HostLink", "OptimizedModule",
    "FxmemError", "InfeasibleBudgetError", "TraceError", "PlanMismatchError", "__version__",
    "estimate", "Estimate", "max_batch_size", "check_plan",
    "pack_buffers", "Packing",
]
