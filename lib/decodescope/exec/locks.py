"""Advisory locks a run holds for its whole life: the server port it launches on and its run directory.

flock(2) locks die with their process, so a crashed or killed run never leaves a stale lock; the lock
file keeps a line saying who holds it, for the error the next run prints.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

LOCK_DIR = Path(os.environ.get("DECODESCOPE_LOCK_DIR", "/tmp/decodescope-locks"))


class LockHeld(RuntimeError):
    """Another run holds the lock; the message says which."""


class FileLock:
    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self._fd: Optional[int] = None

    def acquire(self, holder: dict) -> "FileLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read_holder(fd)
            os.close(fd)
            raise LockHeld(f"{self.what} is in use by {describe_holder(other)}; wait for that run to end, "
                           f"stop it, or choose another {'server.port' if 'port' in self.what else 'directory'}"
                           ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({**holder, "pid": os.getpid(), "since": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n").encode(), 0)
        self._fd = fd
        return self

    def update(self, holder: dict) -> None:
        """Rewrite who holds the lock (e.g. once the run directory exists)."""
        if self._fd is not None:
            since = _read_holder(self._fd).get("since")
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps({**holder, "pid": os.getpid(), "since": since}) + "\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def describe_holder(holder: dict) -> str:
    if not holder:
        return "another process"
    parts = [f"pid {holder.get('pid')}"]
    if holder.get("run_dir"):
        parts.append(f"run {holder['run_dir']}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return "decodescope " + ", ".join(parts)


def port_lock(port: int) -> FileLock:
    try:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(LOCK_DIR, 0o1777)  # shared by every user's runs, like /tmp
    except OSError:
        pass
    return FileLock(LOCK_DIR / f"port-{port}.lock", f"server port {port}")


def run_dir_lock(run_dir: Path) -> FileLock:
    return FileLock(Path(run_dir) / ".lock", f"run directory {run_dir}")


def holder_info(run_dir: Optional[Path] = None) -> dict:
    return {"run_dir": str(run_dir) if run_dir else None, "argv": " ".join(sys.argv[:2])}
