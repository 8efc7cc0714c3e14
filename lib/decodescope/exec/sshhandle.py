"""A process tree on an ssh host, under the host's supervisor (decodescope.exec.hostagent): the controller's
side of the supervisor's line protocol (begin, heartbeat, stop, the teardown report)."""
from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional, Protocol, Sequence

from decodescope.exec.hostcore import RSYNC_TIMEOUT_S, HostError


class SupervisedHost(Protocol):
    """What a handle asks of its host: its name, the sync period, copies back, and ssh's errors read."""
    name: str
    sync_interval_s: float

    def pull(self, local: Path | str, quiet: bool = False, extra: Sequence[str] = ()) -> bool: ...

    def ssh_failure(self, stderr_path: Optional[Path], doing: str, rc: Optional[int] = None) -> HostError: ...


class SshHandle:
    """A process tree on the host, under the host's supervisor (decodescope.exec.hostagent), which stops it
    when this side stops it, exits, or loses the link. Popen-like: pid (on the host), poll, wait."""

    def __init__(self, host: SupervisedHost, ssh: subprocess.Popen, stderr_path: Path, token: str,
                 sync: Sequence[Path], heartbeat_s: float, argv0: str):
        self.host, self.ssh, self.stderr_path, self.token = host, ssh, stderr_path, token
        self.sync_paths = [Path(p) for p in sync]
        self.argv0 = argv0
        self.pid: Optional[int] = None
        self.pgid: Optional[int] = None
        self.exit_rc: Optional[int] = None
        self.teardown: dict = {}
        self.link_lost = False
        self.shm: list[str] = []
        self._events: "queue.Queue[dict]" = queue.Queue()
        self._replies: "queue.Queue[dict]" = queue.Queue()
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._wlock = threading.Lock()
        self._req_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._heartbeat_s = heartbeat_s
        self._threads = [threading.Thread(target=self._ping, daemon=True)]
        if self.sync_paths:
            self._threads.append(threading.Thread(target=self._sync, daemon=True))

    # -- plumbing
    def _read(self) -> None:
        assert self.ssh.stdout is not None  # SshHost.start opens the supervisor with stdout=PIPE
        for line in self.ssh.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            ev = msg.get("event")
            if ev == "tree":
                self._replies.put(msg)
            elif ev == "exited":
                self.exit_rc = msg["rc"]
            elif ev == "teardown":
                self.teardown = msg
                if self.exit_rc is None and msg.get("rc") is not None:
                    self.exit_rc = msg["rc"]
            self._events.put(msg)
        self.ssh.wait()
        if not self.teardown and self.exit_rc is None:
            self.link_lost = True
        self._done.set()
        self._events.put({"event": "eof"})

    def _send(self, line: str) -> bool:
        with self._wlock:
            assert self.ssh.stdin is not None  # SshHost.start opens the supervisor with stdin=PIPE
            try:
                self.ssh.stdin.write((line + "\n").encode())
                self.ssh.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def _ping(self) -> None:
        every = max(0.5, min(5.0, self._heartbeat_s / 4))
        while not self._done.wait(every):
            if not self._send("ping"):
                return

    def _sync(self) -> None:
        while not self._done.wait(self.host.sync_interval_s):
            if self._stopping.is_set():
                return
            for p in self.sync_paths:
                self.host.pull(p, quiet=True)

    def begin(self, spec: dict, timeout_s: float) -> None:
        """Send the spec; wait for the supervisor to say it started the program (or why not). ssh's error
        file is read only here: it is removed once the start is settled (ssh keeps writing to it unlinked)."""
        try:
            self._begin(spec, timeout_s)
        finally:
            self.stderr_path.unlink(missing_ok=True)

    def _begin(self, spec: dict, timeout_s: float) -> None:
        if not self._send(json.dumps(spec)):
            raise self.host.ssh_failure(self.stderr_path, "starting the supervisor")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise HostError(f"{self.host.name}: the supervisor did not start {self.argv0} within "
                                f"{timeout_s:.0f} s") from None
            if msg["event"] == "started":
                self.pid = self.pgid = msg["pid"]
                for t in self._threads:
                    t.start()
                return
            if msg["event"] == "error":
                self._close_stdin()
                self.ssh.wait(timeout=10)
                raise HostError(f"on {self.host.name}: {msg['error']}")
            if msg["event"] == "eof":
                raise self.host.ssh_failure(self.stderr_path, f"starting {self.argv0}")

    def _close_stdin(self) -> None:
        with self._wlock:
            assert self.ssh.stdin is not None  # SshHost.start opens the supervisor with stdin=PIPE
            try:
                self.ssh.stdin.close()
            except OSError:
                pass

    # -- Popen-like
    @property
    def returncode(self) -> Optional[int]:
        if self.exit_rc is not None:
            return self.exit_rc
        return 255 if self._done.is_set() else None

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None  # left (via deadline) is set only when timeout is
                raise subprocess.TimeoutExpired(self.argv0, timeout)
            self._done.wait(0.1 if left is None else min(0.1, left))
        return self.returncode

    def dead_reason(self) -> Optional[str]:
        if self.link_lost:
            return (f"the ssh link to {self.host.name} dropped (the host stops what this run started there "
                    "by itself; `decodescope run --resume RUN_DIR` finishes the run)")
        return None

    def tree(self) -> list[int]:
        """The live pids of the tree on the host (by process group and run token)."""
        if self._done.is_set():
            return []
        with self._req_lock:
            while not self._replies.empty():
                self._replies.get_nowait()
            if not self._send("tree"):
                return []
            try:
                reply = self._replies.get(timeout=15)
            except queue.Empty:
                return []
            self.shm = reply.get("shm", [])
            return reply["pids"]

    def stop(self, timeout_s: float = 60.0) -> dict:
        """Stop the tree (the supervisor signals it by group and token, then removes its shm files), wait
        for its report, and copy the results back one last time."""
        self._stopping.set()
        self._send("stop")
        self._close_stdin()
        if not self._done.wait(timeout_s):
            self.ssh.kill()  # the supervisor then tears down on its own (stdin closed)
            self._done.wait(10)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=RSYNC_TIMEOUT_S)
        for p in self.sync_paths:
            self.host.pull(p, quiet=True)
        if not self.teardown:
            self.teardown = {"signalled": [], "shm_removed": [], "left": [],
                             "reason": "no report from the host (link down); its supervisor tears down alone"}
        return self.teardown


