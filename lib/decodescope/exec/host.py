"""The one execution seam: where the server, the probes and the profile capture run.

`host_for(params)` gives a `LocalHost` or an `SshHost`.
With `host: local`, everything runs here.
With `host: ssh://user@gpu-box[:port]`, the server, the probes and the profiler run there.
The notebooks, the analysis and the report stay here.
Both offer the same operations, so a phase never knows where it runs:

- `python`, `path(local)`: the interpreter, and where a file of the run directory lives on the host.
  The run directory is mirrored under `host.workdir`, `<workdir>/<run id>/...`.
- `run(argv)`: a short command.
- `start(argv, ...)`: a long-running process tree that dies with its controller.
  It returns a `Handle`: `poll`, `wait`, `tree`, `stop`.
- `run_job(...)`: a probe, start to finish.
- `push(local)` / `pull(local)`: inputs there, results back, by rsync.
  Copies resume: a dropped link loses at most the file in flight.
  `--partial-dir` keeps that file's bytes for the next try.
- `forward(port)`: a local port that reaches the host's port.
  It is an ssh tunnel through the run's connection.
- `measure_link(...)`: what the tunnel adds to each round trip.

SshHost is built on the system `ssh` and `rsync` clients, not on a Python ssh library.
So the user's ssh config, agent, keys, ProxyJump and known_hosts work as they do in a terminal.
rsync gives resumable copies, and it needs an ssh transport anyway.
Nothing new is installed.
A run uses one connection.
The first user starts a ControlMaster.
Its socket path is derived from DECODESCOPE_SSH_SESSION.
The run's kernels inherit that variable, so they multiplex over the same connection.
ssh runs with BatchMode=yes and StrictHostKeyChecking=yes, so it never prompts.
An unknown host key is a clear error naming the command to run.
Each long-running process is started on the host under `python -m decodescope.exec.hostagent supervise`.
That supervisor tears its tree down alone when the ssh channel closes (link dropped, controller killed).
It does the same when the channel goes silent (no heartbeat).
Secrets (the API key, server.env) travel on that supervisor's stdin, never on a command line.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from decodescope.exec.attached import PROFILE_PHASE, check_attached, check_reachable
from decodescope.exec.hostcore import RSYNC_TIMEOUT_S, LocalHost
from decodescope.core.io import gzip_complete
from decodescope.core.phases import HOST_PHASES, PHASES
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
    on --resume, copy back what finished there while the link was down; an attached server: a vLLM server
    answering at server.url when a server phase runs (exec.attached.check_reachable), its profiler and trace
    directory checked for 04 (exec.attached.check_attached). Raises HostError (AttachError). Nothing
    is done on the host when none of `phases` runs anything there."""
    host = host_for(params)
    if host.remote and (phases is None or set(phases) & set(HOST_PHASES)):
        host.connect()
        for node in node_hosts(params)[1:]:
            node.connect()
        if resume is not None:
            host.pull(Path(resume), quiet=True, extra=["--exclude=/manifest.json", "--exclude=/params.yaml",
                                                       "--exclude=/notebooks/", "--exclude=/report.html"])
    check_reachable(params, host, list(phases) if phases is not None else PHASES)
    check_attached(params, host, list(phases) if phases is not None else [PROFILE_PHASE])
    return host


def mirror_move(params, paths: Sequence[Path], dest: Path) -> None:
    """Before moving files of a run directory into `dest` here: the same move on the run's ssh host
    (copying the folder back would bring them back otherwise); nothing for a local run."""
    host = host_for(params)
    if host.remote:
        host.mirror_move(paths, dest)


# the files already in a folder of a host, relative to it (run there, so the same code serves ssh and here)
_LIST_FILES = ("import os, sys\nroot = sys.argv[1]\n"
               "for d, _, fs in os.walk(root):\n"
               "    for f in fs:\n        print(os.path.relpath(os.path.join(d, f), root))\n")
SYNC_STAGING = ".trace_sync"  # beside traces/, so no reader of traces/ sees a file still arriving


def _files_on(host, folder: str) -> set[str]:
    r = host.run([host.python, "-c", _LIST_FILES, folder], timeout_s=60.0)
    return set(r.stdout.split("\n")) - {""} if r.returncode == 0 else set()


def _copy_new(host, folder: str, staging: Path, skip: set[str]) -> None:
    """Every file of the host's `folder` not in `skip` into `staging` (over an earlier, partial copy)."""
    staging.mkdir(parents=True, exist_ok=True)
    if host.remote:
        fd, excl = tempfile.mkstemp(suffix=".exclude")
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"/{name}\n" for name in sorted(skip)))
        try:
            host.pull_from(folder, staging, extra=[f"--exclude-from={excl}"])
        finally:
            os.unlink(excl)
        return
    for rel in sorted(_files_on(host, folder) - skip):
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # removed or rewritten while copied: the next sync copies it again
            shutil.copyfile(Path(folder) / rel, dest)


@contextlib.contextmanager
def node_traces(params, trace_dir: Path, folder: Optional[str] = None):
    """While an attached server is profiled: the traces its ranks write in `folder` (default host.trace_dir,
    its --profiler-config torch_profiler_dir) on the host and on each of host.nodes, here or over ssh,
    copied into trace_dir/node<i>/ every host.sync_interval_s and once more at the end.

    Files already there when the block begins are not this run's and stay where they are. A new file is
    copied into a staging folder beside traces/ until it is whole (a complete gzip stream, or a size
    that stopped changing), then moved into traces/node<i>/ by the same thread that copies, and never
    copied again. So a reader of traces/ never sees a partial file, and a file filed elsewhere
    (traces/c<N>/) cannot come back. Nothing for a launched server: its profiler writes in traces/."""
    folder = folder or params.host.trace_dir
    if params.server.mode != "attach" or not folder:
        yield
        return
    trace_dir = Path(trace_dir)
    nodes = list(enumerate(node_hosts(params)))
    done = {i: _files_on(h, folder) for i, h in nodes}
    sizes: dict[Path, int] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def sync_all() -> None:
        with lock:
            for i, h in nodes:
                staging = trace_dir.parent / SYNC_STAGING / f"node{i}"
                _copy_new(h, folder, staging, done[i])
                for p in sorted(q for q in staging.rglob("*") if q.is_file()):
                    size = p.stat().st_size
                    whole = gzip_complete(p) if p.suffix == ".gz" else sizes.get(p) == size
                    sizes[p] = size
                    if whole:
                        rel = p.relative_to(staging)
                        dest = trace_dir / f"node{i}" / rel
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(p, dest)
                        done[i].add(str(rel))

    def loop() -> None:
        while not stop.wait(float(params.host.sync_interval_s)):
            sync_all()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=RSYNC_TIMEOUT_S)
        sync_all()
        shutil.rmtree(trace_dir.parent / SYNC_STAGING, ignore_errors=True)


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

