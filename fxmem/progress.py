"""Progress on stderr while capture, costing and solving run: a spinner line on a terminal once a
stage has taken longer than a second, plain one-line stage messages otherwise (the CLI), or nothing
otherwise (the Python API: `planning(...)`).

Reads the records of the "fxmem" logger (the planner logs each stage) to name the stage, and the
environment variable FXMEM_PROGRESS ("0": the Python API shows no progress); writes to stderr only,
and nothing at all when quiet. Only the outermost of nested progress displays shows anything.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO

SPINNER = "|/-\\"
DELAY_S = 1.0
_SHOWING = threading.local()  # whether a Progress is open on this thread (an inner one stays silent)


class Progress(logging.Handler):
    """Context manager: `with Progress("planning gpt-tiny", time_limit_s=10) as p: ...; p.stage("...")`.

    On a TTY a background thread redraws `<spinner> <stage>  [#####.....] 3.1 s` (the bar fills with
    the solver's time limit while solving) after DELAY_S; elsewhere each stage is one line, or
    nothing with `lines=False`."""

    def __init__(self, title: str, *, time_limit_s: float | None = None, quiet: bool = False,
                 stream: IO[str] | None = None, tty: bool | None = None, lines: bool = True):
        super().__init__(level=logging.INFO)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.lines = lines
        self.quiet = quiet or (not self.tty and not lines)
        self.title = title
        self.time_limit_s = time_limit_s
        self.current = title
        self.stage_started = self.started = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drawn = False

    # ---- stages ------------------------------------------------------------------------------
    def stage(self, text: str) -> None:
        with self._lock:
            self.current, self.stage_started = text, time.perf_counter()
            if not self.quiet and not self.tty:
                print(f"fxmem: {text}", file=self.stream, flush=True)

    def emit(self, record: logging.LogRecord) -> None:  # logging.Handler
        message = record.getMessage()
        if message.startswith("joint graph") and self.time_limit_s:
            message = f"solving ({message})"
        self.stage(message)

    # ---- drawing -----------------------------------------------------------------------------
    def _line(self, tick: int) -> str:
        now = time.perf_counter()
        bar = ""
        if self.time_limit_s and self.current.startswith(("solving", "cpsat", "greedy", "searching")):
            done = min(1.0, (now - self.stage_started) / self.time_limit_s)
            bar = f" [{'#' * int(done * 20):.<20}]"
        return f"{SPINNER[tick % len(SPINNER)]} {self.current[:90]}{bar} {now - self.started:.1f} s"

    def _run(self) -> None:
        tick = 0
        if self._stop.wait(DELAY_S):
            return
        while True:
            with self._lock:
                line = self._line(tick)
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
                self._drawn = True
            tick += 1
            if self._stop.wait(0.1):
                return

    def __enter__(self) -> "Progress":
        self._outer = not getattr(_SHOWING, "on", False)
        if not self._outer or (self.quiet and not self.lines):
            self._outer = False
            return self  # an inner display, or one that shows nothing: leave logging as it is
        _SHOWING.on = True
        logging.getLogger("fxmem").addHandler(self)
        self._level = logging.getLogger("fxmem").level
        logging.getLogger("fxmem").setLevel(logging.INFO)
        if self.quiet:
            return self
        if self.tty:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            print(f"fxmem: {self.title}", file=self.stream, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._outer:
            return
        _SHOWING.on = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
        logging.getLogger("fxmem").removeHandler(self)
        logging.getLogger("fxmem").setLevel(self._level)
        if not self.quiet and exc[0] is None and (self.lines or self._drawn):
            print(f"fxmem: done in {time.perf_counter() - self.started:.1f} s", file=self.stream, flush=True)


def planning(title: str, time_limit_s: float | None = None) -> Progress:
    """Progress for the Python API: on a terminal, a spinner and the solver's bar once planning has taken
    a second; nothing elsewhere, inside the CLI's own display, or with FXMEM_PROGRESS=0."""
    return Progress(title, time_limit_s=time_limit_s, quiet=os.environ.get("FXMEM_PROGRESS") == "0", lines=False)
