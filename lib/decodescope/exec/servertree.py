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

import os
import time
from typing import Any, Optional

import psutil

from decodescope.engines import DEFAULT_ENGINE, engine

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


def profiler_settings(argv: list[str], environ: Optional[dict] = None, engine_name: str = DEFAULT_ENGINE) -> dict:
    """What the server's own command line (or environment) says of its profiler, as its engine reads it
    (decodescope.engines: {configured, profiler, torch_profiler_dir, torch_profiler_with_stack, source})."""
    return engine(engine_name).profiler_from_launch(argv, environ)


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
    wanted = {k: environ[k] for k in engine().profiler_env if k in environ}  # not the rest: it may hold secrets
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
