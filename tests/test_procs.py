"""Tear-down of a run's processes (decodescope.exec.procs) against real processes."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from decodescope.exec import privatedirs, procs

# A process of the run that holds a spawn-context semaphore (as vLLM's API server and engine do: its
# name is in /dev/shm until multiprocessing's resource tracker unlinks it) and does not stop on SIGTERM,
# as a hung worker does not: the tear-down has to SIGKILL it.
HOLDER = """
import multiprocessing as mp, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
lock = mp.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(600)
"""


def test_a_killed_runs_semaphores_are_unlinked_by_its_resource_tracker():
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, procs.RUN_TOKEN_ENV: token}, start_new_session=True)
    try:
        name = proc.stdout.readline().strip()
        sem = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
        assert sem.exists(), sem
        # the holder and its resource tracker (which ignores SIGTERM) both carry the run token
        deadline = time.monotonic() + 10
        while len(procs.run_processes(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(procs.run_processes(token)) == 2
        procs.terminate(token, [], grace_s=0.5)
        proc.wait(timeout=10)
        assert procs.run_processes(token) == []
        # the tracker outlived the holder long enough to unlink what it had registered
        assert not sem.exists(), f"{sem} left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_runner_pinned_to_some_cores_may_start_its_server_on_the_others():
    """On the H200 a runner pinned with taskset to cores 8-15 refused server.cpus '0-7' ("cores this host does
    not offer"): the check read the runner's own affinity, while taskset -c may put a child on any core of
    the cgroup's cpuset. A core outside the host still fails, naming the valid ones."""
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    pinned, other = str(cores[0]), str(cores[-1])
    code = ("from decodescope.exec.server import _check_cpus, ServerError\n"
            f"_check_cpus({other!r})\n"
            "try:\n    _check_cpus('4096')\nexcept ServerError as e:\n    print(e)\n")
    proc = subprocess.run(["taskset", "-c", pinned, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "names cores [4096] this host does not offer" in proc.stdout and other in proc.stdout


def test_a_cgroup_path_outside_the_containers_namespace_falls_back_to_the_mounts_own_cpuset(tmp_path):
    """On the H200 machine /proc/self/cgroup reads '0::/process_api/<id>' while /sys/fs/cgroup is that cgroup
    itself: the named path does not exist there, and a runner pinned to 8-15 refused server.cpus 0-7."""
    from decodescope.exec.procs import _cpuset_files

    cg = tmp_path / "cgroup"
    cg.write_text("0::/process_api/f26f8634\n")
    root = tmp_path / "fs"
    root.mkdir()
    (root / "cpuset.cpus.effective").write_text("0-15\n")
    files = _cpuset_files(cg, root)
    assert files == [root / "process_api/f26f8634/cpuset.cpus.effective", root / "cpuset.cpus.effective"]
    assert [f for f in files if f.is_file()] == [root / "cpuset.cpus.effective"]
    (cg).write_text("0::/\n")
    assert _cpuset_files(cg, root)[0] == root / "cpuset.cpus.effective"


def test_roles_come_from_the_process_tree_where_vllm_could_not_name_its_processes(tmp_path):
    """The GPU bundle has no setproctitle, so vLLM's engine core and workers keep the interpreter's name, and on
    the H200 04 read three 'api server' processes (their mean CPU per step). A real tree of the same shape,
    unnamed: a root that spawns (multiprocessing, spawn: its resource tracker too) an 'engine core', which
    spawns a 'worker'."""
    import subprocess
    import sys
    import time

    from decodescope.exec import procs

    script = tmp_path / "tree.py"
    script.write_text(
        "import multiprocessing as mp, sys, time\n"
        "def worker():\n    time.sleep(60)\n"
        "def core():\n"
        "    w = mp.get_context('spawn').Process(target=worker); w.start(); time.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    c = mp.get_context('spawn').Process(target=core); c.start()\n"
        "    print('up', flush=True); time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert root.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30
        while True:
            tree = _group(root.pid)
            roles = procs.process_roles(tree)
            if sorted(roles.values()).count("worker") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        by_role: dict[str, list[int]] = {}
        for pid, role in roles.items():
            by_role.setdefault(role, []).append(pid)
        assert by_role["api server"] == [root.pid]
        assert len(by_role["engine core"]) == 1 and len(by_role["worker"]) == 1, roles
        assert len(by_role.get("resource tracker", [])) >= 1, roles       # spawn starts one beside the root
        assert set(roles) == set(tree)
        # named processes keep the name's role, wherever they sit
        assert procs.named_role("VLLM::EngineCor") == "engine core" and procs.named_role("python3") is None
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (what the runner finds by group and run token)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _spinner_cpu_ns(threads: dict) -> int:
    return max((cpu_ns for name, cpu_ns, _ in threads.values() if name == "ds-spinner"), default=0)


def test_each_threads_cpu_and_run_queue_wait_is_read_by_name():
    """A real process with a named thread that spins: its threads come back by tid, the main one named
    'main' and the other by its comm, the spinner's CPU time growing."""
    code = ("import threading, time, ctypes\n"
            "def spin():\n"
            "    ctypes.CDLL(None).prctl(15, b'ds-spinner', 0, 0, 0)\n"  # PR_SET_NAME: the thread's comm
            "    end = time.monotonic() + 30\n"
            "    while time.monotonic() < end: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\n"
            "print('ready', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        first = procs.thread_schedstat(proc.pid)
        # on a 2-core host beside two vLLM servers the spinner may get 1% of a core (CI: 4 ms of CPU in
        # 0.5 s), so its growth is awaited, not timed: what can fail is a reading that never grows
        deadline = time.monotonic() + 20
        second = procs.thread_schedstat(proc.pid)
        while _spinner_cpu_ns(second) - _spinner_cpu_ns(first) <= 50e6 and time.monotonic() < deadline:
            time.sleep(0.25)
            second = procs.thread_schedstat(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    names = {name for name, _, _ in second.values()}
    assert {"main", "ds-spinner"} <= names and second[proc.pid][0] == "main"
    tid = next(t for t, (name, _, _) in second.items() if name == "ds-spinner")
    assert second[tid][1] - first[tid][1] > 50e6  # ns of CPU: 50 ms of spinning within 20 s
    assert procs.thread_schedstat(proc.pid) == {}  # gone: no threads


def test_a_server_whose_command_cannot_start_leaves_no_folder_and_no_port_held(tmp_path):
    """Popen itself fails (no such interpreter): a ServerError naming it, its TMPDIR folder removed, its
    port lock released so a second launch gets the same error rather than a lock held by this run."""
    import pytest
    from decodescope.exec.server import _HELD_PORTS, ServerError, VllmServer
    from decodescope.exec.serverlaunch import LaunchSpec
    from tests.conftest import free_port
    port = free_port()
    token = uuid.uuid4().hex
    tmp_dir = privatedirs.server_tmp_dir(token, str(tmp_path))
    missing = str(tmp_path / "no-such-python")
    spec = LaunchSpec(argv=[missing, "-m", "vllm"], env=dict(os.environ), host="127.0.0.1", port=port,
                      run_token=token, tmp_dir=tmp_dir)
    for _ in range(2):
        with pytest.raises(ServerError, match="no-such-python") as e:
            VllmServer.launch(spec, tmp_path / "server.log", timeout_s=30)
        assert "could not start" in str(e.value) and "No such file" in str(e.value)
        assert not Path(tmp_dir).exists() and port not in _HELD_PORTS


def test_a_private_folder_is_swept_only_once_nobody_holds_it(tmp_path):
    """Held by a live process: kept; its holder SIGKILLed: removed (its age past the mkdir-to-flock window);
    fresh, or without a lock file (not made by hold_private_dir): kept."""
    held = privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom decodescope.exec import privatedirs\n"
                               f"privatedirs.hold_private_dir({held!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        fresh = privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path))
        os.close(privatedirs.hold_private_dir(fresh))  # released at once, but made just now
        foreign = tmp_path / f"{privatedirs.PRIVATE_DIR_PREFIX}foreign"
        foreign.mkdir()
        later = time.time() + 60
        assert privatedirs.sweep_private_dirs(str(tmp_path)) == []
        assert privatedirs.sweep_private_dirs(str(tmp_path), now=later) == [fresh]
        holder.kill()
        holder.wait()
        assert privatedirs.sweep_private_dirs(str(tmp_path), now=later) == [held]
        assert not Path(held).exists() and foreign.is_dir()
    finally:
        holder.kill()
        holder.wait()


def test_a_cache_folder_is_linked_beside_the_private_one_and_outlives_its_removal(tmp_path):
    """An engine's cache under TMPDIR (Engine.tmp_caches) is one folder beside the servers' own ones, shared by
    each start: what one start wrote there is there for the next, after the first folder was removed."""
    import getpass
    first = privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path))
    os.close(privatedirs.hold_private_dir(first))
    name = f"cache_{getpass.getuser()}"
    assert privatedirs.link_tmp_caches(first, ["cache_{user}"]) == [os.path.join(first, name)]
    (Path(first) / name / "compiled.so").write_text("kernel")
    assert privatedirs.remove_dirs([first]) == [first] and not Path(first).exists()
    assert (tmp_path / name / "compiled.so").read_text() == "kernel"
    second = privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path))
    os.close(privatedirs.hold_private_dir(second))
    privatedirs.link_tmp_caches(second, ["cache_{user}"])
    assert (Path(second) / name / "compiled.so").read_text() == "kernel"
    # a cache that cannot be made beside it (a file in its place) is left out, not an error
    (tmp_path / "blocked").write_text("")
    assert privatedirs.link_tmp_caches(second, ["blocked/x"]) == []


def test_a_run_killed_outright_leaves_a_folder_the_next_launch_removes(tmp_path):
    """The controller is SIGKILLed while its server starts: the server dies with it (PR_SET_PDEATHSIG) but no
    teardown runs, so its TMPDIR folder stays, unheld; the next launch in the same place removes it."""
    import psutil
    import pytest
    from decodescope.exec.server import ServerError, VllmServer
    from decodescope.exec.serverlaunch import LaunchSpec
    pidfile = tmp_path / "server.pid"
    tmp_dir = privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path))
    controller = subprocess.Popen([sys.executable, "-c", f"""
import os, sys
from pathlib import Path
from decodescope.exec.server import VllmServer
from decodescope.exec.serverlaunch import LaunchSpec
server = [sys.executable, "-c", "import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
spec = LaunchSpec(argv=server, env=dict(os.environ), host="127.0.0.1", port=1, run_token="t" * 32,
                  tmp_dir={tmp_dir!r})
VllmServer.launch(spec, Path({str(tmp_path / 'server.log')!r}), timeout_s=120)
"""])
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server_pid = int(pidfile.read_text())
        assert Path(tmp_dir).is_dir()
        controller.kill()
        controller.wait()
        assert psutil.wait_procs([psutil.Process(server_pid)], timeout=30)[1] == []  # the server died with it
    except psutil.NoSuchProcess:
        pass
    finally:
        controller.kill()
        controller.wait()
    assert Path(tmp_dir).is_dir()  # no teardown ran
    os.utime(Path(tmp_dir) / ".held", (time.time() - 60, time.time() - 60))  # past the mkdir-to-flock window
    spec = LaunchSpec(argv=[str(tmp_path / "no-such-python")], env=dict(os.environ), host="127.0.0.1", port=1,
                      run_token=uuid.uuid4().hex, tmp_dir=privatedirs.server_tmp_dir(uuid.uuid4().hex, str(tmp_path)))
    with pytest.raises(ServerError, match="could not start"):
        VllmServer.launch(spec, tmp_path / "server.log", timeout_s=30)
    assert not Path(tmp_dir).exists()
