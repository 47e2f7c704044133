"""Holding back what torch prints while it tries to trace a model.

When `torch.export` fails it prints the partial graph to stderr (twice, from two nested wrappers) and
logs warnings through torch's own handlers, before fxmem turns the failure into one `TraceError`.
`held_output()` collects both while the tracer runs: on success they are passed on unchanged; on
failure they are kept on the exception as `torch_output` and not printed. Reads and writes stderr only.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Iterator


class _Collect(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _handlers_under(name: str) -> list[logging.Handler]:
    """The handlers of `name`'s logger and of every logger below it (torch gives some their own)."""
    loggers = [logging.getLogger(name)] + [
        lg for key, lg in logging.root.manager.loggerDict.items()
        if key.startswith(name + ".") and isinstance(lg, logging.Logger)]
    return list({id(h): h for lg in loggers for h in lg.handlers}.values())


@contextlib.contextmanager
def held_output(logger: str = "torch") -> Iterator[None]:
    """Collect stderr and the records `logger`'s handlers would write; replay them, each to the handler
    that held it back, unless an exception leaves the block, which then carries them as `torch_output`
    (a string)."""
    held = [(handler, _Collect()) for handler in _handlers_under(logger)]
    text = io.StringIO()
    for handler, collect in held:
        handler.addFilter(collect)
    try:
        with contextlib.redirect_stderr(text):
            yield
    except Exception as exc:
        records = {id(r): r for _, collect in held for r in collect.records}.values()
        lines = [text.getvalue()] + [f"{r.levelname} {r.name}: {r.getMessage()}\n" for r in records]
        exc.torch_output = "".join(lines)  # type: ignore[attr-defined]
        raise
    finally:
        for handler, collect in held:
            handler.removeFilter(collect)
    sys.stderr.write(text.getvalue())
    for handler, collect in held:  # each record to the handler that held it back
        for record in collect.records:
            handler.handle(record)
