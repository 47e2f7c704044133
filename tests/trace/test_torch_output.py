"""held_output: what torch logs while tracing reaches the handlers it was meant for, and only those."""
from __future__ import annotations

import io
import logging

import pytest

from fxmem.trace.torch_output import held_output


@pytest.fixture
def two_loggers():
    """A 'torch'-like parent with a stderr-like handler, and a child with its own handler that does not
    propagate (as torch's trace log does)."""
    parent, child = logging.getLogger("fxmemtest"), logging.getLogger("fxmemtest.trace")
    out_parent, out_child = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(out_parent), logging.StreamHandler(out_child)]
    parent.addHandler(handlers[0])
    child.addHandler(handlers[1])
    child.propagate, child.level, parent.level = False, logging.DEBUG, logging.WARNING
    yield parent, child, out_parent, out_child
    parent.removeHandler(handlers[0])
    child.removeHandler(handlers[1])


def test_records_are_replayed_to_their_own_handler(two_loggers):
    parent, child, out_parent, out_child = two_loggers
    with held_output("fxmemtest"):
        child.debug("trace record")
        parent.warning("a warning")
        assert out_parent.getvalue() == out_child.getvalue() == "", "held back while tracing"
    assert out_child.getvalue() == "trace record\n"
    assert out_parent.getvalue() == "a warning\n", "the child's record does not reach the parent's handler"


def test_failure_keeps_the_output_on_the_exception(two_loggers):
    parent, _, out_parent, _ = two_loggers
    with pytest.raises(RuntimeError) as info:
        with held_output("fxmemtest"):
            parent.warning("partial graph")
            raise RuntimeError("trace failed")
    assert "partial graph" in info.value.torch_output and out_parent.getvalue() == ""
