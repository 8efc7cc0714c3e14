"""vLLM server lifecycle: launch from a LaunchSpec, wait for health, attach, profile endpoints, teardown.

The server runs as `python -m vllm.entrypoints.openai.api_server` in a new process session; its
engine core and TP workers share that process group and the run's token (DECODESCOPE_RUN_TOKEN in their
environment). Teardown signals every process found by either (decodescope.exec.procs), so nothing outlives
the run even when the API server died first and its children were re-parented; the engine's
shared-memory files are removed with it. It runs on normal exit, on exceptions, on SIGINT/SIGTERM, and,
if this process is killed outright, through PR_SET_PDEATHSIG on the API server.

Before any measurement the server is checked to be the one this run started (its model list carries
the run's alias), the port is held by a lock for the run's life, and the API key reaches vLLM through
its environment (VLLM_API_KEY), never its command line.

The run's server (which one the params describe, data/server.json, a phase's server) is
decodescope.exec.runserver.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import psutil

from decodescope.exec import privatedirs, procs
from decodescope.exec.hostcore import loopback_for
from decodescope.exec.locks import holder_info, port_lock
from decodescope.schema.params import Params
from decodescope.schema.records_server import LinkMeasure
from decodescope.exec.serverlaunch import HOST_ENV_KEYS, LaunchSpec, add_profiler, alias_for
from decodescope.engines import ENGINES, engine

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
_LIVE: "set[VllmServer]" = set()
_LIVE_LOCK = threading.Lock()


class ServerError(RuntimeError):
    """The server failed to start, died, or did not answer; the message quotes its log tail."""


class ServerDied(ServerError):
    """The server stopped answering (or its process exited) while a phase was using it."""


class ServerHTTPError(ServerError):
    """The server answered an endpoint with an HTTP error status."""

    def __init__(self, path: str, status: int):
        self.path, self.status = path, status
        super().__init__(f"{path} answered HTTP {status}")


class ServerUnreachable(ServerError):
    """No answer from an endpoint: connection refused, reset or timed out."""


SERVER_DIED = "server_died"
_HELD_PORTS: dict = {}


def hold_port(port: int, run_dir: Optional[Path] = None):
    """Take this process's lock on the port (kept until release_port); a second run on the same port
    gets LockHeld naming the holder. Re-entrant within a process."""
    if port not in _HELD_PORTS:
        _HELD_PORTS[port] = port_lock(port).acquire(holder_info(run_dir))
    elif run_dir is not None:
        _HELD_PORTS[port].update(holder_info(run_dir))
    return _HELD_PORTS[port]


def release_port(port: int) -> None:
    lock = _HELD_PORTS.pop(port, None)
    if lock is not None:
        lock.release()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check_cpus(cpus: str) -> None:
    """server.cpus against the cores a process started here may be put on (procs.cores_offered)."""
    have = procs.cores_offered()
    missing = procs.parse_cpulist(cpus) - have
    if missing:
        raise ServerError(f"server.cpus {cpus!r} names cores {sorted(missing)} this host does not offer; "
                          f"valid: cores of {sorted(have)}")


class VllmServer:
    """One OpenAI-compatible server: launched here (and owned), or attached to by URL. `pid` is the API
    server's pid when known (launched here, or by the run that wrote server.json)."""

    def __init__(self, base_url: str, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[Path] = None, spec: Optional[LaunchSpec] = None,
                 api_key: Optional[str] = None, pid: Optional[int] = None, run_token: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self.proc = proc
        self.log_path = log_path
        self.spec = spec
        self.api_key = api_key if api_key is not None else (spec.api_key if spec else None)
        self.pid = proc.pid if proc is not None else pid
        self.run_token = spec.run_token if spec else run_token
        self.started_s: Optional[float] = None
        self.tree_pids: list[int] = []
        self.cores: dict[int, dict] = {}  # pid -> {role, cpus}, at start (a server started here)
        self.shm_files: set[Path] = set()
        self.teardown: dict = {}
        self._held_port: Optional[int] = None
        self._dir_fd: Optional[int] = None  # holds spec.tmp_dir's lock (privatedirs.hold_private_dir) until teardown
        self.host = None     # decodescope.exec.host: set when the server runs on an ssh host
        self.remote = None   # its host.SshHandle (also self.proc: Popen-like)
        self.link: Optional[LinkMeasure] = None
        self.engine = engine()  # what the server is (decodescope.engines): its endpoints and its processes

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def launch(cls, spec: LaunchSpec, log_path: Path, timeout_s: float,
               run_dir: Optional[Path] = None, host=None, sync: tuple = ()) -> "VllmServer":
        if host is not None and host.remote:
            return cls._launch_on_host(spec, host, log_path, timeout_s, run_dir, sync)
        if spec.cpus:
            _check_cpus(spec.cpus)
        newly_held = spec.port not in _HELD_PORTS
        hold_port(spec.port, run_dir)  # LockHeld names the other run
        if not port_is_free(spec.host, spec.port):
            if newly_held:
                release_port(spec.port)
            raise ServerError(f"port {spec.port} on {spec.host} is already in use; stop what holds it, "
                              f"set server.port to a free port, or use server.mode: attach")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab", buffering=0)
        log.write(f"# decodescope launch {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                  f"# {json.dumps(spec.describe()['argv'])}\n".encode())
        dir_fd = None
        if spec.tmp_dir:
            swept = privatedirs.sweep_private_dirs(os.path.dirname(spec.tmp_dir))
            if swept:
                logger.info("removed %d temporary folder(s) of servers whose run was killed outright: %s",
                            len(swept), ", ".join(swept))
            dir_fd = privatedirs.hold_private_dir(spec.tmp_dir)
            privatedirs.link_tmp_caches(spec.tmp_dir, spec.tmp_caches)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=procs.new_session_dying_with_parent)
        except OSError as e:
            # nothing started: what was made for it goes, and the error names the command
            privatedirs.remove_dirs([spec.tmp_dir] if spec.tmp_dir else [])
            if dir_fd is not None:
                os.close(dir_fd)
            if newly_held:
                release_port(spec.port)
            raise ServerError(f"could not start the server: {spec.argv[0]}: {e.strerror or e}") from e
        finally:
            log.close()
        server = cls(f"http://{spec.host}:{spec.port}", proc=proc, log_path=log_path, spec=spec)
        server._dir_fd = dir_fd
        server._until_ready(spec.port if newly_held else None, t0, timeout_s)
        server.shm_files = procs.mapped_shm_files(server.tree_pids)
        return server

    def _until_ready(self, held_port: Optional[int], t0: float, timeout_s: float, connect=None) -> None:
        """Track a server just started (an exit of this process stops it), connect to it, wait until it
        is healthy and ours, else stop it; then record its start time and process tree."""
        self._held_port = held_port
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            if connect is not None:
                connect()
            self.wait_healthy(timeout_s)
            self.verify_ours()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        self.tree_pids = self.process_tree()
        if self.remote is None:
            self.cores = procs.cores_of(self.tree_pids)

    @classmethod
    def _launch_on_host(cls, spec: LaunchSpec, host, log_path: Path, timeout_s: float, run_dir: Optional[Path],
                        sync: tuple) -> "VllmServer":
        """The server on an ssh host, under its supervisor (decodescope.exec.hostagent: the tree is torn down
        there when this side stops it, dies or loses the link), reached through a tunnel; its log and
        `sync` (the profiler directory) are copied back as they grow."""
        newly_held = spec.port not in _HELD_PORTS
        hold_port(spec.port, run_dir)
        free = host.run([host.python, "-m", "decodescope.exec.hostagent", "port-free", spec.host, str(spec.port)])
        if free.stdout.strip() == "false":
            if newly_held:
                release_port(spec.port)
            raise ServerError(f"port {spec.port} on {spec.host} of {host.name} is already in use; stop what holds "
                              "it, set server.port to a free port, or use server.mode: attach")
        # only what differs from this side's environment goes: the host has its own; secrets go on the
        # supervisor's stdin
        keys = [*spec.extra_env_keys, *HOST_ENV_KEYS]
        env = {k: spec.env[k] for k in keys if k in spec.env}
        header = (f"# decodescope launch on {host.name} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                  f"# {json.dumps(spec.describe()['argv'])}\n")
        t0 = time.monotonic()
        handle = host.start(spec.argv, log_path, env=env, token=spec.run_token, grace_s=15.0, sync=sync,
                            header=header, private_dirs=[spec.tmp_dir] if spec.tmp_dir else [],
                            tmp_caches=spec.tmp_caches,
                            unset=[] if spec.api_key else [e.api_key_env for e in ENGINES.values()])
        server = cls("http://127.0.0.1:0", proc=handle, log_path=log_path, spec=spec)
        server.host, server.remote = host, handle

        def tunnel():
            server.local_port = host.forward(spec.port, loopback_for(spec.host))
            server.base_url = f"http://127.0.0.1:{server.local_port}"
        server._until_ready(spec.port if newly_held else None, t0, timeout_s, connect=tunnel)
        server.shm_files = {Path(f) for f in getattr(handle, "shm", [])}
        return server

    def refresh_log(self) -> None:
        """Copy the server's log back from its host (a no-op here) before quoting it."""
        if self.host is not None and self.log_path is not None:
            self.host.pull(self.log_path, quiet=True)

    @classmethod
    def attach(cls, url: str, api_key: Optional[str] = None, timeout_s: float = 10.0) -> "VllmServer":
        server = cls(url, api_key=api_key)
        if not server.healthy(timeout_s=timeout_s):
            raise ServerError(f"no healthy server at {url}/health; start it or fix server.url")
        return server

    # ---- health -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, timeout_s: float, body: Optional[dict] = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            status, _ = self._request("GET", self.engine.health_path, timeout_s)
            return status == 200
        except (urllib.error.URLError, OSError, ConnectionError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                self.refresh_log()
                if self.remote is not None and self.remote.dead_reason():
                    raise ServerError(f"vLLM did not start: {self.remote.dead_reason()}")
                assert self.log_path is not None  # launched (_until_ready): launch gave it its log
                raise ServerError(f"vLLM exited with code {self.proc.returncode} during start-up; "
                                  f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            if self.healthy(timeout_s=2.0):
                return
            time.sleep(0.5)
        self.refresh_log()
        assert self.log_path is not None  # launched (_until_ready): launch gave it its log
        raise ServerError(f"vLLM did not become healthy within {timeout_s:.0f} s "
                          f"(server.startup_timeout_s); last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def served_models(self) -> list[str]:
        _, body = self._request("GET", self.engine.models_path, 10.0)
        return [m.get("id") for m in json.loads(body).get("data", [])]

    def verify_ours(self) -> None:
        """The server answering on our port serves this run's alias: not another run's server that
        took the port first (our own process would then fail to bind and exit)."""
        if not self.run_token:
            return
        try:
            models = self.served_models()
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ServerError(f"{self.base_url}/v1/models did not answer ({e}); cannot check that the server "
                              "on this port is the one this run started") from None
        if alias_for(self.run_token) not in models:
            raise ServerError(f"the server answering at {self.base_url} is not the one this run started (it "
                              f"serves {models}, not this run's alias {alias_for(self.run_token)}): another "
                              "server holds the port; stop it or set server.port to a free port")

    def dead_reason(self, health_tries: int = 3) -> Optional[str]:
        """None while the server is up; else why it is not (process gone, or /health not answering)."""
        if self.remote is not None and self.remote.dead_reason():
            return self.remote.dead_reason()
        if self.proc is not None and self.proc.poll() is not None:
            return f"the API server (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        if self.proc is None and self.pid is not None and not _pid_alive(self.pid):
            return f"the API server (pid {self.pid}) is gone"
        for i in range(health_tries):
            if self.healthy(timeout_s=5.0):
                return None
            time.sleep(0.5 * (i + 1))
        return f"{self.base_url}/health did not answer {health_tries} times in a row"

    def died_error(self, reason: str, during: str) -> ServerDied:
        self.refresh_log()
        tail = (f"; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                if self.log_path and Path(self.log_path).is_file() else "")
        return ServerDied(f"{SERVER_DIED}: the vLLM server died during {during}: {reason}{tail}")

    def raise_if_dead(self, during: str) -> None:
        reason = self.dead_reason()
        if reason:
            raise self.died_error(reason, during)

    # ---- profiler -----------------------------------------------------------------------------
    def _post(self, path: str, timeout_s: float) -> None:
        try:
            self._request("POST", path, timeout_s)
        except urllib.error.HTTPError as e:
            raise ServerHTTPError(path, e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerUnreachable(f"POST {self.base_url}{path}: no answer within {timeout_s:.0f} s "
                                    f"({getattr(e, 'reason', e)})") from None

    def start_profile(self) -> None:
        self._post(self.engine.profile_start_path, 120.0)

    def stop_profile(self, timeout_s: float = 900.0) -> None:
        """Returns once the server answered; traces may still be flushing (see profiling.capture)."""
        self._post(self.engine.profile_stop_path, timeout_s)

    # ---- teardown -----------------------------------------------------------------------------
    @property
    def pgid(self) -> Optional[int]:
        # started with setsid: the API server leads its own process group, which its children keep; a
        # server another process of this run started is known by its pid (server.json)
        return self.proc.pid if self.proc is not None else self.pid

    def process_tree(self) -> list[int]:
        if self.remote is not None:
            return self.remote.tree()  # pids on its host, by process group and run token, as its supervisor sees them
        if self.pgid is None or self.run_token is None:
            return []   # attached by URL: its processes are not ours to find
        return procs.run_processes(self.run_token, [self.pgid])

    def stop(self) -> None:
        """Tear down every process of this server (by process group and run token, whether or not the
        API server is still there) and remove its shared-memory files."""
        if self.remote is not None:
            # the host's supervisor does what the branch below does here, and reports it
            report = self.remote.stop()
            self.teardown = {k: report.get(k, []) for k in ("signalled", "shm_removed", "left", "dirs_removed")}
            if getattr(self, "local_port", None):
                self.host.cancel_forward(self.local_port)
        elif self.proc is not None:
            assert self.pgid is not None  # proc's pid while proc is set
            left = self.process_tree()
            self.shm_files |= procs.mapped_shm_files(left)
            signalled = procs.terminate(self.run_token, [self.pgid]) if left else []
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            dirs = [self.spec.tmp_dir] if self.spec is not None and self.spec.tmp_dir else []
            self.teardown = {"signalled": signalled,
                             **procs.release_files(self.run_token, [self.pgid], self.shm_files, dirs)}
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
        if self._held_port is not None:
            release_port(self._held_port)
            self._held_port = None
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def restart(self, timeout_s: float, profiler_dir: Optional[Path] = None,
                params: Optional[Params] = None, profiler_style: str = "config") -> "VllmServer":
        """Stop and start again with the same spec, optionally adding a profiler directory."""
        with_stack = params.profile.with_stack if params is not None else False
        if self.spec is None:
            raise ServerError("an attached server cannot be restarted from here; restart it yourself")
        self.stop()
        spec = self.spec
        if profiler_dir is not None:
            argv, env, keys = list(spec.argv), dict(spec.env), list(spec.extra_env_keys)
            where = self.host.path(profiler_dir) if self.host is not None else profiler_dir
            add_profiler(argv, env, keys, where, profiler_style, with_stack)
            spec = dataclasses.replace(spec, argv=argv, env=env, extra_env_keys=keys)
        assert self.log_path is not None  # a server with a spec was launched, with its log
        return VllmServer.launch(spec, self.log_path, timeout_s, host=self.host,
                                 sync=(profiler_dir,) if profiler_dir is not None else ())

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for s in servers:
        s.stop()


atexit.register(stop_all)
