"""A server decodescope attached to (`server.mode: attach`): what can be read of it, and the checks made
before any workload reaches it.

decodescope owns none of its processes: it sends requests and the profiler's start and stop, and reads
/proc on the host that runs it (decodescope.exec.servertree, through the host seam, so the same reading
works here and over ssh). It never restarts, stops or signals them.
"""
from __future__ import annotations

import json
import subprocess
import threading
import uuid
from pathlib import PurePosixPath
from typing import Optional
from urllib.parse import urlsplit

from decodescope.core.phases import SERVER_PHASES
from decodescope.exec.hostcore import HostError
from decodescope.engines import engine

PROFILE_PHASE = "04_profile"
FLAG_EXAMPLE = ('--profiler-config \'{"profiler": "torch", "torch_profiler_dir": "/abs/traces", '
                '"torch_profiler_with_stack": false, "torch_profiler_dump_cuda_time_total": false}\'')


class AttachError(HostError):
    """An attached server cannot be measured as asked; the message names the field, value and fix."""


def server_port(params) -> int:
    """The attached server's port as its own host sees it (server.url)."""
    u = urlsplit(params.server.url)
    return int(u.port or (443 if u.scheme == "https" else 80))


def read_server(host, port: int, stop_file: Optional[str] = None, timeout_s: float = 60.0) -> dict:
    """decodescope.exec.servertree.inspect run on the server's host: once, or until stop_file exists
    there. An empty reading ({"pid": None}) when the host cannot run it."""
    argv = [host.python, "-m", "decodescope.exec.hostagent", "server-tree", str(port)]
    if stop_file:
        argv.append(stop_file)
    try:
        r = host.run(argv, timeout_s=timeout_s)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {"pid": None}
    except (OSError, ValueError, IndexError, HostError):
        return {"pid": None}
    except subprocess.TimeoutExpired as e:  # a watch that outlived its window
        return {"pid": None, "error": str(e)}


