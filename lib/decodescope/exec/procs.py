"""The processes and shared-memory files a run owns, found without trusting the parent chain.

vLLM's API server, its EngineCore and its TP workers share one process group (the server is started in
a new session) and inherit one environment variable, DECODESCOPE_RUN_TOKEN. When the API server dies
first, its children are re-parented to init and no longer appear under it, so teardown and the tests
walk /proc by process group and by that token instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Optional

from decodescope.exec.privatedirs import remove_dirs

RUN_TOKEN_ENV = "DECODESCOPE_RUN_TOKEN"
SHM_DIR = Path("/dev/shm")
# The run id on every process of a run here (decodescope.orchestration.runner sets it), and on the processes
# a run starts on an ssh host (decodescope.exec.sshhost): decodescope.exec.hostcore re-exports both.
RUN_ID_ENV = "DECODESCOPE_RUN_ID"
HOST_RUN_ID_ENV = "DECODESCOPE_HOST_RUN_ID"
# A probe rank's shared-memory segments (vLLM CPU's shm all-reduce, decodescope.probes.communicators) are named
# decodescope-probe-<token12>-<run key>-<stamp>_<rank>: the launcher that holds the token sweeps its probe's
# segments, the runner that holds the run id sweeps every probe's of the run, each once every process
# that could make one is gone (a name is owned, not found by looking at the ranks that made it).
PROBE_SHM_PREFIX = "decodescope-probe-"
# vLLM CPU workers name their shared-memory segments after the distributed init file
# (file:///tmp/vllm_dist_<hex>): <ident>-<group>-[ranks]-cpushm...; all segments of one server share it.
_VLLM_DIST_IDENT = re.compile(r"(vllm_dist_[0-9a-f]{16,})")


def new_session_dying_with_parent() -> None:
    """For preexec_fn, between fork and exec: the child leads a session of its own (its tree is stopped by
    process group) and gets SIGTERM if the launching process is killed outright (PR_SET_PDEATHSIG), so a
    server or probe never outlives the run that started it."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except OSError:
        pass


def parse_cpulist(spec: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8} (the list taskset -c and VLLM_CPU_OMP_THREADS_BIND take)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cores_offered() -> set[int]:
    """The cores a process started here may be put on (taskset -c): its cgroup's cpuset, which this
    process's own affinity does not narrow (a runner pinned to half the cores may start its server on the
    other half); this process's affinity where no cpuset can be read."""
    for path in _cpuset_files():
        try:
            return parse_cpulist(path.read_text().strip())
        except (OSError, ValueError):  # no such file, or empty (cgroup v2 without the cpuset controller)
            continue
    return set(os.sched_getaffinity(0))


