"""The run's progress as log records: a line per phase as it starts and ends, and a tick while it runs.
`run_logging` decides where the records of a run's own process go: the terminal and logs/decodescope.log."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from decodescope.core.logsetup import LOG_FILE, ROOT, file_handler, logging_to, stream_handler
from decodescope.core.rundir import LOGS

log = logging.getLogger(__name__)


@contextmanager
def run_logging(run_dir: Path) -> Iterator[None]:
    """For the run's duration: records as plain lines on stderr (unless a handler already shows them
    there) and, time-stamped, in the run's logs/decodescope.log, which the phases' kernels append to."""
    shown = any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                for h in logging.getLogger(ROOT).handlers)
    handlers = [file_handler(Path(run_dir) / LOGS / LOG_FILE)] + ([] if shown else [stream_handler()])
    with logging_to(*handlers):
        yield


class Progress:
    """One line per phase with elapsed time; a ticker keeps long phases visibly alive."""

    def __init__(self, total: int, tick_s: float = 15.0):
        self.total, self.tick_s = total, tick_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, i: int, phase: str) -> None:
        self.t0 = time.monotonic()
        self.label = f"[{i}/{self.total}] {phase}"
        log.info("%s ... started", self.label)
        self._stop.clear()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            log.info("%s ... %.0f s", self.label, time.monotonic() - self.t0)

    def end(self, status: str, detail: str = "") -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        log.info("%s ... %s (%.1f s)%s", self.label, status, time.monotonic() - self.t0, detail)

    def note(self, text: str) -> None:
        log.info(text)

    def warn(self, text: str) -> None:
        log.warning(text)
