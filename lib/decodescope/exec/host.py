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
started under `python -m decodescope.exec.hostagent supervise` on the host, which tears its tree down alone
when the ssh channel closes (link dropped, controller killed) or goes silent (no heartbeat).
Secrets (the API key, server.env) travel on that supervisor's stdin, never on a command line.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from decodescope.exec.hostcore import RSYNC_TIMEOUT_S, LocalHost
from decodescope.core.io import gzip_complete
from decodescope.core.phases import HOST_PHASES
from decodescope.exec.sshhost import SshHost

_HOSTS: dict[str, LocalHost | SshHost] = {}


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
    done: dict[int, set[str]] = {i: set() for i, _ in nodes}
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

