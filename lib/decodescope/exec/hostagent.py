"""The GPU host's side of `decodescope.exec.host`.

It runs small commands over ssh.
It also supervises every process tree decodescope starts there.
Its commands:

    python -m decodescope.exec.hostagent supervise       (spec on stdin, then control lines; see below)
    python -m decodescope.exec.hostagent info [WORKDIR]
    python -m decodescope.exec.hostagent ps TOKEN
    python -m decodescope.exec.hostagent port-free HOST PORT
    python -m decodescope.exec.hostagent http-rtt URL N
    python -m decodescope.exec.hostagent inventory '{"gpu": null, "peaks": {}}'
    python -m decodescope.exec.hostagent server-tree PORT [STOP_FILE]   (decodescope.exec.servertree)

The `supervise` command reads one JSON line from stdin.
That spec holds argv, env, cwd, log, token, grace_s, shm_globs and the heartbeat timeout.
It starts argv in a new session with DECODESCOPE_RUN_TOKEN=token in its environment.
So every process of the tree carries the token, re-parented or not.
The tree's output is appended to `log`.
It answers on stdout with JSON lines (`started`, `tree`, `exited`, `teardown`, `error`).
It then watches its controller, whose ssh channel is its stdin.
It tears the tree down alone when the controller stops it ("stop") or exits.
It does the same when the link drops (EOF on stdin).
It does the same when no line ("ping") has come within the heartbeat timeout: a link that hangs without closing.
The teardown goes by process group and run token, SIGTERM then SIGKILL.
It also removes the tree's /dev/shm files.
The same teardown happens when the main process exits: the rest of its tree is stopped.
It happens on SIGTERM/SIGHUP/SIGINT too.
Secrets travel in the spec's env, on stdin: never on a command line, never in a file.

Only the standard library and `decodescope.exec.procs` are imported, so this starts in a few tens of ms.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from decodescope.exec import privatedirs, procs

SHM_SCAN_S = 2.0


def _emit(msg: dict) -> None:
    try:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the controller is gone: the teardown goes on without it


class _Stop(Exception):
    pass


def supervise() -> int:
    fd = sys.stdin.fileno()
    got = _read_spec(fd)
    if got is None:
        return 2
    spec, buf = got
    token = spec["token"]
    child = _start_child(spec, token)
    if isinstance(child, int):
        return child
    pgid = child.pid
    _emit({"event": "started", "pid": child.pid, "pgid": pgid, "host": socket.gethostname()})

    def on_signal(signum, frame):
        raise _Stop(f"signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    shm: set[Path] = set()
    reason, rc = _watch(child, fd, buf, token, float(spec.get("heartbeat_timeout_s") or 0), shm)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the teardown finishes whatever arrives now
    _teardown(spec, child, token, shm, reason, rc)
    return 0


def _read_spec(fd: int) -> tuple[dict, bytes] | None:
    """The spec line, read unbuffered: what follows it (control lines) is read from fd later."""
    buf = b""
    while b"\n" not in buf:
        data = os.read(fd, 65536)
        if not data:
            return None
        buf += data
    line, buf = buf.split(b"\n", 1)
    return json.loads(line), buf


def _start_child(spec: dict, token: str) -> subprocess.Popen | int:
    """The main process in its own session, its output appended to the log; an exit code on failure."""
    log = Path(spec["log"])
    try:
        for d in [log.parent, *map(Path, spec.get("mkdirs", []))]:
            d.mkdir(parents=True, exist_ok=True)
        for d in spec.get("private_dirs", []):
            privatedirs.sweep_private_dirs(os.path.dirname(d))  # left by a supervisor killed outright
            privatedirs.hold_private_dir(d)  # held until this supervisor exits, after its teardown
        if spec.get("private_dirs"):
            privatedirs.link_tmp_caches(spec["private_dirs"][0], spec.get("tmp_caches", []))
        logf = open(log, "ab", buffering=0)
        if spec.get("header"):
            logf.write(spec["header"].encode())
    except OSError as e:
        _emit({"event": "error", "error": f"{e.filename or log}: [Errno {e.errno}] {e.strerror}", "errno": e.errno})
        return 3
    env = dict(os.environ)
    for key in spec.get("unset", []):
        env.pop(key, None)
    env.update(spec.get("env", {}))
    env[procs.RUN_TOKEN_ENV] = token
    try:
        return subprocess.Popen(spec["argv"], env=env, cwd=spec.get("cwd") or None, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=procs.new_session_dying_with_parent)
    except OSError as e:
        privatedirs.remove_dirs(spec.get("private_dirs", []))  # nothing started to use them
        _emit({"event": "error", "error": f"cannot start {spec['argv'][0]}: [Errno {e.errno}] {e.strerror}",
               "errno": e.errno})
        return 3
    finally:
        logf.close()


def _watch(child: subprocess.Popen, fd: int, buf: bytes, token: str, heartbeat_s: float,
           shm: set[Path]) -> tuple[str, int | None]:
    """Until the tree must go: why, and the main process's exit code if it exited. The tree's /dev/shm
    files seen meanwhile are added to shm."""
    pgid = child.pid
    last_seen = last_scan = time.monotonic()
    try:
        while True:
            rc = child.poll()
            if rc is not None:
                _emit({"event": "exited", "rc": rc})
                return f"the main process exited with code {rc}", rc
            now = time.monotonic()
            if heartbeat_s and now - last_seen > heartbeat_s:
                return f"no word from the controller for {heartbeat_s:.0f} s (link hung)", None
            if now - last_scan > SHM_SCAN_S:
                shm |= procs.mapped_shm_files(procs.run_processes(token, [pgid]))
                last_scan = now
            ready, _, _ = select.select([fd], [], [], 0.25)
            if not ready:
                continue
            data = os.read(fd, 4096)
            if not data:
                return "the controller went away (ssh channel closed)", None
            last_seen = time.monotonic()
            buf += data
            stop = False
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                cmd = raw.strip().decode(errors="replace")
                if cmd == "stop":
                    stop = True
                elif cmd == "tree":
                    pids = procs.run_processes(token, [pgid])
                    shm |= procs.mapped_shm_files(pids)
                    _emit({"event": "tree", "pids": pids, "shm": sorted(map(str, shm))})
            if stop:
                return "stopped by the controller", None
    except _Stop as e:
        return f"the supervisor got {e}", None
    except KeyboardInterrupt:
        return "the supervisor was interrupted", None


def _teardown(spec: dict, child: subprocess.Popen, token: str, shm: set[Path], reason: str,
              rc: int | None) -> None:
    pgid = child.pid
    left = procs.run_processes(token, [pgid])
    shm |= procs.mapped_shm_files(left)
    signalled = procs.terminate(token, [pgid], grace_s=float(spec.get("grace_s", 15))) if left else []
    if rc is None:
        try:
            rc = child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
    procs.wait_gone(lambda: procs.run_processes(token, [pgid]), 30.0)  # no process left to make one more
    for pattern in spec.get("shm_globs", []):
        shm |= set(procs.SHM_DIR.glob(pattern))
    _emit({"event": "teardown", "reason": reason, "rc": rc, "signalled": signalled,
           **procs.release_files(token, [pgid], shm, spec.get("private_dirs", []))})


def info(workdir: str = "") -> int:
    """Version, interpreter, host name, home, and the free space where the run directories go."""
    import decodescope

    out: dict[str, str | int] = {"version": decodescope.__version__, "python": sys.executable,
                                 "hostname": socket.gethostname(), "home": os.path.expanduser("~")}
    if workdir:
        wd = Path(os.path.expanduser(workdir))
        out["workdir"] = str(wd)
        probe = wd
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        st = os.statvfs(probe)
        out["workdir_free_bytes"] = st.f_bavail * st.f_frsize
    print(json.dumps(out))
    return 0


def http_rtt(url: str, n: int) -> int:
    """Round trips of GET url on this host, in ms (a fresh connection each, as the client opens)."""
    from decodescope.exec.hostcore import http_rtt_ms

    print(json.dumps(http_rtt_ms(url, n)))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else ""
    if cmd == "supervise":
        return supervise()
    if cmd == "info":
        return info(*argv[:1])
    if cmd == "ps":
        print(json.dumps(procs.run_processes(argv[0])))
        return 0
    if cmd == "port-free":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((argv[0], int(argv[1])))
                free = True
            except OSError:
                free = False
        print(json.dumps(free))
        return 0
    if cmd == "http-rtt":
        return http_rtt(argv[0], int(argv[1]))
    if cmd == "inventory":  # data/host.json of this host, for a run driven from elsewhere
        from decodescope.exec.hardware import inventory

        opts = json.loads(argv[0]) if argv else {}
        print(inventory(gpu_override=opts.get("gpu"), peak_overrides=opts.get("peaks")).model_dump_json())
        return 0
    if cmd == "server-tree":  # an attached server, read and never signalled
        from decodescope.exec.servertree import inspect

        print(json.dumps(inspect(int(argv[0]), argv[1] if len(argv) > 1 else None)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
