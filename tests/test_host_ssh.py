"""The execution seam over ssh, against a real sshd (Debian's openssh-server) standing in for the GPU host.

The fixture starts `sshd -D -f CONFIG` on a free port of 127.0.0.1 with a throwaway host key and user key
(root login by key only), and a known_hosts file that knows the host key. The "host" is this machine, so
the tests can look at its processes directly: what decodescope starts there carries its run token, and
nothing may carry it once a test is over. Faults are injected for real (the ssh client killed, stopped,
the host's disk full) and their figures recorded in outputs/fault_table.json like tests/test_faults.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from decodescope.exec import privatedirs, procs
from decodescope.exec.host import host_for
from decodescope.exec.hostcore import HostError, HostKeyUnknown, HostVersionMismatch, LinkDropped
from decodescope.exec.sshhost import SshHost
from decodescope.schema.params import HostParams, load_params
from tests.conftest import free_port
from tests.faultload import record_fault

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = [pytest.mark.ssh,
              pytest.mark.skipif(not (Path(SSHD).exists() and shutil.which("rsync")),
                                 reason="needs Debian's openssh-server and rsync (make test installs them)")]
REPO = Path(__file__).resolve().parents[1]
FAKE_SERVER = Path(__file__).resolve().parent / "fake_openai_server.py"


class Sshd:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        for name in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
        (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
        (root / "authorized_keys").chmod(0o600)
        host_pub = (root / "host_key.pub").read_text().split()
        self.known_hosts = root / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.identity = root / "user_key"
        config = root / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {root / 'host_key'}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes", "StrictModes no", "UsePAM no", "MaxSessions 100",
            "MaxStartups 100:30:200", "LogLevel ERROR", ""]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
        self.log = open(root / "sshd.log", "wb")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"sshd did not start: {(root / 'sshd.log').read_text()}")

    @property
    def url(self) -> str:
        return f"ssh://root@127.0.0.1:{self.port}"

    def stop(self) -> None:
        """sshd, its per-connection children and anything left under them."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        self.proc.terminate()
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.kill()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    d = Sshd(tmp_path_factory.mktemp("sshd"))
    yield d
    d.stop()


@pytest.fixture
def session(monkeypatch):
    """Each test its own ssh session (ControlMaster), closed at its end."""
    monkeypatch.setenv("DECODESCOPE_SSH_SESSION", os.urandom(8).hex())
    hosts: list[SshHost] = []
    yield hosts
    for h in hosts:
        h.close()


@pytest.fixture
def host(sshd, tmp_path, session):
    """An SshHost for the sshd stand-in: run directories under tmp_path/out here, tmp_path/remote there."""
    h = SshHost(host_params(sshd, tmp_path), tmp_path / "out")
    session.append(h)
    (tmp_path / "out" / "run" / "logs").mkdir(parents=True)
    (tmp_path / "out" / "run" / "data").mkdir(parents=True)
    return h


def host_params(sshd: Sshd, tmp_path: Path, **kw) -> HostParams:
    return HostParams(url=sshd.url, python=sys.executable, workdir=str(tmp_path / "remote"),
                      identity=str(sshd.identity), known_hosts=str(sshd.known_hosts), **kw)


def token_processes(token: str) -> list[int]:
    return procs.run_processes(token)


def wait_gone(token: str, timeout: float) -> float:
    t0 = time.monotonic()
    while token_processes(token) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return time.monotonic() - t0


TREE = ("import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']) for _ in range(3)]\n"
        "print('tree up', flush=True)\n"
        "time.sleep(600)\n")


# ---- the connection ---------------------------------------------------------------------------------
def owns_master(host: SshHost) -> bool:
    """Whether this host object started the connection's ControlMaster (and it still runs)."""
    return host._master is not None and host._master.poll() is None


def test_a_command_runs_there_over_the_runs_one_connection(host):
    host.connect()
    assert host.info["version"] == __import__("decodescope").__version__
    assert owns_master(host) and host.master_alive()
    # ssh's error file is read only while connecting: none is left a connection (one a start once was)
    assert host._master_err is not None and not host._master_err.exists()
    r = host.run(["sh", "-c", "echo $((6 * 7))"])
    assert r.returncode == 0 and r.stdout.strip() == "42"
    # a second host object of the same run (a phase's kernel) multiplexes over the same master
    again = SshHost(host.hp, host.output_root)
    again.connect()
    assert not owns_master(again) and again.control == host.control
    assert again.run(["true"]).returncode == 0
    again.close()
    assert host.master_alive()  # only its owner ends the connection


