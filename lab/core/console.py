"""The lab's progress messages: `logging`, under the "lab" logger.

Every module logs to `logging.getLogger(__name__)` (lab.runner, lab.fabric.network,
lab.experiments.incast, ...). Used as a library (lab/api.py) the lab stays quiet
unless the program configures logging (warnings still reach stderr through Python's
last-resort handler); the CLI calls `attach()`: one line per message, the seconds
since the command started in front, so a long run shows where its time goes.

    with console.nested():      # a tour's chapter: the run's own lines indented under it
        runner.run(...)
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator

# Mininet's log module makes every logger created after its import a MininetLogger,
# with a console handler of its own and a level (OUTPUT) above INFO: the lab's loggers
# would drop their INFO lines and print their warnings twice. Mininet is imported first
# (its "mininet" logger keeps its class); every logger after it is a plain Logger.
# lab/__init__.py imports this module, so this runs before any lab module's getLogger.
# (The controller apps' interpreter may have no Mininet: nothing to undo there.)
try:
    import mininet.log  # noqa: F401
except ImportError:
    pass
logging.setLoggerClass(logging.Logger)

ROOT = "lab"


class _Console(logging.Handler):
    """Writes to sys.stdout or sys.stderr as they are at each message (a caller that
    swaps them, as pytest does, is followed)."""

    def __init__(self, to: str):
        super().__init__()
        self.to = to
        self.t0 = time.time()          # (a record's `created` is wall-clock time too)
        self.depth = 0

    def emit(self, record: logging.LogRecord) -> None:
        warn = "warning: " if record.levelno >= logging.WARNING else ""
        try:
            stream = getattr(sys, self.to)
            stream.write(f"[{record.created - self.t0:6.1f} s] {'  ' * self.depth}{warn}"
                         f"{record.getMessage()}\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_handler: _Console | None = None


def attach(to: str = "stdout", level: int = logging.INFO) -> None:
    """Print the lab's messages on sys.stdout (or "stderr"), the elapsed time first.
    Called again, it restarts the clock and moves to the new stream."""
    global _handler
    logger = logging.getLogger(ROOT)
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = _Console(to)
    logger.addHandler(_handler)
    logger.setLevel(level)
    logger.propagate = False       # printed once, not again by a root handler


@contextlib.contextmanager
def nested() -> Iterator[None]:
    """Indent the console's lines by one step while inside."""
    if _handler is None:
        yield
        return
    _handler.depth += 1
    try:
        yield
    finally:
        _handler.depth -= 1
