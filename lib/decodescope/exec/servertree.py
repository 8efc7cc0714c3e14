"""An attached server's processes, read from /proc and never signalled.

decodescope does not own a server it attaches to, so it only reads what the host shows of it: the process
listening on the server's port, that process's tree (engine core, workers), the profiler settings on its
command line, and the tree's resident memory over time. The command line and environment are read for the
profiler's settings alone; nothing else of them (an API key, say) leaves this module.

    python -m decodescope.exec.hostagent server-tree PORT [STOP_FILE]

runs `inspect` on the host that runs the server (here or over ssh) and prints its JSON: once, or sampling
the tree's memory until STOP_FILE exists.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import psutil

# vLLM's ProfilerConfig defaults (vllm/config/profiler.py): stacks on unless the flag turns them off.
PROFILER_FLAG = "--profiler-config"
DEFAULT_WITH_STACK = True
SAMPLE_INTERVAL_S = 0.05
MAX_WATCH_S = 1800.0


def listening_pid(port: int) -> Optional[int]:
    """The pid of the process listening on TCP `port` (any address), None when none is visible."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    return None


def tree_of(pid: int) -> list[int]:
    """pid and every descendant still alive."""
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def profiler_settings(argv: list[str], environ: Optional[dict] = None) -> dict:
    """What the server's own command line (or, on vLLM before 0.13, its environment) says of its profiler.

    Returns {configured, profiler, torch_profiler_dir, torch_profiler_with_stack, source}; `configured` is
    False when neither sets a torch profiler directory. Flag forms: `--profiler-config JSON`,
    `--profiler-config=JSON`, and `--profiler-config.KEY VALUE` / `--profiler-config.KEY=VALUE`.
    """
    fields: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == PROFILER_FLAG or arg.startswith(PROFILER_FLAG + "="):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            value = _json_value(text)
            if isinstance(value, dict):
                fields.update(value)
            i += 1 if "=" in arg else 2
            continue
        if arg.startswith(PROFILER_FLAG + "."):
            key, sep, text = arg[len(PROFILER_FLAG) + 1:].partition("=")
            if not sep and i + 1 < len(argv):
                text, i = argv[i + 1], i + 1
            fields[key.replace("-", "_")] = _json_value(text)
        i += 1
    env = environ or {}
    source = "command line" if fields else None
    if not fields and env.get("VLLM_TORCH_PROFILER_DIR"):
        fields = {"profiler": "torch", "torch_profiler_dir": env["VLLM_TORCH_PROFILER_DIR"],
                  "torch_profiler_with_stack": env.get("VLLM_TORCH_PROFILER_WITH_STACK", "1") not in ("0", "false")}
        source = "environment"
    with_stack = fields.get("torch_profiler_with_stack", DEFAULT_WITH_STACK)
    if isinstance(with_stack, str):
        with_stack = with_stack.lower() not in ("0", "false", "no")
    directory = fields.get("torch_profiler_dir") or None
    return {"configured": fields.get("profiler") == "torch" and bool(directory), "profiler": fields.get("profiler"),
            "torch_profiler_dir": directory, "torch_profiler_with_stack": bool(with_stack), "source": source}


def _read_settings(pid: int) -> dict:
    try:
        proc = psutil.Process(pid)
        argv = proc.cmdline()
        try:
            environ = proc.environ()
        except (psutil.AccessDenied, OSError):
            environ = {}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {"configured": None}
    wanted = {k: environ[k] for k in ("VLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_WITH_STACK") if k in environ}
    return profiler_settings(argv, wanted)


def _rss(pids: list[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            out[pid] = int(psutil.Process(pid).memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def inspect(port: int, stop_file: Optional[str] = None, interval_s: float = SAMPLE_INTERVAL_S,
            max_s: float = MAX_WATCH_S) -> dict:
    """The server on `port` as this host sees it: its pids, its profiler settings, the memory the host has
    available, and each process's resident memory at the start and at its peak (sampled every interval_s
    until stop_file exists, when one is given)."""
    pid = listening_pid(port)
    out: dict[str, Any] = {"port": port, "pid": pid, "pids": [], "profiler": {"configured": None},
                           "mem_available_bytes": int(psutil.virtual_memory().available),
                           "rss_start_bytes": {}, "rss_peak_bytes": {}, "samples": 0, "alive_at_end": None}
    if pid is None:
        return out
    pids = tree_of(pid)
    out["pids"] = pids
    out["profiler"] = _read_settings(pid)
    start = _rss(pids)
    peak = dict(start)
    samples = 1
    t0 = time.monotonic()
    while stop_file and not os.path.exists(stop_file) and time.monotonic() - t0 < max_s:
        time.sleep(interval_s)
        for p, rss in _rss(pids).items():
            peak[p] = max(peak.get(p, 0), rss)
        samples += 1
    out.update(rss_start_bytes={str(p): v for p, v in start.items()},
               rss_peak_bytes={str(p): v for p, v in peak.items()}, samples=samples,
               watched_s=time.monotonic() - t0, alive_at_end=psutil.pid_exists(pid))
    return out