def _cpuset_files(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> list[Path]:
    """This process's cpuset files, from /proc/self/cgroup: cgroup v2's cpuset.cpus.effective, v1's
    cpuset.effective_cpus; then the mount's own, for a container whose /proc/self/cgroup names a path
    outside its cgroup namespace (the H200 machine: '0::/process_api/<id>', mounted as the root)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.rstrip("/")
        if controllers == "":
            out += [root.joinpath(rel.lstrip("/"), "cpuset.cpus.effective"), root / "cpuset.cpus.effective"]
        elif "cpuset" in controllers.split(","):
            out += [root.joinpath("cpuset", rel.lstrip("/"), "cpuset.effective_cpus"),
                    root / "cpuset" / "cpuset.effective_cpus"]
    return out


def new_run_token() -> str:
    return uuid.uuid4().hex


def release_files(token: str | None, pgids: Iterable[int], shm_files: Iterable[Path], dirs: Iterable[str]) -> dict:
    """Once a tree was signalled: remove its shared-memory files, and its private folders if none of its
    processes is left (none to bind one more socket in them); what was removed and the pids left."""
    shm = set(shm_files)
    removed = remove_shm(shm_idents(shm), shm)
    left = run_processes(token, pgids)
    return {"shm_removed": [str(p) for p in removed], "left": left,
            "dirs_removed": [] if left else remove_dirs(dirs)}


def probe_run_key(run_id: Optional[str]) -> str:
    """The run's part of a probe segment's name: 12 hex digits of the run id ('norun' outside a run)."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:12] if run_id else "norun"


def probe_shm_name(environ: Mapping[str, str], stamp: str) -> str:
    """The name (without the _<rank> vLLM adds) of a probe's shm segments, from the rank's environment: its
    launcher's run token and its run's id (here, or on the ssh host)."""
    token = environ.get(RUN_TOKEN_ENV) or f"pid{os.getpid()}"
    run_id = environ.get(RUN_ID_ENV) or environ.get(HOST_RUN_ID_ENV)
    return f"{PROBE_SHM_PREFIX}{token[:12]}-{probe_run_key(run_id)}-{stamp}"


def probe_shm_of_token(token: str) -> list[Path]:
    """The shm segments of the probe launched with this run token."""
    return sorted(SHM_DIR.glob(f"{PROBE_SHM_PREFIX}{token[:12]}-*"))


def probe_shm_of_run(run_id: str) -> list[Path]:
    """The shm segments of every probe of this run (its run id), whatever launched them."""
    return sorted(SHM_DIR.glob(f"{PROBE_SHM_PREFIX}*-{probe_run_key(run_id)}-*"))


def unlink_all(paths: Iterable[Path]) -> list[Path]:
    """Remove these files; those already gone are left out of the answer."""
    removed = []
    for p in paths:
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def wait_gone(find, timeout_s: float = 30.0, poll_s: float = 0.05) -> list[int]:
    """Wait until find() (live pids) is empty, or timeout_s; returns what is still alive then."""
    deadline = time.monotonic() + timeout_s
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = find()
    return left


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def run_processes(token: str | None = None, pgids: Iterable[int] = (), env_name: str = RUN_TOKEN_ENV) -> list[int]:
    """Live (non-zombie) pids that carry `env_name=token` in their environment or belong to one of
    the process groups; this process is never included."""
    pgids = {g for g in pgids if g}
    needle = b"\0" + f"{env_name}={token}\0".encode() if token else None
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me:
            continue
        if (pgids and _pgid(pid) in pgids) or (needle and _environ_has(pid, needle)):
            if not _is_zombie(pid):
                found.append(pid)
    return sorted(found)


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for g in pgids:
        try:
            os.killpg(g, sig)
        except OSError:
            pass


def terminate(token: str | None, pgids: Iterable[int] = (), grace_s: float = 15.0) -> list[int]:
    """SIGTERM every process of the run, SIGKILL what is left after grace_s (looking again, since
    workers may be spawned or re-parented meanwhile). Returns every pid that was signalled."""
    pgids = list(pgids)
    signalled: set[int] = set()
    pids = run_processes(token, pgids)
    _signal_groups(pgids, signal.SIGTERM)
    _signal_all(pids, signal.SIGTERM)
    signalled.update(pids)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        left = run_processes(token, pgids)
        if not left:
            return sorted(signalled)
        _signal_all(set(left) - signalled, signal.SIGTERM)
        signalled.update(left)
        time.sleep(0.2)
    # multiprocessing's resource trackers ignore SIGTERM and unlink the semaphores and shared memory
    # they registered (vLLM's, from its spawned engine and workers) once every process holding their
    # pipe is gone: killed with the rest they would leave those names in /dev/shm, so they go last
    trackers = {p for p in run_processes(token, pgids) if _is_resource_tracker(p)}
    for _ in range(50):
        left = [p for p in run_processes(token, pgids) if p not in trackers]
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        signalled.update(left)
        time.sleep(0.1)
    deadline = time.monotonic() + TRACKER_GRACE_S
    while time.monotonic() < deadline and any(not _is_zombie(p) for p in trackers):
        time.sleep(0.05)
    for _ in range(50):
        left = run_processes(token, pgids)
        if not left:
            break
        _signal_groups(pgids, signal.SIGKILL)
        _signal_all(left, signal.SIGKILL)
        signalled.update(left)
        time.sleep(0.1)
    return sorted(signalled)


TRACKER_GRACE_S = 3.0


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def terminate_pids(pids: Iterable[int], grace_s: float = 5.0, dead_s: float = 10.0) -> list[int]:
    """SIGTERM these processes, SIGKILL the ones still alive after grace_s, and wait (up to dead_s) until
    the killed ones are dead: a caller that removes what they made does so after they can make no more."""
    pids = [p for p in pids if p != os.getpid()]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(not _is_zombie(p) for p in pids):
        time.sleep(0.1)
    _signal_all([p for p in pids if not _is_zombie(p)], signal.SIGKILL)
    wait_gone(lambda: [p for p in pids if not _is_zombie(p)], dead_s)
    return pids


def mapped_shm_files(pids: Iterable[int]) -> set[Path]:
    """/dev/shm files that these processes have mapped or open."""
    files: set[Path] = set()
    prefix = str(SHM_DIR) + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        files.add(Path(line[i:].strip().removesuffix(" (deleted)")))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    files.add(Path(target.removesuffix(" (deleted)")))
        except OSError:
            pass
    return files


def shm_idents(files: Iterable[Path]) -> set[str]:
    """The vLLM instance identifiers in shared-memory file names (one per server start)."""
    return {m.group(1) for p in files if (m := _VLLM_DIST_IDENT.search(p.name))}


def remove_shm(idents: Iterable[str], files: Iterable[Path] = ()) -> list[Path]:
    """Remove the named files and every /dev/shm (and /tmp init) file of these vLLM instances."""
    idents = set(idents)
    removed = []
    candidates = set(files)
    if idents:
        for d in (SHM_DIR, Path("/tmp")):
            try:
                candidates.update(p for p in d.iterdir() if any(i in p.name for i in idents))
            except OSError:
                pass
    for p in sorted(candidates):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError:
            pass
    return removed


# vLLM names its processes (setproctitle): the engine core and the workers; the API server keeps its own.
_ROLES = (("VLLM::Worker", "worker"), ("VLLM::EngineCor", "engine core"))


def named_role(comm: str) -> Optional[str]:
    """A vLLM server process's part from the name vLLM gives it (worker, engine core); None for the rest."""
    return next((role for prefix, role in _ROLES if comm.startswith(prefix)), None)


def _tree_entry(pid: int) -> Optional[tuple[str, int, str]]:
    """(comm, parent pid, command line) of a live process; None when it is gone."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return comm, ppid, cmd


def process_roles(pids: Iterable[int]) -> dict[int, str]:
    """pid -> its part in a vLLM server: by the name vLLM gives it (named_role) where it has one, else by
    its place in the tree: where vLLM cannot name its processes (no setproctitle: the GPU bundle) the engine
    core and the workers keep the interpreter's name, and would all read 'api server'. The tree's root is
    the API server, a child of it the engine core, anything below that a worker; multiprocessing's
    resource tracker is its own part. Processes that are gone are left out."""
    tree = {pid: e for pid in pids if (e := _tree_entry(pid)) is not None}

    def depth(pid: int) -> int:
        d = 0
        while tree[pid][1] in tree and d < 16:
            pid, d = tree[pid][1], d + 1
        return d

    out = {}
    for pid, (comm, _, cmd) in tree.items():
        out[pid] = (named_role(comm) or ("resource tracker" if "multiprocessing.resource_tracker" in cmd else
                              ("api server", "engine core", "worker")[min(depth(pid), 2)]))
    return out


def cores_of(pids: Iterable[int]) -> dict[int, dict]:
    """pid -> {role, cpus}: the cores each process's main thread may run on (Cpus_allowed_list; a
    vLLM CPU worker's is where VLLM_CPU_OMP_THREADS_BIND put it). Processes that are gone are left out."""
    out = {}
    roles = process_roles(pids)
    for pid, role in roles.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        cpus = next((line.split(":", 1)[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list:")), None)
        out[pid] = {"role": role, "cpus": cpus}
    return out


def cpu_schedstat(pids: Iterable[int]) -> dict[int, tuple[str, int, int]]:
    """pid -> (role, CPU time ns, run-queue wait ns) of each process's main thread (the one running its
    loop: a worker's step, the engine core's scheduler), from /proc/<pid>/schedstat: the wait is time
    the thread was ready to run and another held its core. Processes that are gone are left out."""
    out = {}
    for pid, role in process_roles(pids).items():
        try:
            cpu_ns, wait_ns, _ = (int(x) for x in Path(f"/proc/{pid}/schedstat").read_text().split()[:3])
        except (OSError, ValueError):
            continue
        out[pid] = (role, cpu_ns, wait_ns)
    return out


def thread_schedstat(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, CPU time ns, run-queue wait ns) of each thread of a process, from
    /proc/<pid>/task/<tid>/schedstat; the main thread is named 'main', the others by their comm (gloo's
    pt_gloo_runloop, ZMQbg/IO/0, ...). Threads that are gone are left out; a gone process has none."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = "main" if int(task.name) == pid else (task / "comm").read_text().strip()
            cpu_ns, wait_ns = (int(x) for x in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        out[int(task.name)] = (name, cpu_ns, wait_ns)
    return out


def cpu_per_step(before: dict, after: dict, steps: float) -> dict[str, dict]:
    """role -> {cpu_us, runq_wait_us: per engine step, the mean over that role's processes; processes}."""
    by: dict[str, list[tuple[float, float]]] = {}
    for pid, (role, cpu_ns, wait_ns) in after.items():
        if pid in before and steps > 0:
            by.setdefault(role, []).append(((cpu_ns - before[pid][1]) / 1e3 / steps,
                                            (wait_ns - before[pid][2]) / 1e3 / steps))
    return {role: {"cpu_us": sum(c for c, _ in v) / len(v), "runq_wait_us": sum(w for _, w in v) / len(v),
                   "processes": len(v)} for role, v in by.items()}