class TreeWatch:
    """The attached server's resident memory sampled on its host while a profiled window runs (a reader
    process there that stops when a file appears); `.reading` once the `with` block ends."""

    def __init__(self, host, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.stop_file = f"/tmp/decodescope-watch-{uuid.uuid4().hex[:12]}"
        self.reading: dict = {"pid": None}
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "TreeWatch":
        def watch() -> None:
            self.reading = read_server(self.host, self.port, self.stop_file, self.timeout_s)
        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.host.run(["touch", self.stop_file], timeout_s=30.0)
        except (OSError, HostError):
            pass
        if self._thread is not None:
            self._thread.join(timeout=60.0)
        try:
            self.host.run(["rm", "-f", self.stop_file], timeout_s=30.0)
        except (OSError, HostError):
            pass


# Run on the server's host (here or over ssh), so that server.url means what it means there: what answers
# at the URL. Prints one JSON line: listening, and the status and body head of GET /health and /version
# (neither needs the API key in vLLM, so no secret goes on a command line).
_PROBE = ("import json, socket, sys, urllib.error, urllib.request\n"
          "from urllib.parse import urlsplit\n"
          "url = sys.argv[1].rstrip('/'); u = urlsplit(url)\n"
          "port = u.port or (443 if u.scheme == 'https' else 80)\n"
          "out = {'listening': False}\n"
          "try:\n"
          "    socket.create_connection((u.hostname, port), timeout=3.0).close(); out['listening'] = True\n"
          "except OSError as e:\n"
          "    out['error'] = str(e)\n"
          "for path in sys.argv[2:] if out['listening'] else ():\n"
          "    try:\n"
          "        with urllib.request.urlopen(url + path, timeout=5.0) as r:\n"
          "            out[path] = [r.status, r.read(2000).decode('utf-8', 'replace')]\n"
          "    except urllib.error.HTTPError as e:\n"
          "        out[path] = [e.code, '']\n"
          "    except (OSError, ValueError) as e:\n"
          "        out[path] = [None, str(e)]\n"
          "print(json.dumps(out))\n")


def probe_url(host, url: str, timeout_s: float = 30.0) -> dict:
    """What answers at `url` as the server's host sees it: {"listening": bool, "/health": [status, body],
    "/version": [status, body]} (status None when the request got no HTTP answer)."""
    e = engine()
    r = host.run([host.python, "-c", _PROBE, url, e.health_path, e.version_path], timeout_s=timeout_s)
    if r.returncode != 0 or not r.stdout.strip():
        raise AttachError(f"server.mode attach: could not probe server.url {url} on "
                          f"{'this host' if not host.remote else host.name}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _vllm_version(answer: dict) -> Optional[str]:
    """The engine's version from its version endpoint's answer, else None."""
    e = engine()
    status, body = answer.get(e.version_path) or [None, ""]
    return e.version_of(body) if status == 200 else None


def check_reachable(params, host, phases) -> dict:
    """Before any phase runs, when a selected phase needs the attached server: something listens at
    server.url, and it is a vLLM server (GET /health 200 and GET /version naming a vLLM version). Raises
    AttachError with a message of its own for each; returns the probe's answer ({} when not checked)."""
    if params.server.mode != "attach" or not set(phases) & SERVER_PHASES:
        return {}
    url = str(params.server.url).rstrip("/")
    where = "this host" if not host.remote else host.name
    answer = probe_url(host, url)
    if not answer["listening"]:
        raise AttachError(f"server.mode attach: nothing listens at server.url {url} (as {where} sees it: "
                          f"{answer.get('error', 'connection refused')}). Start the vLLM server first, or fix "
                          "server.url (scheme, host and port of its OpenAI API), or use server.mode: launch")
    health = answer.get(engine().health_path) or [None, ""]
    if health[0] is None:
        raise AttachError(f"server.mode attach: something listens at server.url {url} ({where}) but does not answer "
                          f"HTTP (GET /health: {health[1][:200]}); it is not a vLLM server, or it is stuck. "
                          "Point server.url at the vLLM OpenAI server (vllm serve ...)")
    version = _vllm_version(answer)
    if health[0] != 200 or version is None:
        raise AttachError(f"server.mode attach: the server at server.url {url} ({where}) is not a vLLM server: "
                          f"GET /health answered {health[0]}, GET /version answered "
                          f"{(answer.get('/version') or [None])[0]} without a vLLM version. Point server.url at "
                          "a vLLM OpenAI server (vllm serve ...), which answers both")
    return answer


def trace_dir_on_host(params, reading: dict) -> Optional[str]:
    """Where the attached server writes its traces: host.trace_dir, else its own --profiler-config."""
    return params.host.trace_dir or (reading.get("profiler") or {}).get("torch_profiler_dir")


def check_attached(params, host, phases) -> dict:
    """Before any phase runs: the attached server's profiler and trace directory, for 04_profile. Raises
    AttachError naming the field, the value and the server flag to change; returns the reading."""
    if params.server.mode != "attach" or PROFILE_PHASE not in phases:
        return {}
    port = server_port(params)
    reading = read_server(host, port)
    where = f"{params.server.url} ({'this host' if not host.remote else host.name})"
    prof = reading.get("profiler") or {}
    if reading.get("pid") and prof.get("configured") is False:
        raise AttachError(f"server.mode attach: the server at {where} (pid {reading['pid']}) was started without a "
                          f"torch profiler, so 04_profile cannot profile it. Restart it yourself with {FLAG_EXAMPLE}, "
                          "set host.trace_dir to that directory, or leave 04_profile out (--phases)")
    trace_dir = trace_dir_on_host(params, reading)
    if not trace_dir:
        raise AttachError(f"server.mode attach: host.trace_dir is not set and the server's own command line could "
                          f"not be read (no process of this user listens on port {port} on "
                          f"{'this host' if not host.remote else host.name}). Set host.trace_dir to the directory "
                          "the server writes its traces to: the torch_profiler_dir of its " + FLAG_EXAMPLE)
    said = prof.get("torch_profiler_dir")
    if params.host.trace_dir and said and PurePosixPath(said) != PurePosixPath(params.host.trace_dir):
        raise AttachError(f"host.trace_dir is {params.host.trace_dir!r}, but the server at {where} writes its traces "
                          f"to {said!r} (its --profiler-config torch_profiler_dir): set host.trace_dir: {said}")
    if not PurePosixPath(trace_dir).is_absolute():
        raise AttachError(f"host.trace_dir {trace_dir!r} is not an absolute path; vLLM's torch_profiler_dir must be one")
    return reading
