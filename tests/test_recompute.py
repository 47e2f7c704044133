"""The recompute pass (passes/recompute.py): the backward graph receives exactly the plan's saved
values and recomputes the plan's recomputed ones; joint nodes carry torch's CheckpointPolicy."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

import fxmem
from fxmem import models
from fxmem.capture import capture
from fxmem.engine import CompiledStep, trace_on_fakes
from fxmem.passes.recompute import recompute_pass
from fxmem.passes.runner import StepGraphs
from fxmem.planner import Planner, PlanRequest
from tests.conftest import GIB


class _KeepJoint(Planner):
    def __call__(self, joint, inputs, **kwargs):
        self.joint, self.num_fwd_outputs = joint, kwargs["num_fwd_outputs"]
        return super().__call__(joint, inputs, **kwargs)


def test_backward_receives_the_saved_values_and_recomputes_the_rest():
    torch.manual_seed(0)
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    eager = fxmem.plan(model, inputs)
    plan = fxmem.plan(model, inputs, budget_gb=0.7 * eager.baseline_peak_bytes / GIB, time_limit_s=5)
    assert plan.recompute
    keep = _KeepJoint(PlanRequest(plan=plan, model=plan.model, signature=plan.signature))
    trace_on_fakes(CompiledStep(model, capture(model, inputs, {}), keep), model, inputs, {})

    graphs = recompute_pass(StepGraphs(keep.joint, keep.num_fwd_outputs), plan)
    received = {p.name for p in graphs.bw.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")}
    assert received == set(plan.saved)
    computed = {n.name for n in graphs.bw.graph.nodes if n.op == "call_function"}
    assert set(plan.recompute) <= computed
    policy = {n.name: n.meta.get("recompute") for n in keep.joint.graph.nodes}
    assert {policy[name] for name in plan.recompute} == {CheckpointPolicy.MUST_RECOMPUTE}
    assert {policy[name] for name in plan.saved} == {CheckpointPolicy.MUST_SAVE}
