"""The one execution seam: where the server, the probes and the profile capture run.

`host_for(params)` gives a `LocalHost` (`host: local`: everything runs here) or an `SshHost` (`host:
ssh://user@gpu-box[:port]`): the server, the probes and the profiler run there, the notebooks, the
analysis and the report stay here. Both offer the same operations, so a phase never knows where it runs:

- `python`, `path(local)`: the interpreter and where a file of the run directory lives on the host (the
  run directory is mirrored under `host.workdir`, `<workdir>/<run id>/...`);
- `run(argv)`: a short command; `start(argv, ...)`: a long-running process tree that dies with its
  controller (`Handle`: `poll`, `wait`, `tree`, `stop`); `run_job(...)`: a probe, start to finish;
- `push(local)` / `pull(local)`: inputs there, results back (rsync, resumable: a dropped link loses at
  most the file in flight, `--partial-dir` keeps its bytes for the next try);
- `forward(port)`: a local port that reaches the host's port (an ssh tunnel through the run's connection);
- `measure_link(...)`: what the tunnel adds to each round trip.

SshHost is built on the system `ssh` and `rsync` clients, not a Python ssh library: the user's ssh
config, agent, keys, ProxyJump and known_hosts work as they do in a terminal, rsync (which needs an ssh
transport anyway) gives resumable copies, and nothing new is installed. One connection per run: the first
user starts a ControlMaster (its socket path is derived from DECODESCOPE_SSH_SESSION, which the run's
kernels inherit, so they multiplex over it); BatchMode=yes and StrictHostKeyChecking=yes, so ssh never
prompts: an unknown host key is a clear error naming the command to run. Each long-running process is
started under `python -m decodescope.hostagent supervise` on the host, which tears its tree down alone
when the ssh channel closes (link dropped, controller killed) or goes silent (no heartbeat).
Secrets (the API key, server.env) travel on that supervisor's stdin, never on a command line.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import queue
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

from decodescope import __version__, procs
from decodescope.phases import HOST_PHASES
from decodescope.io import gzip_complete

SESSION_ENV = "DECODESCOPE_SSH_SESSION"      # the run's ControlMaster, inherited by its kernels
HOST_RUN_ID_ENV = "DECODESCOPE_HOST_RUN_ID"  # the run id, on every process the run starts on the host
RUN_ID_ENV = "DECODESCOPE_RUN_ID"            # decodescope.runner's, on every local process of the run
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


def _ssh_env() -> dict:
    """ssh and rsync run without the run id (decodescope.runner reaps what a phase leaves behind by it; the
    run's connection must outlive its phases), under a name of their own."""
    env = dict(os.environ)
    if RUN_ID_ENV in env:
        env[SSH_RUN_ID_ENV] = env.pop(RUN_ID_ENV)
    return env


def _ssh_run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_ssh_env(), **kw)


def _ssh_popen(argv, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, env=_ssh_env(), **kw)


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p(values: Sequence[float], q: float) -> Optional[float]:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else None


def http_rtt_ms(url: str, n: int) -> list[float]:
    import urllib.request

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
        for pattern in self.shm_globs:
            shm |= set(procs.SHM_DIR.glob(pattern))
        removed = procs.remove_shm(procs.shm_idents(shm), shm)
        self.teardown = {"signalled": signalled, "shm_removed": [str(p) for p in removed], "left": self.tree()}
        return self.teardown


class LocalHost:
    remote = False

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

    def measure_link(self, local_url: str, host_url: str, n: int = 20) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


# ---- over ssh --------------------------------------------------------------------------------------
_VERSION_CHECK = r"""
import json, os, shutil, socket, sys
out = {"python": sys.executable, "hostname": socket.gethostname(), "rsync": shutil.which("rsync")}
try:
    import decodescope
    out["version"] = decodescope.__version__
except Exception as e:
    out["version"] = None
    out["import_error"] = f"{type(e).__name__}: {e}"
wd = os.path.abspath(os.path.expanduser(sys.argv[1]))
out["workdir"] = wd
try:
    os.makedirs(wd, exist_ok=True)
    st = os.statvfs(wd)
    out["workdir_free_bytes"] = st.f_bavail * st.f_frsize
except OSError as e:
    out["workdir_error"] = f"[Errno {e.errno}] {e.strerror}"
print(json.dumps(out))
"""


