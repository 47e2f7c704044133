"""Progress on stderr: stage lines when not a terminal, a spinner on one, nothing when quiet."""
from __future__ import annotations

import io
import logging
import time

from fxmem import progress
from fxmem.progress import Progress

log = logging.getLogger("fxmem")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_prints_one_line_per_stage():
    out, handlers = io.StringIO(), list(log.handlers)
    with Progress("planning m", stream=out, time_limit_s=10):
        log.info("joint graph: 3 forward ops")
        log.info("cpsat: optimal in 0.1 s")
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["fxmem: planning m", "fxmem: solving (joint graph: 3 forward ops)",
                         "fxmem: cpsat: optimal in 0.1 s"]
    assert lines[3].startswith("fxmem: done in") and "\r" not in out.getvalue()
    assert log.handlers == handlers
    out = io.StringIO()
    with Progress("estimating m", stream=out):  # no solver: the stage is not called solving
        log.info("joint graph: 3 forward ops")
    assert out.getvalue().splitlines()[1] == "fxmem: joint graph: 3 forward ops"


def test_quiet_prints_nothing():
    out = io.StringIO()
    with Progress("planning m", stream=out, quiet=True):
        log.info("joint graph: 3 forward ops")
    assert out.getvalue() == ""


def test_terminal_draws_a_spinner_after_the_delay(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    out = _Terminal()
    with Progress("planning m", stream=out, time_limit_s=1.0):
        log.info("joint graph: 3 forward ops")
        time.sleep(0.4)
    text = out.getvalue()
    assert "\r\033[K" in text and "solving (joint graph" in text and "[" in text and "fxmem: done in" in text
    assert "fxmem: solving" not in text  # no stage lines on a terminal: the spinner shows them


def _plan_mlp():
    import fxmem
    from fxmem import models

    return fxmem.plan(models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny"), budget_gb=1.0)


def test_python_api_shows_progress_on_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    _plan_mlp()
    text = terminal.getvalue()
    assert "\r\033[K" in text and "planning MLP (float32[16,32], int64[16])" in text and "fxmem: done in" in text


def test_python_api_is_silent_elsewhere(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    level, handlers = log.level, list(log.handlers)
    _plan_mlp()
    assert out.getvalue() == "" and log.level == level and log.handlers == handlers
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setenv("FXMEM_PROGRESS", "0")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    _plan_mlp()
    assert terminal.getvalue() == ""


def test_inside_the_cli_display_the_api_adds_nothing():
    out = io.StringIO()
    with Progress("planning m", stream=out, time_limit_s=10):
        _plan_mlp()
    lines = out.getvalue().splitlines()
    assert lines[0] == "fxmem: planning m" and lines[-1].startswith("fxmem: done in")
    assert sum(line.startswith("fxmem: done in") for line in lines) == 1 and "\r" not in out.getvalue()


def test_every_plan_shows_the_line_however_it_is_reached(monkeypatch):
    """The torch.compile backend's graphs and each new input shape of fxmem.optimize show what fxmem.plan shows."""
    import torch

    import fxmem
    from fxmem import models

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    torch._dynamo.reset()
    model = models.from_name("mlp-tiny")
    compiled = torch.compile(model, backend="fxmem", dynamic=False, options={"budget_gb": 1.0, "inner": "aot_eager"})
    try:
        compiled(*models.example_inputs("mlp-tiny")).backward()
    finally:
        torch._dynamo.reset()
    text = terminal.getvalue()
    assert "planning Dynamo graph 1 (" in text and "float32[16,32]" in text and "fxmem: done in" in text
    terminal.truncate(0)
    terminal.seek(0)
    step = fxmem.optimize(model, budget_gb=1.0)
    for batch in (16, 8, 16):  # the third call's shape is planned already: no line
        step(*models.example_inputs("mlp-tiny", batch)).backward()
    text = terminal.getvalue()
    assert text.count("fxmem: done in") == 2
    assert "planning MLP (float32[16,32], int64[16])" in text and "planning MLP (float32[8,32], int64[8])" in text
