"""Where decodescope's log records go.

Modules only log (`log = logging.getLogger(__name__)`).
The process that runs them chooses the destination here.

- The runner (`decodescope run`) shows the records on the terminal as plain lines.
  It also keeps them in the run's logs/decodescope.log.
- A phase's notebook kernel writes them to that file alone.
  Its stdout and stderr would reach report.html: papermill records them as cell outputs.
- A torchrun probe writes plain lines to its stderr, which the probe's log file holds.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, TextIO

ROOT = "decodescope"          # every module's logger is a child of this one
LOG_FILE = "decodescope.log"  # under the run directory's logs/
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PLAIN_FORMAT = "%(message)s"
_MARK = "_decodescope_handler"  # set on the handlers this module installs


def _install(handler: logging.Handler, fmt: str) -> logging.Handler:
    handler.setFormatter(logging.Formatter(fmt))
    setattr(handler, _MARK, True)
    logger = logging.getLogger(ROOT)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


def file_handler(path: Path) -> logging.Handler:
    """Appends every record, time-stamped and with its module's name, to path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return _install(logging.FileHandler(path, encoding="utf-8"), FILE_FORMAT)


class _Plain(logging.Formatter):
    """The message alone; a warning or an error says so first ("warning: ...")."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname.lower()}: {text}" if record.levelno >= logging.WARNING else text


def stream_handler(stream: Optional[TextIO] = None) -> logging.Handler:
    """Writes each record's message alone, one line each, to stream (default: stderr)."""
    handler = _install(logging.StreamHandler(stream or sys.stderr), PLAIN_FORMAT)
    handler.setFormatter(_Plain(PLAIN_FORMAT))
    return handler


def remove_handler(handler: logging.Handler) -> None:
    logging.getLogger(ROOT).removeHandler(handler)
    handler.close()


@contextmanager
def logging_to(*handlers: logging.Handler) -> Iterator[None]:
    """The handlers installed for the block's duration, then removed and closed."""
    try:
        yield
    finally:
        for h in handlers:
            remove_handler(h)


def log_only_to_file(path: Path) -> logging.Handler:
    """For a phase's kernel: records go to path and nowhere else. Handlers installed by an earlier call
    are removed, and records stop at decodescope's logger, so no handler of the root logger (nor Python's
    last-resort stderr handler) turns them into cell output."""
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        remove_handler(h)
    logger.propagate = False
    return file_handler(path)


def log_plainly_to_stderr() -> None:
    """For a program of its own (a torchrun probe): plain lines on stderr. The root logger is set, since
    a module run as `python -m` logs as `__main__`, outside decodescope's logger."""
    logging.basicConfig(level=logging.INFO, format=PLAIN_FORMAT, stream=sys.stderr)


def run_program(main: Callable[[], int]) -> NoReturn:
    """A probe's `__main__`: its records as plain lines on stderr, then main's status as the exit status."""
    log_plainly_to_stderr()
    sys.exit(main())