class SshHandle:
    """A process tree on the host, under the host's supervisor (decodescope.hostagent), which stops it
    when this side stops it, exits, or loses the link. Popen-like: pid (on the host), poll, wait."""

    def __init__(self, host: "SshHost", ssh: subprocess.Popen, stderr_path: Path, token: str,
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
        """Send the spec; wait for the supervisor to say it started the program (or why not)."""
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


class SshHost:
    remote = True

    def __init__(self, hp, output_root: Path):
        from decodescope.params import parse_host_url

        t = parse_host_url(hp.url)
        if t is None:
            raise ValueError("SshHost needs an ssh:// URL")
        self.hp = hp
        self.user, self.hostname, self.port = t["user"], t["host"], t["port"]
        self.name = hp.url.removeprefix("ssh://").rstrip("/")
        self.output_root = Path(output_root).resolve()
        self.python = hp.python or "python3"
        self.sync_interval_s = float(hp.sync_interval_s)
        self.workdir: Optional[str] = None
        self.info: dict = {}
        self._master: Optional[subprocess.Popen] = None
        self._master_err: Optional[Path] = None
        self._forwards: list[str] = []
        self._lock = threading.RLock()
        self.last_rsync_stdout = ""
        session = os.environ.get(SESSION_ENV)
        if not session:
            session = uuid.uuid4().hex
            os.environ[SESSION_ENV] = session  # the run's kernels multiplex over this process's connection
        key = json.dumps([session, hp.url, hp.ssh_config, hp.identity, hp.known_hosts,
                          sorted(hp.ssh_options.items())])
        ctl_dir = Path(tempfile.gettempdir()) / f"decodescope-ssh-{os.getuid()}"
        ctl_dir.mkdir(mode=0o700, exist_ok=True)
        self.control = str(ctl_dir / hashlib.sha1(key.encode()).hexdigest()[:20])

    def __repr__(self) -> str:
        return f"SshHost({self.hp.url!r})"

    # -- ssh command lines
    def ssh_options(self) -> list[str]:
        hp = self.hp
        opts = []
        if hp.ssh_config:
            opts += ["-F", os.path.expanduser(hp.ssh_config)]
        opts += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                 "-o", f"ConnectTimeout={int(hp.connect_timeout_s)}",
                 "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
                 "-o", f"ControlPath={self.control}", "-o", "LogLevel=ERROR"]
        if hp.identity:
            opts += ["-i", os.path.expanduser(hp.identity), "-o", "IdentitiesOnly=yes"]
        if hp.known_hosts:
            opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(hp.known_hosts)}"]
        for k, v in hp.ssh_options.items():
            opts += ["-o", f"{k}={v}"]
        if self.port:
            opts += ["-p", str(self.port)]
        if self.user:
            opts += ["-l", self.user]
        return opts

    def ssh_argv(self, remote_cmd: Optional[str] = None) -> list[str]:
        argv = ["ssh", *self.ssh_options(), "-o", "ControlMaster=no", self.hostname]
        return argv + (["--", remote_cmd] if remote_cmd is not None else [])

    # -- the connection
    def master_alive(self) -> bool:
        if not os.path.exists(self.control):
            return False
        r = _ssh_run(["ssh", *self.ssh_options(), "-O", "check", self.hostname], capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=15)
        return r.returncode == 0

    @property
    def owns_master(self) -> bool:
        return self._master is not None and self._master.poll() is None

    def connect(self) -> "SshHost":
        """The run's connection (this process's, or the run's ControlMaster that it inherited), and the
        host's decodescope checked: same version as here, run directories' folder writable."""
        with self._lock:
            if not self.master_alive():
                self._start_master()
            if not self.info:
                self._check_host()
        return self

    def _start_master(self) -> None:
        if self._master is not None and self._master.poll() is None:
            self._master.terminate()
        try:
            os.unlink(self.control)  # a stale socket of a killed master
        except OSError:
            pass
        fd, err = tempfile.mkstemp(prefix="decodescope-ssh-", suffix=".err")
        os.close(fd)
        self._master_err = Path(err)
        argv = ["ssh", *self.ssh_options(), "-o", "ControlMaster=yes", "-o", "ControlPersist=no", "-N",
                self.hostname]
        with open(err, "wb") as f:
            self._master = _ssh_popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f,
                                            preexec_fn=procs.new_session_dying_with_parent)
        deadline = time.monotonic() + self.hp.connect_timeout_s + 5
        while time.monotonic() < deadline:
            if self._master.poll() is not None:
                raise self.ssh_failure(self._master_err, "connecting", self._master.returncode)
            if os.path.exists(self.control):
                return
            time.sleep(0.05)
        self._master.kill()
        raise HostError(f"ssh to {self.name}: no connection within {self.hp.connect_timeout_s + 5:.0f} s "
                        "(host.connect_timeout_s); is the host up and its sshd reachable from here?")

    def ssh_failure(self, stderr_path: Optional[Path], doing: str, rc: Optional[int] = None) -> HostError:
        """ssh's own error, said in words with what to do."""
        try:
            text = Path(stderr_path).read_text(errors="replace").strip() if stderr_path else ""
        except OSError:
            text = ""
        where = f"{self.hostname}" + (f" port {self.port}" if self.port else "")
        kh = self.hp.known_hosts or "~/.ssh/known_hosts"
        keyscan = f"ssh-keyscan {'-p ' + str(self.port) + ' ' if self.port else ''}{self.hostname} >> {kh}"
        if "host key verification failed" in text.lower() or "no " in text.lower() and "host key is known" in text.lower():
            return HostKeyUnknown(
                f"ssh to {self.name}: the host key of {where} is not in {kh}, and decodescope never prompts "
                f"(BatchMode=yes, StrictHostKeyChecking=yes). Check its fingerprint with the host's owner, then "
                f"add it: `{keyscan}` (or connect once by hand: `ssh {'-p ' + str(self.port) + ' ' if self.port else ''}"
                f"{(self.user + '@') if self.user else ''}{self.hostname}`). ssh said: {text[-300:]}")
        if "identification has changed" in text.lower():
            return HostKeyUnknown(f"ssh to {self.name}: the host key of {where} CHANGED since it was recorded in "
                                  f"{kh}; if the host was reinstalled, remove the old key (`ssh-keygen -R "
                                  f"{self.hostname}`) and add the new one; otherwise do not connect. {text[-300:]}")
        if "permission denied" in text.lower():
            return HostError(f"ssh to {self.name}: the host refused the keys offered ({text[-200:]}); set "
                             "host.identity to a key it accepts or load one into ssh-agent (decodescope never "
                             "asks for a password)")
        if any(s in text.lower() for s in ("connection refused", "timed out", "could not resolve", "no route",
                                           "network is unreachable", "connection closed", "connection reset")):
            return HostError(f"ssh to {self.name}: cannot reach {where} while {doing}: {text[-300:]}")
        return HostError(f"ssh to {self.name} failed while {doing} (exit {rc if rc is not None else '?'}): "
                         f"{text[-500:] or 'no message'}")

    def _check_host(self) -> None:
        r = self.run([self.python, "-c", _VERSION_CHECK, self.hp.workdir], timeout_s=self.hp.connect_timeout_s + 30)
        if r.returncode == 127 or (r.returncode != 0 and "not found" in r.stderr):
            raise HostError(f"{self.name}: host.python {self.python!r} is not there ({r.stderr.strip()[-200:]}); "
                            f"set host.python to the interpreter that has decodescope[gpu] installed, e.g. "
                            "~/venv/bin/python")
        if r.returncode == 255:
            raise self._failure_from_text(r.stderr, "checking the host")
        try:
            info = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostError(f"{self.name}: {self.python} -c <version check> failed (exit {r.returncode}): "
                            f"{(r.stderr or r.stdout).strip()[-500:]}") from None
        install = f"{self.python} -m pip install 'decodescope[gpu]=={__version__}'"
        if info.get("version") is None:
            raise HostVersionMismatch(f"{self.name}: decodescope is not installed for {info.get('python')} "
                                      f"({info.get('import_error')}); run there: {install} (or set host.python "
                                      "to an interpreter that has it)")
        if info["version"] != __version__:
            raise HostVersionMismatch(f"{self.name}: decodescope {info['version']} is installed for "
                                      f"{info.get('python')}, {__version__} here: run there: {install} (from a "
                                      "checkout: pip install -e '.[gpu]' at the same commit)")
        if info.get("workdir_error"):
            raise HostError(f"{self.name}: cannot use host.workdir {info['workdir']}: {info['workdir_error']}")
        if not info.get("rsync"):
            raise HostError(f"{self.name}: rsync is not installed there (results are copied back with it); "
                            "install it (apt-get install rsync / dnf install rsync)")
        self.info = info
        self.workdir = info["workdir"]

    def _failure_from_text(self, text: str, doing: str) -> HostError:
        fd, p = tempfile.mkstemp(suffix=".err")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            return self.ssh_failure(Path(p), doing, 255)
        finally:
            os.unlink(p)

    # -- paths
    def path(self, local: Path | str) -> str:
        """Where a file under this run's output folder lives on the host; other paths pass unchanged (a
        model path in params is as the server sees it)."""
        if self.workdir is None:
            self.connect()
        local = Path(local)
        try:
            rel = local.resolve().relative_to(self.output_root)
        except ValueError:
            return str(local)
        return str(Path(self.workdir) / rel)

    def _rsync_base(self, local: Path) -> list[str]:
        e = shlex.join(["ssh", *self.ssh_options(), "-o", "ControlMaster=no"])
        argv = ["rsync", "-a", "--partial", f"--timeout={RSYNC_TIMEOUT_S}", "-e", e]
        try:
            rel = Path(local).resolve().relative_to(self.output_root)
            if rel.parts:  # partial files kept outside the folders the phases read
                argv.append(f"--partial-dir={self.output_root / rel.parts[0] / '.partial'}")
        except ValueError:
            pass
        return argv

    def _rsync(self, argv: list[str], what: str, quiet: bool) -> bool:
        try:
            r = _ssh_run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=RSYNC_TIMEOUT_S * 20)
        except subprocess.TimeoutExpired:
            if quiet:
                return False
            raise HostError(f"{what}: rsync did not finish") from None
        self.last_rsync_stdout = r.stdout
        if r.returncode == 0:
            return True
        if quiet:
            return False
        err = r.stderr.strip()
        if "No space left on device" in err:
            raise HostError(f"{what}: the disk is full ([Errno 28] No space left on device): {err[-300:]}")
        raise HostError(f"{what} failed (rsync exit {r.returncode}): {err[-500:]}")

    def push(self, local: Path | str) -> str:
        """Copy a file or folder of here to its place on the host; returns that path."""
        local = Path(local)
        remote = self.path(local)
        src = str(local) + ("/" if local.is_dir() else "")
        parent = remote if local.is_dir() else str(Path(remote).parent)
        argv = self._rsync_base(local) + [f"--rsync-path=mkdir -p {shlex.quote(parent)} && rsync", src,
                                          f"{self.hostname}:{remote}" + ("/" if local.is_dir() else "")]
        self._rsync(argv, f"copying {local} to {self.name}:{remote}", quiet=False)
        return remote

    def pull(self, local: Path | str, quiet: bool = False, extra: Sequence[str] = ()) -> bool:
        """Copy a file or folder back from the host to its place here (resumable; files appear whole)."""
        local = Path(local)
        remote = self.path(local)
        is_dir = local.is_dir()
        (local if is_dir else local.parent).mkdir(parents=True, exist_ok=True)
        argv = self._rsync_base(local) + list(extra) + [f"{self.hostname}:{remote}" + ("/" if is_dir else ""),
                                                        str(local) + ("/" if is_dir else "")]
        return self._rsync(argv, f"copying {self.name}:{remote} back to {local}", quiet)

    def pull_from(self, remote_dir: str, local_dir: Path, quiet: bool = True, extra: Sequence[str] = ()) -> bool:
        """Copy a folder of the host that is not part of the run directory (an attached server's
        profiler directory) into local_dir."""
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        argv = self._rsync_base(local_dir) + list(extra) + [f"{self.hostname}:{remote_dir.rstrip('/')}/", f"{local_dir}/"]
        return self._rsync(argv, f"copying {self.name}:{remote_dir} back to {local_dir}", quiet)

    # -- commands
    def run(self, argv: Sequence[str], timeout_s: float = 60.0, check: bool = False,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        cmd = shlex.join(list(argv))
        if cwd:
            cmd = f"cd {shlex.quote(cwd)} && {cmd}"
        r = _ssh_run(self.ssh_argv(cmd), capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise HostError(f"on {self.name}: {cmd[:200]} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
        return r

    def start(self, argv: Sequence[str], log: Path, env: Optional[dict] = None, token: Optional[str] = None,
              grace_s: float = 15.0, shm_globs: Sequence[str] = (), sync: Sequence[Path] = (),
              header: str = "", cwd: Optional[str] = None, unset: Sequence[str] = ()) -> SshHandle:
        """Start argv on the host under its supervisor; `env` (secrets included) goes on the supervisor's
        stdin; `log` (a path of the run directory here) is written there and copied back with `sync`."""
        self.connect()
        token = token or procs.new_run_token()
        env = dict(env or {})
        if os.environ.get(RUN_ID_ENV):
            env.setdefault(HOST_RUN_ID_ENV, os.environ[RUN_ID_ENV])
        spec = {"argv": list(argv), "env": env, "unset": list(unset), "token": token, "log": self.path(log),
                "cwd": cwd or self.workdir, "grace_s": grace_s, "header": header,
                "shm_globs": [g.format(token12=token[:12]) for g in shm_globs],
                "heartbeat_timeout_s": self.hp.heartbeat_timeout_s}
        fd, err = tempfile.mkstemp(prefix="decodescope-ssh-", suffix=".err")
        os.close(fd)
        cmd = shlex.join([self.python, "-m", "decodescope.hostagent", "supervise"])
        with open(err, "wb") as f:
            ssh = _ssh_popen(self.ssh_argv(f"cd {shlex.quote(self.workdir)} && exec {cmd}"),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f,
                                   preexec_fn=procs.new_session_dying_with_parent)
        handle = SshHandle(self, ssh, Path(err), token, [log, *sync], self.hp.heartbeat_timeout_s, str(argv[0]))
        handle.begin(spec, timeout_s=self.hp.connect_timeout_s + 30)
        return handle

    def run_job(self, argv: Sequence[str], log: Path, timeout_s: float, env: Optional[dict] = None,
                inputs: Sequence[Path] = (), outputs: Sequence[Path] = (), shm_globs: Sequence[str] = ()) -> int:
        """A program start to finish on the host: inputs copied there, outputs copied back as it runs and
        when it ends; an interrupt, a timeout or a dropped link stops every process of its tree there."""
        self.connect()
        for p in inputs:
            self.push(p)
        handle = self.start(argv, log, env=env, grace_s=5.0, shm_globs=shm_globs, sync=outputs)
        try:
            rc = handle.wait(timeout_s)
        finally:
            handle.stop()
        if handle.link_lost:
            raise LinkDropped(f"the ssh link to {self.name} dropped while {' '.join(map(str, argv[:4]))} ran; the "
                              "host stopped it by itself; the files it finished were copied back; "
                              "`decodescope run --resume RUN_DIR` runs it again")
        return rc

    def mirror_move(self, paths: Sequence[Path], dest: Path) -> None:
        """Do there what is about to be done here: `dest` (re)made and `paths` moved into it, so that
        copying the folder back does not bring the moved files back to where they were."""
        code = ("import os, shutil, sys\n"
                "dest = sys.argv[1]\nshutil.rmtree(dest, ignore_errors=True)\nos.makedirs(dest, exist_ok=True)\n"
                "for p in sys.argv[2:]:\n    if os.path.exists(p):\n"
                "        shutil.move(p, os.path.join(dest, os.path.basename(p)))\n")
        self.run([self.python, "-c", code, self.path(dest), *[self.path(p) for p in paths]], timeout_s=120, check=True)

    def forward(self, port: int, remote_host: str = "127.0.0.1") -> int:
        """A local port tunnelled (through the run's connection) to remote_host:port as the host sees it."""
        self.connect()
        local = free_local_port()
        spec = f"127.0.0.1:{local}:{remote_host}:{port}"
        r = _ssh_run(["ssh", *self.ssh_options(), "-O", "forward", "-L", spec, self.hostname],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        if r.returncode != 0:
            raise HostError(f"ssh to {self.name}: could not forward 127.0.0.1:{local} to {remote_host}:{port}: "
                            f"{r.stderr.strip()[-300:]}")
        self._forwards.append(spec)
        return local

    def cancel_forward(self, local_port: int) -> None:
        for spec in [s for s in self._forwards if s.startswith(f"127.0.0.1:{local_port}:")]:
            _ssh_run(["ssh", *self.ssh_options(), "-O", "cancel", "-L", spec, self.hostname],
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            self._forwards.remove(spec)

    def measure_link(self, local_url: str, host_url: str, n: int = 20) -> dict:
        """GET round trips to the server through the tunnel (from here) and on the host itself: what the
        link adds to every request's TTFT and E2E (a chunk's ITL carries only its jitter)."""
        here = http_rtt_ms(local_url, n)
        r = self.run([self.python, "-m", "decodescope.hostagent", "http-rtt", host_url, str(n)], timeout_s=120)
        try:
            there = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            there = []
        out = {"host": self.name, "path": "ssh tunnel", "n": n, "via_tunnel_p50_ms": _p(here, 0.5),
               "via_tunnel_p90_ms": _p(here, 0.9), "on_host_p50_ms": _p(there, 0.5),
               "on_host_p90_ms": _p(there, 0.9)}
        if out["via_tunnel_p50_ms"] is not None and out["on_host_p50_ms"] is not None:
            out["added_p50_ms"] = out["via_tunnel_p50_ms"] - out["on_host_p50_ms"]
        return out

    def close(self) -> None:
        """Cancel the tunnels and end the connection if this process started it."""
        with self._lock:
            for spec in list(self._forwards):
                _ssh_run(["ssh", *self.ssh_options(), "-O", "cancel", "-L", spec, self.hostname],
                               capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            self._forwards.clear()
            if self._master is not None:
                if self._master.poll() is None:
                    _ssh_run(["ssh", *self.ssh_options(), "-O", "exit", self.hostname], capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=30)
                    try:
                        self._master.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        self._master.kill()
                        self._master.wait(timeout=10)
                self._master = None
                with contextlib.suppress(OSError):
                    os.unlink(self.control)  # left behind when the master was killed outright
                if self._master_err is not None:
                    self._master_err.unlink(missing_ok=True)


# ---- which host --------------------------------------------------------------------------------------
_HOSTS: dict[str, "LocalHost | SshHost"] = {}
_HOSTS_LOCK = threading.Lock()


def host_from_spec(hp, output_root: Path) -> "LocalHost | SshHost":
    """The (process-wide, cached) host for a params `host` section or one of its `nodes`."""
    if not hp.is_remote:
        return LocalHost(hp.python)
    key = hp.model_dump_json() + "|" + str(Path(output_root).resolve())
    with _HOSTS_LOCK:
        if key not in _HOSTS:
            _HOSTS[key] = SshHost(hp, output_root)
        return _HOSTS[key]


def host_for(params) -> "LocalHost | SshHost":
    return host_from_spec(params.host, params.output_root())


def node_hosts(params) -> list["LocalHost | SshHost"]:
    """The hosts of a multi-node probe: params.host first (node rank 0), then host.nodes in order, each
    with the host section's settings and its own URL."""
    hosts = [host_for(params)]
    for url in params.host.nodes:
        hp = params.host.model_copy(update={"url": url, "nodes": []})
        if url == "local":
            hp = hp.model_copy(update={"python": None})
        hosts.append(host_from_spec(hp, params.output_root()))
    return hosts


def preflight(params, resume: Optional[Path] = None, phases: Optional[Sequence[str]] = None) -> "LocalHost | SshHost":
    """Before a run makes anything: connect (one connection for the run), check the host's decodescope;
    on --resume, copy back what finished there while the link was down. Raises HostError. Nothing is
    done when none of `phases` runs anything on the host."""
    host = host_for(params)
    if host.remote and (phases is None or set(phases) & set(HOST_PHASES)):
        host.connect()
        for node in node_hosts(params)[1:]:
            node.connect()
        if resume is not None:
            host.pull(Path(resume), quiet=True, extra=["--exclude=/manifest.json", "--exclude=/params.yaml",
                                                       "--exclude=/notebooks/", "--exclude=/report.html"])
    return host


def mirror_move(params, paths: Sequence[Path], dest: Path) -> None:
    """Before moving files of a run directory into `dest` here: the same move on the run's ssh host
    (copying the folder back would bring them back otherwise); nothing for a local run."""
    host = host_for(params)
    if host.remote:
        host.mirror_move(paths, dest)


@contextlib.contextmanager
def node_traces(params, trace_dir: Path):
    """While an attached server is profiled: the traces its ranks write on the ssh host and on each of
    host.nodes (in host.trace_dir there, its --profiler-config torch_profiler_dir) copied into
    trace_dir/node<i>/ every host.sync_interval_s, and once more at the end. A file is copied again
    until it is whole (a complete gzip stream, or a size that stopped changing), then never again, so
    moving it here (traces/c<N>/) does not bring it back. Nothing for a launched server (its profiler
    directory is the run's traces/) or a local host."""
    if params.server.mode != "attach" or not params.host.trace_dir:
        yield
        return
    nodes = [(i, h) for i, h in enumerate(node_hosts(params)) if h.remote]
    done = {i: set() for i, _ in nodes}
    sizes: dict[Path, int] = {}
    stop = threading.Event()

    def pull_all() -> None:
        for i, h in nodes:
            local = Path(trace_dir) / f"node{i}"
            local.mkdir(parents=True, exist_ok=True)
            fd, excl = tempfile.mkstemp(suffix=".exclude")
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"/{name}\n" for name in sorted(done[i])))
            try:
                h.pull_from(params.host.trace_dir, local, extra=[f"--exclude-from={excl}"])
            finally:
                os.unlink(excl)
            for p in local.rglob("*"):
                if p.is_file():
                    size = p.stat().st_size
                    whole = gzip_complete(p) if p.suffix == ".gz" else sizes.get(p) == size
                    sizes[p] = size
                    if whole:
                        done[i].add(str(p.relative_to(local)))

    def loop() -> None:
        while not stop.wait(float(params.host.sync_interval_s)):
            pull_all()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=RSYNC_TIMEOUT_S)
        pull_all()


def close_all() -> None:
    with _HOSTS_LOCK:
        hosts = list(_HOSTS.values())
        _HOSTS.clear()
    for h in hosts:
        try:
            h.close()
        except (OSError, subprocess.SubprocessError):
            pass


atexit.register(close_all)
