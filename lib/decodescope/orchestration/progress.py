"""The run's progress on the terminal: a line per phase as it starts and ends, and a tick while it runs."""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional


class Progress:
    """One line per phase on the terminal with elapsed time; a ticker keeps long phases visibly alive."""

    def __init__(self, total: int, stream=sys.stderr, tick_s: float = 15.0):
        self.total, self.stream, self.tick_s = total, stream, tick_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, i: int, phase: str) -> None:
        self.t0 = time.monotonic()
        self.label = f"[{i}/{self.total}] {phase}"
        print(f"{self.label} ... started", file=self.stream, flush=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            print(f"{self.label} ... {time.monotonic() - self.t0:.0f} s", file=self.stream, flush=True)

    def end(self, status: str, detail: str = "") -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        print(f"{self.label} ... {status} ({time.monotonic() - self.t0:.1f} s){detail}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