def test_unknown_host_key_is_a_clear_error_at_once_and_never_a_prompt(sshd, tmp_path, session, write_params):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    h = SshHost(host_params(sshd, tmp_path).model_copy(update={"known_hosts": str(empty)}), tmp_path / "out")
    session.append(h)
    t0 = time.monotonic()
    with pytest.raises(HostKeyUnknown) as e:
        h.connect()
    elapsed = time.monotonic() - t0
    assert elapsed < 5
    msg = str(e.value)
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {empty}" in msg and "never prompts" in msg
    # as a user meets it: `decodescope run` exits 2 before making anything, with stdin open and unread
    params = write_params(_params_text(sshd, tmp_path, known_hosts=empty))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "run", str(params)], stdin=subprocess.PIPE,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    wall = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert "ssh-keyscan" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*-sshrun"))
    record_fault("ssh host key unknown", "one error line naming the host and the ssh-keyscan command to run; "
                 "never a prompt (BatchMode); nothing made", rc=proc.returncode, results_lost="none",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(wall, 1))


def test_wrong_remote_version_says_what_to_run_there(sshd, tmp_path, session):
    fake = tmp_path / "old" / "decodescope"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.0.1"\n')
    python = tmp_path / "old-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "old"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    h = SshHost(host_params(sshd, tmp_path).model_copy(update={"python": str(python)}), tmp_path / "out")
    session.append(h)
    t0 = time.monotonic()
    with pytest.raises(HostVersionMismatch) as e:
        h.connect()
    wall = time.monotonic() - t0
    version = __import__("decodescope").__version__
    assert "decodescope 0.0.1 is installed" in str(e.value)
    assert f"{python} -m pip install 'decodescope[gpu]=={version}'" in str(e.value)
    # as a user meets it: `decodescope run` exits 2 with that one line, before making anything
    text = _params_text(sshd, tmp_path).replace(f"  python: {sys.executable}\n", f"  python: {python}\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "run", str(_write(tmp_path, text))],
                          capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    assert proc.returncode == 2 and "pip install 'decodescope[gpu]==" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    record_fault("wrong decodescope version on the ssh host", "one error line with both versions and the pip "
                 "command to run there; nothing started or made", rc=proc.returncode, results_lost="none",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(wall, 1))


# ---- process trees there ------------------------------------------------------------------------------
def _start_tree(host: SshHost, tmp_path: Path, **kw):
    log = tmp_path / "out" / "run" / "logs" / "tree.log"
    handle = host.start([sys.executable, "-c", TREE], log, **kw)
    deadline = time.monotonic() + 20
    while len(token_processes(handle.token)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(token_processes(handle.token)) == 4
    return handle


def test_the_tree_there_is_torn_down_when_the_link_drops(host, tmp_path):
    handle = _start_tree(host, tmp_path)
    assert sorted(handle.tree()) == token_processes(handle.token)
    os.kill(host._master.pid, signal.SIGKILL)  # the link drops: ssh is killed
    gone_s = wait_gone(handle.token, 30)
    assert token_processes(handle.token) == []
    handle.wait(10)
    assert handle.link_lost and "dropped" in handle.dead_reason()
    print(f"link dropped: remote tree of 4 gone after {gone_s:.2f} s")


def test_the_tree_there_is_torn_down_when_the_controller_is_killed_outright(sshd, tmp_path):
    """SIGKILL to the process that started it (no finally, no atexit): its ssh clients die with it
    (PR_SET_PDEATHSIG), the host's supervisor sees its channel close and tears down alone."""
    controller = tmp_path / "controller.py"
    controller.write_text(f"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
os.environ["DECODESCOPE_SSH_SESSION"] = os.urandom(8).hex()
from decodescope.exec.sshhost import SshHost
from decodescope.schema.params import HostParams
hp = HostParams.model_validate({host_params(sshd, tmp_path).model_dump()!r})
h = SshHost(hp, Path({str(tmp_path / 'out')!r}))
(Path({str(tmp_path / 'out')!r}) / "run" / "logs").mkdir(parents=True, exist_ok=True)
handle = h.start([sys.executable, "-c", {TREE!r}], Path({str(tmp_path / 'out/run/logs/tree.log')!r}))
print(handle.token, flush=True)
time.sleep(600)
""")
    proc = subprocess.Popen([sys.executable, str(controller)], stdout=subprocess.PIPE, text=True)
    token = proc.stdout.readline().strip()
    assert token, "controller did not start its tree"
    deadline = time.monotonic() + 20
    while len(token_processes(token)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(token_processes(token)) == 4
    proc.kill()
    proc.wait()
    gone_s = wait_gone(token, 30)
    assert token_processes(token) == []
    print(f"controller killed: remote tree gone after {gone_s:.2f} s")


def test_a_hung_link_is_noticed_by_the_heartbeat(sshd, tmp_path, session):
    """The link hangs without closing (the ssh client stopped): the host hears no heartbeat and tears
    down after host.heartbeat_timeout_s."""
    timeout_s = 3.0
    h = SshHost(host_params(sshd, tmp_path, heartbeat_timeout_s=timeout_s), tmp_path / "out")
    session.append(h)
    (tmp_path / "out" / "run" / "logs").mkdir(parents=True)
    handle = _start_tree(h, tmp_path)
    os.kill(h._master.pid, signal.SIGSTOP)
    try:
        gone_s = wait_gone(handle.token, 30)
    finally:
        os.kill(h._master.pid, signal.SIGCONT)
    assert token_processes(handle.token) == []
    # The host last heard a ping up to one ping interval before the SIGSTOP, so its teardown can start as early
    # as timeout - interval after it. The interval is SshHandle._ping's (no constant to import):
    # max(0.5, min(5.0, heartbeat_timeout_s / 4)), 0.75 s here; and 0.25 s of margin.
    # The upper bound is loose (20 s, was 10 s) for the load on CI's 2-core machine, where the teardown's
    # signals and the polls are slow to run; a host that never noticed would still fail (wait_gone gives up at 30 s).
    ping_s = max(0.5, min(5.0, timeout_s / 4))
    assert timeout_s - ping_s - 0.25 < gone_s < 20, gone_s
    handle.stop(timeout_s=10)


def test_stop_tears_the_tree_down_and_says_what_it_did(host, tmp_path):
    handle = _start_tree(host, tmp_path)
    report = handle.stop()
    assert token_processes(handle.token) == []
    assert len(report["signalled"]) == 4 and report["left"] == []


def test_secrets_go_on_stdin_never_on_a_command_line(host, tmp_path):
    secret = "sk-ssh-secret-5f4e3d2c1b"
    seen: set[str] = set()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for p in psutil.process_iter(["cmdline"]):
                seen.add(" ".join(p.info["cmdline"] or []))
            time.sleep(0.05)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        log = tmp_path / "out" / "run" / "logs" / "secret.log"
        digest = hashlib.sha256(secret.encode()).hexdigest()  # the program names the secret by its hash only
        code = ("import hashlib, os, time; print('have key:', hashlib.sha256(os.environ['VLLM_API_KEY'].encode())"
                f".hexdigest() == {digest!r}, flush=True); time.sleep(2)")
        handle = host.start([sys.executable, "-c", code], log, env={"VLLM_API_KEY": secret})
        assert handle.wait(30) == 0
        handle.stop()
    finally:
        stop.set()
        sampler.join()
    assert "have key: True" in log.read_text()
    assert len(seen) > 20 and not [c for c in seen if secret in c]
    leaks = [p for p in (tmp_path / "remote").rglob("*") if p.is_file() and secret in p.read_text(errors="replace")]
    assert leaks == []


# ---- files back ---------------------------------------------------------------------------------------
def _rsync_stats(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        for key in ("Literal data", "Matched data", "Total file size"):
            if line.startswith(key + ":"):
                out[key] = int(line.split(":")[1].split()[0].replace(",", ""))
    return out


def test_copy_back_keeps_finished_files_and_resumes_the_one_in_flight_after_a_drop(host, tmp_path):
    host.connect()
    local = tmp_path / "out" / "run" / "traces"
    local.mkdir()
    remote = Path(host.path(local))
    remote.mkdir(parents=True)
    (remote / "a_rank0.json.gz").write_bytes(os.urandom(1 << 20))
    (remote / "b_rank1.json.gz").write_bytes(os.urandom(1 << 20))
    (remote / "c_rank2.json.gz").write_bytes(os.urandom(24 << 20))
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in remote.iterdir()}
    done = threading.Event()
    threading.Thread(target=lambda: (host.pull(local, quiet=True, extra=["--bwlimit=8192"]), done.set()),
                     daemon=True).start()
    deadline = time.monotonic() + 60
    partial = tmp_path / "out" / "run" / ".partial"
    while time.monotonic() < deadline and not (local / "b_rank1.json.gz").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # c is in flight
    t_drop = time.monotonic()
    os.kill(host._master.pid, signal.SIGKILL)
    assert done.wait(60)
    # finished pieces are whole; the one in flight is not visible as a file of the folder
    assert {p.name for p in local.iterdir()} == {"a_rank0.json.gz", "b_rank1.json.gz"}
    for name in ("a_rank0.json.gz", "b_rank1.json.gz"):
        assert hashlib.sha256((local / name).read_bytes()).hexdigest() == digests[name]
    kept = partial / "c_rank2.json.gz"
    assert kept.is_file() and 0 < kept.stat().st_size < (24 << 20)
    kept_bytes = kept.stat().st_size
    host.connect()  # the link is back
    assert host.pull(local, extra=["--stats"])
    recover_s = time.monotonic() - t_drop
    stats = _rsync_stats(host.last_rsync_stdout)
    assert stats["Matched data"] >= 0.9 * kept_bytes  # the bytes that had arrived were not sent again
    assert stats["Literal data"] <= (24 << 20) - 0.9 * kept_bytes
    for p in local.iterdir():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == digests[p.name]
    print(f"resumed copy: {stats}")
    record_fault("ssh link dropped while results are copied back (ssh killed)",
                 "finished files whole, the file in flight never half-visible; the next copy resumes it "
                 "(rsync --partial-dir: its bytes are not sent again)", rc=0,
                 results_lost="none (2 finished files byte-identical; 1 in flight resumed)", processes_left=0,
                 shm_files_left=0, recover_s=round(recover_s, 1))


def test_a_result_being_written_there_is_never_copied_back_as_its_temporary_file(host, tmp_path):
    from decodescope.core.io import write_bytes_atomic

    host.connect()
    local = tmp_path / "out" / "run" / "data" / "serving"
    local.mkdir(parents=True)
    remote = Path(host.path(local))
    write_bytes_atomic(remote / "level_00004.parquet", b"whole")
    # what the atomic writer has open while a level is written (core.io._atomic_target's name)
    (remote / ".level_00001.parquet.gkmsgj1q.tmp").write_bytes(b"half")
    assert host.pull(local)
    assert sorted(p.name for p in local.iterdir()) == ["level_00004.parquet"]
    (remote / ".level_00001.parquet.gkmsgj1q.tmp").rename(remote / "level_00001.parquet")
    assert host.pull(local)
    assert sorted(p.name for p in local.iterdir()) == ["level_00001.parquet", "level_00004.parquet"]


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_remote_disk_full_is_one_clear_error_and_nothing_is_left_there(sshd, tmp_path, session):
    from decodescope.micro import bench as mb

    with tmpfs(tmp_path / "remote", "512k") as disk:
        params = load_params(_write(tmp_path, _params_text(sshd, tmp_path, workdir=disk)))
        run_dir = _run_dir(params)
        (run_dir / "data" / "host.json").write_text("{}")
        host = host_for(params)
        session.append(host)
        host.connect()
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        t0 = time.monotonic()
        with pytest.raises(HostError) as e:
            mb.run_collectives_probe(params, run_dir)
        wall = time.monotonic() - t0
    msg = str(e.value)
    assert "No space left on device" in msg and str(disk) in msg, msg
    assert all(p.read_bytes() == b for p, b in before.items() if p.name != "collectives_plan.json")
    assert not processes_of("decodescope.probes", tmp_path)
    record_fault("ssh host's disk full", "one error naming the host's path and errno 28; results here kept; "
                 "nothing started or left there", rc=1, results_lost="the phase in flight", processes_left=0,
                 shm_files_left=0, detect_and_stop_s=round(wall, 1))


# ---- the server seam, with a stand-in server ---------------------------------------------------------
def _fake_spec(port: int, token: str):
    from decodescope.exec.serverlaunch import LaunchSpec, alias_for

    argv = [sys.executable, str(FAKE_SERVER), "--served-model-name", "m", alias_for(token), "--host", "127.0.0.1",
            "--port", str(port)]
    own_tmp = privatedirs.server_tmp_dir(token, "/tmp")  # as serverlaunch.launch_spec names it for an ssh host
    env = dict(os.environ, **{procs.RUN_TOKEN_ENV: token, "VLLM_RPC_BASE_PATH": own_tmp})
    return LaunchSpec(argv=argv, env=env, host="127.0.0.1", port=port, api_key="sk-fake-0000", run_token=token,
                      tmp_dir=own_tmp, tmp_caches=["decodescope-test-cache-{user}"])


def test_a_server_there_is_reached_through_a_tunnel_and_torn_down_with_its_shm(host, tmp_path):
    from decodescope.exec.server import VllmServer

    port = free_port()
    spec = _fake_spec(port, procs.new_run_token())
    log = tmp_path / "out" / "run" / "logs" / "server.log"
    server = VllmServer.launch(spec, log, 60, run_dir=tmp_path / "out" / "run", host=host)
    try:
        assert server.base_url != f"http://127.0.0.1:{port}"  # through the tunnel's own port
        assert server.healthy() and server.dead_reason() is None
        assert not server.remote.stderr_path.exists()  # read only while the supervisor starts it
        assert len(server.tree_pids) == 3
        # Poll rather than sleep a fixed 2.5 s (too short on CI's loaded 2-core machine): each tree() asks the
        # host's supervisor, which then maps the tree's shm files afresh and answers with all it has seen
        # (remote.shm); a tree() that got no answer returns [] and leaves remote.shm as it was.
        deadline = time.monotonic() + 30
        while True:
            shm = list(server.remote.tree() and server.remote.shm)
            if len(shm) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert len(shm) == 2, shm
        # the supervisor there made the server's socket folder before the start, and its workers bound in it;
        # it holds the folder's lock while the server lives, so no other run's sweep takes it
        assert len([p for p in Path(spec.tmp_dir).iterdir() if p.is_socket()]) == 2
        with open(Path(spec.tmp_dir) / ".held") as held, pytest.raises(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # the cache folder the spec names is linked from it to beside it, with the host's user
        cache = f"decodescope-test-cache-{getpass.getuser()}"
        assert os.readlink(Path(spec.tmp_dir) / cache) == f"/tmp/{cache}" and Path(f"/tmp/{cache}").is_dir()
        link = host.measure_link(server.base_url + "/health", f"http://127.0.0.1:{port}/health", n=10)
        assert link.via_tunnel_p50_ms > 0 and link.on_host_p50_ms > 0
        assert link.added_p50_ms == link.via_tunnel_p50_ms - link.on_host_p50_ms
    finally:
        server.stop()
    assert token_processes(spec.run_token) == []
    assert [f for f in shm if Path(f).exists()] == []
    assert sorted(server.teardown["shm_removed"]) == sorted(shm)
    assert server.teardown["dirs_removed"] == [spec.tmp_dir] and not Path(spec.tmp_dir).exists()
    assert Path(f"/tmp/{cache}").is_dir()  # the link went with the folder, the cache stays
    os.rmdir(f"/tmp/{cache}")
    assert "fake server on" in log.read_text()  # the log came back


def test_a_killed_server_there_is_noticed_and_the_rest_of_its_tree_removed(host, tmp_path):
    from decodescope.exec.server import VllmServer

    port = free_port()
    spec = _fake_spec(port, procs.new_run_token())
    server = VllmServer.launch(spec, tmp_path / "out" / "run" / "logs" / "server.log", 60,
                               run_dir=tmp_path / "out" / "run", host=host)
    try:
        time.sleep(2.5)  # the supervisor has seen the workers' shm segments
        server.remote.tree()
        shm = list(server.remote.shm)
        os.kill(server.remote.pid, signal.SIGKILL)  # the API server only: its workers stay up
        t0 = time.monotonic()
        while server.dead_reason(health_tries=1) is None and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        reason = server.dead_reason(health_tries=1)
        wait_gone(spec.run_token, 30)
        detect_s = time.monotonic() - t0
        assert "exited with code -9" in reason
        assert token_processes(spec.run_token) == []
        assert [f for f in shm if Path(f).exists()] == []
    finally:
        server.stop()
    record_fault("server on the ssh host killed (SIGKILL to its API server; stand-in server)",
                 "noticed (server_died); the host's supervisor stops the workers and removes their shm files",
                 rc=1, results_lost="none", processes_left=len(token_processes(spec.run_token)), shm_files_left=0,
                 detect_and_stop_s=round(detect_s, 1))


# ---- probes there ---------------------------------------------------------------------------------------
def _params_text(sshd: Sshd, tmp_path: Path, known_hosts: Path | None = None, workdir: Path | None = None,
                 extra_host: str = "", url: str | None = None) -> str:
    return f"""
run:
  name: sshrun
  output_dir: {tmp_path / 'out'}
host:
  url: {url or sshd.url}
  python: {sys.executable}
  workdir: {workdir or tmp_path / 'remote'}
  identity: {sshd.identity}
  known_hosts: {known_hosts or sshd.known_hosts}
{extra_host}
server:
  tensor_parallel: 2
model:
  name: tiny-qwen3-moe
  config: {REPO / 'params/models/tiny-qwen3-moe.json'}
microbench:
  batches: [1, 2]
  iterations: 3
  warmup: 1
  sweep_max_bytes: 4096
  all_to_all_tokens: [1, 2]
"""


def _write(tmp_path: Path, text: str, name: str = "ssh.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# make test runs this module beside the fault tests (tests/lanes.py), whose runs start probes and load
# generators of their own: a check for what is left looks at this test's processes (their command lines name
# its directory) and at the probe segments no live process holds.
def processes_of(module: str, tmp_path: Path) -> list[int]:
    """Live processes running `module` whose command line names a path under tmp_path."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if module in cmd and str(tmp_path) in cmd:
            out.append(p.pid)
    return out


def settled_segments(run_id: str, timeout_s: float = 30.0) -> list[Path]:
    """The probe segments of this run (by its key in their names: procs.probe_shm_name) once the host's
    supervisor has had time to sweep them, polled: this test's own, whatever other tests leave."""
    deadline = time.monotonic() + timeout_s
    while procs.probe_shm_of_run(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    return procs.probe_shm_of_run(run_id)


def _run_dir(params) -> Path:
    from decodescope.orchestration.runner import new_run_dir

    return new_run_dir(params)


def test_the_collectives_probe_runs_there_with_torchrun_and_its_files_come_back(sshd, tmp_path, session,
                                                                                  monkeypatch):
    from decodescope.micro import bench as mb

    params = load_params(_write(tmp_path, _params_text(sshd, tmp_path)))
    run_dir = _run_dir(params)
    host = host_for(params)
    session.append(host)
    monkeypatch.setenv(procs.RUN_ID_ENV, run_dir.name)  # as a run's: the ranks there carry it (HOST_RUN_ID)
    coll = mb.run_collectives_probe(params, run_dir)
    assert set(coll["rank"]) == {0, 1} and set(coll["world_size"]) == {2}
    assert {m["backend"] for m in coll.attrs["meta"]} == {"gloo"}
    local = sorted(p.name for p in (run_dir / "data/collectives_ranks").iterdir())
    remote = sorted(p.name for p in Path(host.path(run_dir / "data/collectives_ranks")).iterdir())
    assert local == remote == ["collectives_rank0.json", "collectives_rank1.json"]
    assert "all_to_all" in set(coll["part"])
    assert (run_dir / "logs/collectives_probe.log").stat().st_size > 0
    assert not processes_of("decodescope.probes", tmp_path) and settled_segments(run_dir.name) == []


def test_a_probe_whose_link_drops_while_its_segments_are_made_leaves_none_there(sshd, tmp_path, session,
                                                                               monkeypatch):
    """The ranks there held where their shm segments exist and are not yet unlinked, ignoring SIGTERM (a rank
    stuck in a collective on a busy host), and the link dropped (ssh killed): the host's supervisor stops every
    rank and removes the segments by the probe's token once none is alive. On a host whose vLLM has no shm
    all-reduce (_C_AVX2) the ranks hold at the same point with no segment."""
    from functools import partial

    from decodescope.micro import bench as mb
    from decodescope.probes.communicators import FAULT_HOLD_ENV, FAULT_IGNORE_TERM_ENV

    params = load_params(_write(tmp_path, _params_text(sshd, tmp_path)))
    run_dir = _run_dir(params)
    host = host_for(params)
    session.append(host)
    host.connect()
    monkeypatch.setenv(procs.RUN_ID_ENV, run_dir.name)
    hold = tmp_path / "hold"  # the ssh host is this machine: its markers are seen here
    monkeypatch.setattr(mb, "run_torchrun_probe", partial(mb.run_torchrun_probe, env={
        FAULT_HOLD_ENV: str(hold), FAULT_IGNORE_TERM_ENV: "1"}))
    t, err = _probe_in_thread(params, run_dir)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tmp_path.glob("hold.rank[0-9]"))) < 2:
        time.sleep(0.05)
    markers = sorted(tmp_path.glob("hold.rank[0-9]"))
    assert len(markers) == 2, "the ranks never reached the hold"
    held = sorted({procs.SHM_DIR / n for f in markers for n in json.loads(f.read_text())["segments"]})
    assert all(p.exists() for p in held)  # the window is hit: the segments are there
    ranks = [json.loads(f.read_text())["pid"] for f in markers]
    os.kill(host._master.pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(90)
    assert err and isinstance(err[0], LinkDropped), err
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    shm_left = settled_segments(run_dir.name)
    stop_s = time.monotonic() - t0
    assert left == [] and shm_left == [] and not [p for p in held if p.exists()], (left, shm_left, held)
    record_fault("ssh link dropped while the probe's segments are made (ranks slow to die)",
                 "every rank there stopped by the host's supervisor (SIGKILL after its grace), then the probe's "
                 "segments removed there by its token", rc=1, results_lost="the probe in flight",
                 processes_left=len(left), shm_files_left=len(shm_left), detect_and_stop_s=round(stop_s, 1),
                 segments_held=len(held))


def _probe_in_thread(params, run_dir) -> tuple[threading.Thread, list[BaseException]]:
    """The collectives probe started in a thread; what it raises lands in the list, for the test thread."""
    from decodescope.micro import bench as mb

    err: list[BaseException] = []

    def probe():
        try:
            mb.run_collectives_probe(params, run_dir)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            err.append(e)
    t = threading.Thread(target=probe)
    t.start()
    return t, err


def test_a_probe_whose_link_drops_is_stopped_there_and_says_resume(sshd, tmp_path, session):
    from decodescope.micro import bench as mb

    params = load_params(_write(tmp_path, _params_text(sshd, tmp_path)))
    run_dir = _run_dir(params)
    host = host_for(params)
    session.append(host)
    host.connect()
    t, err = _probe_in_thread(params, run_dir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(processes_of("decodescope.probes.collectives", tmp_path)) < 2:
        time.sleep(0.1)
    ranks = processes_of("decodescope.probes.collectives", tmp_path)
    assert len(ranks) >= 2
    os.kill(host._master.pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(60)
    detect_s = time.monotonic() - t0
    assert err and isinstance(err[0], LinkDropped) and "--resume" in str(err[0])
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert left == []
    t_resume = time.monotonic()
    coll = mb.run_collectives_probe(params, run_dir)  # what --resume does for the phase: the link is back
    recover_s = time.monotonic() - t_resume
    assert set(coll["rank"]) == {0, 1}
    record_fault("ssh link dropped mid-probe (ssh killed during the collectives probe)",
                 "the probe fails naming the dropped link and --resume; every rank there stopped by the host's "
                 "supervisor; --resume measures it again", rc=1, results_lost="the probe in flight",
                 processes_left=len(left), shm_files_left=0, detect_and_stop_s=round(detect_s, 1),
                 recover_s=round(recover_s, 1))


def test_two_hosts_meet_at_a_c10d_rendezvous_one_here_one_through_ssh(sshd, tmp_path, session):
    """Node 0 is this machine (host: local), node 1 is reached through sshd; torchrun's c10d
    rendezvous at the endpoint from params, one gloo rank each."""
    from decodescope.micro import bench as mb

    rdzv = free_port()
    text = _params_text(sshd, tmp_path, url="local", extra_host=f"  nodes: [{sshd.url}]")
    text = text.replace("  all_to_all_tokens: [1, 2]\n", f"  all_to_all_tokens: [1, 2]\n  world_size: 2\n"
                                                         f"  rdzv_endpoint: 127.0.0.1:{rdzv}\n")
    params = load_params(_write(tmp_path, text))
    run_dir = _run_dir(params)
    coll = mb.run_collectives_probe(params, run_dir)
    from decodescope.exec.host import node_hosts

    session.extend(h for h in node_hosts(params) if h.remote)
    assert set(coll["rank"]) == {0, 1} and set(coll["world_size"]) == {2}
    metas = coll.attrs["meta"]
    assert all("span several hosts" in m["communicators_skipped"].get("vllm_shm", "") for m in metas)
    assert (run_dir / "logs/collectives_probe.node0.log").is_file()
    assert (run_dir / "logs/collectives_probe.node1.log").is_file()
    # one rank's file was written on the ssh node and copied back. Which rank: the c10d rendezvous
    # numbers the agents by sorted (host name, pid), not by --node-rank, and both agents share a host here
    there = sorted(Path(node_hosts(params)[1].path(run_dir / "data/collectives_ranks")).glob("collectives_rank*.json"))
    assert len(there) == 1 and there[0].name in ("collectives_rank0.json", "collectives_rank1.json")
    assert there[0].read_bytes() == (run_dir / "data/collectives_ranks" / there[0].name).read_bytes()


# ---- the serving client ---------------------------------------------------------------------------------
@pytest.fixture
def paced_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks/paced_server.py"), "--port", str(port),
                             "--itl-ms", "2", "--log", str(tmp_path / "truth.json")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield port
    proc.terminate()
    proc.wait(timeout=30)


def test_the_load_generator_runs_beside_the_server_and_its_levels_come_back(sshd, tmp_path, session, paced_server):
    from decodescope.orchestration.notebook import PhaseContext
    from decodescope.serving.remote import link_note
    from decodescope.serving.phase import sweep_for_phase

    text = _params_text(sshd, tmp_path, extra_host="  loadgen: remote")
    text = text.replace("server:\n", f"server:\n  mode: attach\n  url: http://127.0.0.1:{paced_server}\n")
    text += ("workload:\n  concurrency: [1, 4]\n  requests_per_level: 8\n  warmup_requests: 1\n  output_tokens: 8\n"
             "  input_tokens: 16\n  telemetry_interval_s: 0\n")
    params = load_params(_write(tmp_path, text))
    run_dir = _run_dir(params)
    session.append(host_for(params))
    requests, levels = sweep_for_phase(PhaseContext(params=params, run_dir=run_dir), progress=False)
    assert sorted(levels["level"]) == [1, 4] and (levels["failed"] == 0).all()
    assert sorted(p.name for p in (run_dir / "data/serving").iterdir()) == ["level_00001.parquet", "level_00004.parquet"]
    assert "serving sweep" in (run_dir / "logs/loadgen.log").read_text()
    link = json.loads((run_dir / "data/link.json").read_text())
    assert link["via_tunnel_p50_ms"] > 0 and link["on_host_p50_ms"] > 0
    assert "ran on root@127.0.0.1" in link_note(run_dir / "data", params)
    # nothing of the load generator is left there
    assert not processes_of("decodescope.serving.remote", tmp_path)


# ---- a run ---------------------------------------------------------------------------------------------
# `decodescope run` over ssh from the CLI (the inventory and the probes there, their files back, the notebooks
# and report here, one ControlMaster for the run, nothing left on either side): asserted on the embedded
# default's whole run over ssh in tests/test_integration_ssh.py
# (test_the_phases_run_over_ssh_from_the_cli_over_one_connection), which runs these phases there too.


def test_an_attached_servers_traces_come_back_from_every_node_and_stay_moved(sshd, tmp_path, session):
    """server.mode attach across nodes: each node's profiler directory (host.trace_dir) is copied into
    traces/node<i>/ while the profile runs; a file appears there only whole (never the half written
    first), a file there before the profile is not copied, and once filed elsewhere here (traces/c<N>/) a
    file does not come back."""
    import gzip

    from decodescope.exec.host import node_traces

    remote_traces = tmp_path / "their_traces"
    remote_traces.mkdir()
    text = _params_text(sshd, tmp_path, extra_host=f"  trace_dir: {remote_traces}\n  nodes: [{sshd.url}]\n"
                                                   f"  sync_interval_s: 0.3")
    text = text.replace("server:\n", "server:\n  mode: attach\n  url: http://127.0.0.1:9\n")
    text = text.replace("  all_to_all_tokens: [1, 2]\n", "  all_to_all_tokens: [1, 2]\n  rdzv_endpoint: 127.0.0.1:29999\n")
    params = load_params(_write(tmp_path, text))
    run_dir = _run_dir(params)
    session.append(host_for(params))
    trace_dir = run_dir / "traces"
    whole = gzip.compress(b'{"traceEvents": []}' * 1000)
    (remote_traces / "earlier.pt.trace.json.gz").write_bytes(whole)  # another profile's, before this one
    with node_traces(params, trace_dir):
        (remote_traces / "rank0.pt.trace.json.gz").write_bytes(whole[: len(whole) // 2])  # still being written
        seen_partial = []
        for _ in range(10):  # several syncs (0.3 s apart) while the file is half written
            time.sleep(0.1)
            seen_partial += [p for p in trace_dir.rglob("rank0*") if p.read_bytes() != whole]
        (remote_traces / "rank0.pt.trace.json.gz").write_bytes(whole)
        # a copy every 0.3 s over ssh: the whole file arrives within a few of them, later on a loaded host
        # (a fixed 1.5 s wait failed once under a full suite on two cores)
        copies = [trace_dir / node / "rank0.pt.trace.json.gz" for node in ("node0", "node1")]
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and not all(c.is_file() and c.read_bytes() == whole for c in copies):
            time.sleep(0.2)
        for copy in copies:
            assert copy.read_bytes() == whole
        filed = trace_dir / "c1"
        filed.mkdir()
        (trace_dir / "node0" / "rank0.pt.trace.json.gz").rename(filed / "rank0.pt.trace.json.gz")
    # the block's end syncs once more, after the move: a file it could bring back would be back now
    assert not (trace_dir / "node0" / "rank0.pt.trace.json.gz").exists()
    assert (filed / "rank0.pt.trace.json.gz").read_bytes() == whole
    assert seen_partial == [] and not list(trace_dir.rglob("earlier*"))


def test_start_for_params_on_an_ssh_host_pushes_the_model_and_records_the_link(sshd, tmp_path, session):
    """The server phase's own entry point with an ssh host (a stand-in server behind server.python):
    the dummy-weights model dir built here is copied there, the profiler directory is the run's traces/
    there, the tunnel's added latency is measured (data/link.json) and server.json says where it runs."""
    from decodescope.exec.runserver import start_for_params

    python = tmp_path / "server-python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
                      f'exec {sys.executable} {FAKE_SERVER} "$@"\n')
    python.chmod(0o755)
    port = free_port()
    text = _params_text(sshd, tmp_path).replace("server:\n", f"server:\n  python: {python}\n  port: {port}\n"
                                                              "  api_key: sk-fake-1111\n")
    params = load_params(_write(tmp_path, text))
    run_dir = _run_dir(params)
    session.append(host_for(params))
    server = start_for_params(params, run_dir, profiler_dir=run_dir / "traces")
    try:
        info = json.loads((run_dir / "data/server.json").read_text())
        assert info["pid"] is None and info["host"] == sshd.url.removeprefix("ssh://") and info["host_pid"]
        assert info["base_url"] == server.base_url != f"http://127.0.0.1:{port}"
        link = json.loads((run_dir / "data/link.json").read_text())
        assert link["added_p50_ms"] is not None
        argv = server.spec.argv
        model = argv[argv.index("--model") + 1]
        assert model.startswith(str(tmp_path / "remote")) and (Path(model) / "tokenizer.json").is_file()
        assert str(tmp_path / "remote" / run_dir.name / "traces") in " ".join(argv)  # the profiler writes there
        assert "sk-fake-1111" not in " ".join(argv)
    finally:
        server.stop()
    assert token_processes(server.run_token) == []
