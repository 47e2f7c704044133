"""The step's pass sequence (passes/runner.py): passes run in order on the step's graphs, a failure
names the failing pass and those before it, and every graph a pass returns is linted."""
from __future__ import annotations

import pytest
import torch

from fxmem.passes.runner import PassError, StepGraphs, run_passes
from tests.conftest import joint_of


def _graphs() -> StepGraphs:
    joint, n = joint_of(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4))
    return StepGraphs(joint, n)


def test_passes_run_in_order_with_the_plan():
    seen = []

    def first(graphs, plan):
        seen.append(("first", plan))
        return graphs.replace(pool=True)

    def second(graphs, plan):
        seen.append(("second", graphs.pool))
        return graphs

    out = run_passes(_graphs(), "the plan", [first, second])
    assert seen == [("first", "the plan"), ("second", True)] and out.pool is True


def test_runner_names_failing_pass():
    def first(graphs, plan):
        return graphs

    def broken(graphs, plan):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"pass broken failed \(after first\): boom"):
        run_passes(_graphs(), None, [first, broken])


def test_a_pass_that_breaks_a_graph_is_caught():
    def dangling(graphs, plan):
        gm = graphs.joint
        node = next(iter(gm.graph.find_nodes(op="placeholder")))
        with gm.graph.inserting_before(node):  # a use before its definition: lint refuses it
            gm.graph.call_function(torch.neg, (list(gm.graph.nodes)[-2],))
        return graphs

    with pytest.raises(PassError, match="pass dangling failed"):
        run_passes(_graphs(), None, [dangling])
