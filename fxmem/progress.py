"""Progress on stderr while capture, costing and solving run: a spinner line on a terminal once a
stage has taken longer than a second, plain one-line stage messages otherwise.

Reads the records of the "fxmem" logger (the planner logs each stage) to name the stage; writes
to stderr only, and nothing at all when quiet.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import IO

SPINNER = "|/-\\"
DELAY_S = 1.0


class Progress(logging.Handler):
    """Context manager: `with Progress("planning gpt-tiny", time_limit_s=10) as p: ...; p.stage("...")`.

    On a TTY a background thread redraws `<spinner> <stage>  [#####.....] 3.1 s` (the bar fills with
    the solver's time limit while solving) after DELAY_S; elsewhere each stage is one line."""

    def __init__(self, title: str, *, time_limit_s: float | None = None, quiet: bool = False,
                 stream: IO[str] | None = None, tty: bool | None = None):
        super().__init__(level=logging.INFO)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.quiet = quiet
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
        logging.getLogger("fxmem").removeHandler(self)
        logging.getLogger("fxmem").setLevel(self._level)
        if not self.quiet and exc[0] is None:
            print(f"fxmem: done in {time.perf_counter() - self.started:.1f} s", file=self.stream, flush=True)
