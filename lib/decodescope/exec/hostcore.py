"""What both hosts of the execution seam (decodescope.exec.host) share: the errors, the ssh environment rule,
the link's round-trip measure, and the local host (`host: local`: everything runs here)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Literal, Optional, Sequence

from decodescope.exec import procs
from decodescope.schema.records_server import LinkMeasure

SESSION_ENV = "DECODESCOPE_SSH_SESSION"      # the run's ControlMaster, inherited by its kernels
HOST_RUN_ID_ENV = procs.HOST_RUN_ID_ENV  # the run id, on every process the run starts on the host
RUN_ID_ENV = procs.RUN_ID_ENV            # decodescope.orchestration.runner's, on every local process of the run
SSH_RUN_ID_ENV = "DECODESCOPE_SSH_RUN_ID"    # the run id on this side's ssh and rsync processes
RSYNC_TIMEOUT_S = 60



class HostError(RuntimeError):
    """The host cannot be reached or used; the message says what to do."""


class HostKeyUnknown(HostError):
    pass


class HostVersionMismatch(HostError):
    pass


class LinkDropped(HostError):
    """The ssh link went away while something ran there (which the host then stopped by itself)."""


def ssh_env() -> dict:
    """ssh and rsync run without the run id (decodescope.orchestration.runner reaps what a phase leaves behind by it; the
    run's connection must outlive its phases), under a name of their own."""
    env = dict(os.environ)
    if RUN_ID_ENV in env:
        env[SSH_RUN_ID_ENV] = env.pop(RUN_ID_ENV)
    return env


def ssh_run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=ssh_env(), **kw)


def ssh_popen(argv, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, env=ssh_env(), **kw)


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nearest_rank(values: Sequence[float], q: float) -> Optional[float]:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else None


def http_rtt_ms(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                r.read()
        except OSError:
            continue
        out.append((time.perf_counter() - t0) * 1e3)
    return out


# ---- here ------------------------------------------------------------------------------------------
class LocalHandle:
    """A process tree started here, in its own session, dying with this process (PR_SET_PDEATHSIG)."""

    def __init__(self, proc: subprocess.Popen, token: str, grace_s: float, shm_globs: Sequence[str]):
        self.proc, self.token, self.grace_s, self.shm_globs = proc, token, grace_s, list(shm_globs)
        self.pid = self.pgid = proc.pid
        self.teardown: dict = {}
        self.link_lost = False

    @property
    def returncode(self):
        return self.proc.returncode

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.proc.wait(timeout=timeout)

    def tree(self) -> list[int]:
        return procs.run_processes(self.token, [self.pgid])

    def dead_reason(self) -> Optional[str]:
        return None

    def stop(self) -> dict:
        left = self.tree()
        shm = procs.mapped_shm_files(left)
        signalled = procs.terminate(self.token, [self.pgid], grace_s=self.grace_s) if left else []
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # the tree's segments are swept by their names (its token) once none of its processes is alive to
        # make one more: what the ranks had mapped when the stop began may be fewer than they made
        procs.wait_gone(self.tree, 30.0)
        for pattern in self.shm_globs:
            shm |= set(procs.SHM_DIR.glob(pattern))
        removed = procs.remove_shm(procs.shm_idents(shm), shm)
        self.teardown = {"signalled": signalled, "shm_removed": [str(p) for p in removed], "left": self.tree()}
        return self.teardown


class LocalHost:
    remote: Literal[False] = False  # a Literal, so `if host.remote:` narrows LocalHost | SshHost

    def __init__(self, python: Optional[str] = None):
        self.python = python or sys.executable
        self.name = "local"

    def __repr__(self) -> str:
        return "LocalHost()"

    def connect(self) -> "LocalHost":
        return self

    def path(self, local: Path | str) -> str:
        return str(local)

    def push(self, local: Path | str) -> str:
        return str(local)

    def pull(self, local: Path | str, quiet: bool = False) -> bool:
        return True

    def run(self, argv: Sequence[str], timeout_s: float = 60.0, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=check,
                              stdin=subprocess.DEVNULL)

    def start(self, argv: Sequence[str], log: Path, env: Optional[dict] = None, token: Optional[str] = None,
              grace_s: float = 15.0, shm_globs: Sequence[str] = (), sync: Sequence[Path] = (),
              header: str = "", cwd: Optional[str] = None) -> LocalHandle:
        token = token or procs.new_run_token()
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            if header:
                f.write(header.encode())
                f.flush()
            proc = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {}), procs.RUN_TOKEN_ENV: token}, cwd=cwd,
                                    preexec_fn=procs.new_session_dying_with_parent)
        return LocalHandle(proc, token, grace_s, [g.format(token12=token[:12]) for g in shm_globs])

    def run_job(self, argv: Sequence[str], log: Path, timeout_s: float, env: Optional[dict] = None,
                inputs: Sequence[Path] = (), outputs: Sequence[Path] = (), shm_globs: Sequence[str] = ()) -> int:
        """A program start to finish (a probe); an interrupt or timeout stops every process of its tree."""
        handle = self.start(argv, log, env=env, grace_s=5.0, shm_globs=shm_globs)
        try:
            return handle.wait(timeout_s)
        finally:
            handle.stop()

    def forward(self, port: int, remote_host: str = "127.0.0.1") -> int:
        return port

    def measure_link(self, local_url: str, host_url: str, n: int = 20) -> Optional[LinkMeasure]:
        return None

    def close(self) -> None:
        pass


# ---- over ssh --------------------------------------------------------------------------------------


def loopback_for(bind_host: str) -> str:
    """Where a server bound to bind_host is reached on its own host: a wildcard bind answers on 127.0.0.1."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
