"""passes/host_gradients.py on a joint graph: the chosen gradients go to a sink inside backward and are returned as
None; the memory simulator then sees them freed on the device; the joint given is left as it was."""
import pytest
import torch

from fxmem.passes.host_gradients import GradientSink, host_gradient_joint, to_host
from fxmem.passes.recompute import partition
from fxmem.price.memory import graph_outputs, simulate_step
from fxmem.run.engine import graph_state_names, traced_joint
from fxmem.trace.capture import capture


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(2, 64)
    gm = capture(model, (x,), {})
    joint, num_fwd_outputs = traced_joint(model, gm, (x,), {})
    return model, joint, num_fwd_outputs, tuple(graph_state_names(model, gm))


def saved(joint):
    return [n.name for n in joint.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]


def test_chosen_gradients_leave_the_backward_graph(traced):
    model, joint, num_fwd_outputs, names = traced
    before = list(joint.graph.nodes)
    rewritten, sink = host_gradient_joint(joint, ("0.weight", "2.weight"), names)
    assert list(joint.graph.nodes) == before  # the joint given is not changed
    calls = list(rewritten.graph.find_nodes(op="call_function", target=to_host))
    assert sorted(c.args[1] for c in calls) == ["0.weight", "2.weight"]
    assert all(c.args[0] == sink.id and c.meta["partitioner_tag"] == "is_backward" for c in calls)
    fw, bw = partition(rewritten, saved(rewritten), num_fwd_outputs=num_fwd_outputs)
    assert len(list(bw.graph.find_nodes(op="call_function", target=to_host))) == 2  # kept in backward
    assert not list(fw.graph.find_nodes(op="call_function", target=to_host))
    returned = graph_outputs(bw)
    assert sum(out is None for out in returned) == sum(out is None for out in graph_outputs(
        partition(joint, saved(joint), num_fwd_outputs=num_fwd_outputs)[1])) + 2
    plain = simulate_step(*partition(joint, saved(joint), num_fwd_outputs=num_fwd_outputs), num_fwd_outputs).peak
    moved = simulate_step(fw, bw, num_fwd_outputs).peak
    assert moved < plain  # the two weights' gradients are not held to the end of backward


def test_no_names_no_copy_and_unknown_names_refused(traced):
    _, joint, _, names = traced
    assert host_gradient_joint(joint, (), names) == (joint, None)
    with pytest.raises(ValueError, match="no such parameter"):
        host_gradient_joint(joint, ("nope.weight",), names)


def test_a_sink_nobody_receives_refuses_in_one_line():
    sink = GradientSink(("w",))
    with pytest.raises(RuntimeError, match="no optimizer receives it"):
        to_host(sink.id, "w", torch.ones(2))
    got = []
    sink.connect(lambda name, grad: got.append((name, grad.sum().item())))
    to_host(sink.id, "w", torch.ones(2))
    assert got == [("w", 2.0)]
