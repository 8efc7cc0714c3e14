"""The ssh host (`host: ssh://user@gpu-box[:port]`): one ControlMaster a run, rsync both ways, processes
under the host's supervisor, port forwards through the run's connection (decodescope.exec.host says why the
system ssh and rsync clients)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal, Optional, Sequence

from decodescope import __version__
from decodescope.core.io import ATOMIC_TMP_GLOB
from decodescope.exec import procs
from decodescope.exec.hostcore import (HOST_RUN_ID_ENV, RSYNC_TIMEOUT_S, RUN_ID_ENV, SESSION_ENV, HostError,
                                       HostKeyUnknown, HostVersionMismatch, LinkDropped, free_local_port, http_rtt_ms,
                                       nearest_rank, ssh_popen, ssh_run)
from decodescope.schema.params_schema import parse_host_url
from decodescope.schema.records_server import LinkMeasure
from decodescope.exec.sshhandle import SshHandle


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



class SshHost:
    remote: Literal[True] = True  # a Literal, so `if host.remote:` narrows LocalHost | SshHost

    def __init__(self, hp, output_root: Path):
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
        r = ssh_run(["ssh", *self.ssh_options(), "-O", "check", self.hostname], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=15)
        return r.returncode == 0

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
            self._master = ssh_popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f,
                                           preexec_fn=procs.new_session_dying_with_parent)
        try:
            self._await_master()
        finally:  # read only while connecting: removed once that is settled (ssh writes on to it unlinked)
            self._master_err.unlink(missing_ok=True)

    def _await_master(self) -> None:
        assert self._master is not None and self._master_err is not None  # _start_master started it
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
        assert self.workdir is not None  # connect() checked the host, which sets workdir (or raised)
        return str(Path(self.workdir) / rel)

    def _rsync_base(self, local: Path) -> list[str]:
        e = shlex.join(["ssh", *self.ssh_options(), "-o", "ControlMaster=no"])
        # a result still being written there is copied once it is whole, never as its temporary file
        argv = ["rsync", "-a", "--partial", f"--timeout={RSYNC_TIMEOUT_S}", f"--exclude={ATOMIC_TMP_GLOB}", "-e", e]
        try:
            rel = Path(local).resolve().relative_to(self.output_root)
            if rel.parts:  # partial files kept outside the folders the phases read
                argv.append(f"--partial-dir={self.output_root / rel.parts[0] / '.partial'}")
        except ValueError:
            pass
        return argv

    def _rsync(self, argv: list[str], what: str, quiet: bool) -> bool:
        try:
            r = ssh_run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
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
        r = ssh_run(self.ssh_argv(cmd), capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise HostError(f"on {self.name}: {cmd[:200]} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
        return r

    def start(self, argv: Sequence[str], log: Path, env: Optional[dict] = None, token: Optional[str] = None,
              grace_s: float = 15.0, shm_globs: Sequence[str] = (), sync: Sequence[Path] = (),
              header: str = "", cwd: Optional[str] = None, unset: Sequence[str] = (),
              private_dirs: Sequence[str] = (), tmp_caches: Sequence = ()) -> SshHandle:
        """Start argv on the host under its supervisor; `env` (secrets included) goes on the supervisor's
        stdin; `log` (a path of the run directory here) is written there and copied back with `sync`;
        tmp_caches: cache folder names the supervisor links from the first private dir to beside it
        (decodescope.exec.privatedirs.link_tmp_caches, with the host's user)."""
        self.connect()
        token = token or procs.new_run_token()
        env = dict(env or {})
        if os.environ.get(RUN_ID_ENV):
            env.setdefault(HOST_RUN_ID_ENV, os.environ[RUN_ID_ENV])
        spec = {"argv": list(argv), "env": env, "unset": list(unset), "token": token, "log": self.path(log),
                "cwd": cwd or self.workdir, "grace_s": grace_s, "header": header,
                "shm_globs": [g.format(token12=token[:12]) for g in shm_globs], "private_dirs": list(private_dirs),
                "tmp_caches": list(tmp_caches),
                "heartbeat_timeout_s": self.hp.heartbeat_timeout_s}
        fd, err = tempfile.mkstemp(prefix="decodescope-ssh-", suffix=".err")
        os.close(fd)
        cmd = shlex.join([self.python, "-m", "decodescope.exec.hostagent", "supervise"])
        with open(err, "wb") as f:
            assert self.workdir is not None  # connect() checked the host, which sets workdir (or raised)
            ssh = ssh_popen(self.ssh_argv(f"cd {shlex.quote(self.workdir)} && exec {cmd}"),
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
        r = ssh_run(["ssh", *self.ssh_options(), "-O", "forward", "-L", spec, self.hostname],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        if r.returncode != 0:
            raise HostError(f"ssh to {self.name}: could not forward 127.0.0.1:{local} to {remote_host}:{port}: "
                            f"{r.stderr.strip()[-300:]}")
        self._forwards.append(spec)
        return local

    def cancel_forward(self, local_port: int) -> None:
        for spec in [s for s in self._forwards if s.startswith(f"127.0.0.1:{local_port}:")]:
            ssh_run(["ssh", *self.ssh_options(), "-O", "cancel", "-L", spec, self.hostname],
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            self._forwards.remove(spec)

    def measure_link(self, local_url: str, host_url: str, n: int = 20) -> LinkMeasure:
        """GET round trips to the server through the tunnel (from here) and on the host itself: what the
        link adds to every request's TTFT and E2E (a chunk's ITL carries only its jitter)."""
        here = http_rtt_ms(local_url, n)
        r = self.run([self.python, "-m", "decodescope.exec.hostagent", "http-rtt", host_url, str(n)], timeout_s=120)
        try:
            there = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            there = []
        via_p50, on_host_p50 = nearest_rank(here, 0.5), nearest_rank(there, 0.5)
        return LinkMeasure(host=self.name, n=n, via_tunnel_p50_ms=via_p50, via_tunnel_p90_ms=nearest_rank(here, 0.9),
                           on_host_p50_ms=on_host_p50, on_host_p90_ms=nearest_rank(there, 0.9),
                           added_p50_ms=via_p50 - on_host_p50 if via_p50 is not None and on_host_p50 is not None
                           else None)

    def close(self) -> None:
        """Cancel the tunnels and end the connection if this process started it."""
        with self._lock:
            for spec in list(self._forwards):
                ssh_run(["ssh", *self.ssh_options(), "-O", "cancel", "-L", spec, self.hostname],
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            self._forwards.clear()
            if self._master is not None:
                if self._master.poll() is None:
                    ssh_run(["ssh", *self.ssh_options(), "-O", "exit", self.hostname], capture_output=True,
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
