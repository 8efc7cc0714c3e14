"""Faults injected for real against the real vLLM CPU server of the embedded default (and real disks).

For each fault the test asserts what decodescope guarantees: finished results kept byte-identical, no
process of the run left (walked in /proc by process group, by the server's run token and by the run id),
no /dev/shm file of its servers left, the manifest telling the truth, and the documented exit status.
Each test also records what it measured in outputs/fault_table.json, from which the README's fault
table is made (benchmarks/fault_table.py).
"""
from __future__ import annotations

import contextlib
import getpass
import hashlib
from datetime import datetime
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import psutil
import pytest

from decodescope.exec import privatedirs, procs
from decodescope.cli.main import EXIT_BAD_INPUT, EXIT_PHASE_FAILED, EXIT_SIGINT, EXIT_SIGTERM, EXIT_WRITE_FAILED
from decodescope.schema.params import PHASES, load_params
from decodescope.core.phases import execution_order
from decodescope.exec.hostcore import RUN_ID_ENV
from decodescope.exec.server import port_is_free
from decodescope.probes.communicators import FAULT_HOLD_ENV, FAULT_IGNORE_TERM_ENV
from tests.faultload import FAULT_LOAD, busy_host, record_fault
from tests.test_integration_vllm import DECODESCOPE, _params

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def shm_files_of(idents) -> list[Path]:
    """The files under /dev/shm whose names hold one of idents (procs.shm_idents): what a run left there."""
    idents = set(idents)
    if not idents:
        return []
    try:
        return sorted(p for p in procs.SHM_DIR.iterdir() if any(i in p.name for i in idents))
    except OSError:
        return []


# ---- running decodescope as a user would ------------------------------------------------------------
class Run:
    """`decodescope run` in its own process group (as a terminal's job), output to files."""

    def __init__(self, tmp: Path, params: Path, *args: str, label: str = "run", sigint_ignored: bool = False,
                 env: dict | None = None):
        """sigint_ignored: started with SIGINT ignored, as a shell script's background job is
        (`decodescope run ... &`); the run must still stop on it. env: added to this process's environment."""
        self.tmp, self.params = tmp, params
        self.out = tmp / f"{label}.stdout"
        self.err = tmp / f"{label}.stderr"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(DECODESCOPE + ["run", str(params), *args], cwd=REPO, stdout=o, stderr=e,
                                         text=True, start_new_session=True, env={**os.environ, **(env or {})},
                                         preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                                         if sigint_ignored else None)
        self.t0 = time.monotonic()

    def wait(self, timeout: float = 900) -> int:
        """The exit status; a run still going after `timeout` is stopped (SIGTERM, then SIGKILL to its
        group) so a failing test leaves nothing running, and the test fails."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            pytest.fail(f"decodescope run did not end within {timeout:.0f} s; stderr:\n{self.stderr[-3000:]}")

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def run_dir(self, timeout: float = 120) -> Path:
        out = load_params(self.params).output_root()
        name = load_params(self.params).run_name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = sorted(out.glob(f"*-{name}/manifest.json"))
            if found:
                return found[-1].parent
            if self.proc.poll() is not None:
                pytest.fail(f"run ended before making its run directory: {self.stderr[-3000:]}")
            time.sleep(0.2)
        pytest.fail("no run directory appeared")


def manifest(run_dir: Path) -> dict:
    for _ in range(50):
        try:
            return json.loads((run_dir / "manifest.json").read_text())
        except json.JSONDecodeError:  # never half-written (atomic), but a reader may race the rename
            time.sleep(0.05)
    raise AssertionError("manifest.json unreadable")


def wait_until(predicate, timeout: float, what: str, run: Run | None = None, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            pytest.fail(f"run ended (rc {run.proc.returncode}) before {what}: {run.stderr[-3000:]}")
        time.sleep(poll_s)
    pytest.fail(f"timed out waiting for {what}")


def phase_running(run_dir: Path, phase: str) -> bool:
    return manifest(run_dir)["phases"].get(phase, {}).get("status") == "running"


def server_up(run_dir: Path) -> dict | None:
    info = run_dir / "data" / "server.json"
    if info.is_file() and (manifest(run_dir).get("server") or {}).get("status") == "up":
        return json.loads(info.read_text())
    return None


def leftovers(run_dir: Path) -> tuple[list[int], list[Path]]:
    """Processes of the run still alive (by server process group, server token, run id), and /dev/shm
    files and IPC socket folders of its servers still there."""
    m = manifest(run_dir)
    servers = m.get("servers", [])
    pids = set(procs.run_processes(run_dir.name, env_name=RUN_ID_ENV))
    for s in servers:
        pids |= set(procs.run_processes(s.get("run_token"), [s.get("pgid")]))
    idents = procs.shm_idents(Path(f) for s in servers for f in s.get("shm_files", []))
    # and the segments of its probes, by the run's own key in their names (procs.probe_shm_name)
    files = set(shm_files_of(idents)) | set(procs.probe_shm_of_run(run_dir.name))
    return sorted(pids), sorted(files | set(tmp_dirs_left(servers, tempfile.gettempdir())))


def tmp_dirs_left(servers: list[dict], tmp_dir: str) -> list[Path]:
    """The servers' IPC socket folders (serverlaunch.launch_spec) still there."""
    tokens = [s["run_token"] for s in servers if s.get("run_token")]
    return [Path(d) for d in (privatedirs.server_tmp_dir(t, tmp_dir) for t in tokens) if os.path.exists(d)]


def settled(probe: Callable[[], tuple[list, ...]], timeout_s: float = 20) -> tuple[list, ...]:
    """probe()'s lists of what a teardown left (processes, shm files) once all are empty, or as they are after
    timeout_s, left for good. Polled rather than looked at after a fixed 0.5 s: on CI's loaded 2-core machine
    the last processes of a torn-down tree can take longer to be reaped."""
    deadline = time.monotonic() + timeout_s
    left = probe()
    while any(left) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = probe()
    return left


def left_after_teardown(run_dir: Path) -> tuple[list[int], list[Path]]:
    """What of the run is left here once its teardown has had time to finish."""
    pids, shm = settled(lambda: leftovers(run_dir))
    return pids, shm


def assert_nothing_left(run_dir: Path) -> tuple[int, int]:
    pids, shm = left_after_teardown(run_dir)
    assert pids == [], f"processes of the run left: {pids}"
    assert shm == [], f"shared-memory files or socket folders left: {shm}"
    return len(pids), len(shm)


def digests(paths) -> dict[str, str]:
    return {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text[-4000:]


# A fault test asserts exit statuses, the manifest, kept files and what is left running, not what the phases
# measured: where it runs phases through to the end, a small workload of each (fewer requests, one profiled
# level, two GEMM batches in one dtype, the collective sweep to 64 KiB, no skew check) keeps the phases and their files as
# the embedded default has them, at a fraction of the time (issue 25: make test within 20 minutes).
# the micro-benchmarks' part of SMALL (02 and 03), which test_attach takes alone
SMALL_MICRO = ("  batches: [1, 2, 4, 8]\n  dtypes: [bf16, fp32]\n  iterations: 10\n  warmup: 3\n",
               "  batches: [1, 2]\n  dtypes: [bf16]\n  iterations: 5\n  warmup: 2\n  sweep_max_bytes: 65536\n"
               "  all_to_all_tokens: [1, 2]\n  skew_calibration_us: []\n")
SMALL = {"requests_per_level: 24": "requests_per_level: 8",
         SMALL_MICRO[0]: SMALL_MICRO[1],
         "  requests: 12\n": "  requests: 6\n",
         "  concurrency: [1, knee]\n": "  concurrency: [1]\n"}


# The fault tests' servers keep the embedded default's engine arguments. Not eager: vLLM CPU 0.32's _C_AVX2
# (AVX2-only hosts, or --cpu-path=avx2) at tensor-parallel 2 with --enforce-eager dies on the first request
# (IndexError in the vocab-parallel embedding's F.embedding), seen on every eager server of a forced-AVX2 suite.


def fault_params(tmp: Path, port: int, name: str, replace: dict | None = None, small: bool = False) -> Path:
    """The embedded default's params for one fault test (its own port and run name), with
    `replace`'s edits, and with `small`, the SMALL workload where `replace` leaves the text as it was."""
    path = _params(REPO, tmp, port, name=name)
    text = path.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    for old, new in (SMALL if small else {}).items():
        if old in text:
            text = text.replace(old, new)
    path.write_text(text)
    return path


# ---- the server dies ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_mid_sweep(tmp_path_factory) -> dict:
    """One run directory through four faults, each on a server of its own, and what each step saw, for
    the tests below: a run of 00 and 01 is stopped by SIGTERM after level 1; its --resume's API server is
    SIGKILLed after level 2; while the next --resume of 01 and 04 runs (and holds the port), a second run
    of the same params is started (two runs at once, on a run that already holds the port, with no server
    start of its own); that resume finishes the sweep, and its API server is SIGKILLed once 04's profile
    has started (one server start fewer than a run of 04 for that fault alone)."""
    tmp = tmp_path_factory.mktemp("killsweep")
    params = fault_params(tmp, 8801, "killsweep", {"concurrency: [1, 2, 4]": "concurrency: [1, 2, 4, 8]",
                                                   "  requests: 12\n": "  requests: 24\n"})
    term = Run(tmp, params, "--phases", "00_host", "01_serving", label="sigterm")
    run_dir = term.run_dir()
    level1 = run_dir / "data/serving/level_00001.parquet"
    wait_until(level1.is_file, 900, "level 1", term)
    term_kept = digests([level1, run_dir / "data/host.json"])
    os.kill(term.proc.pid, signal.SIGTERM)  # to the runner only, as a scheduler's kill does
    t_term = time.monotonic()
    term_rc = term.wait(300)
    out = {"run_dir": run_dir, "term_rc": term_rc, "term_stop_s": time.monotonic() - t_term,
           "term_stderr": term.stderr, "term_manifest": manifest(run_dir), "term_kept": term_kept,
           "levels_after_term": {int(f.stem.split("_")[1]): int((~pd.read_parquet(f)["warmup"]).sum())
                                 for f in sorted((run_dir / "data/serving").glob("level_*.parquet"))}}
    out.update(term_left=left_after_teardown(run_dir), term_kept_after=digests(term_kept))  # as assert_nothing_left

    run = Run(tmp, params, "--resume", str(run_dir), "--phases", "01_serving")
    # the first level this resume measures (level 2, unless the stop let it finish: test_sigterm says so), and
    # its own server's pid: server.json names the SIGTERMed run's server until this run's is healthy
    first_new = next(p for p in (run_dir / f"data/serving/level_0000{n}.parquet" for n in (2, 4, 8)) if not p.exists())
    wait_until(first_new.is_file, 600, f"{first_new.name} of the sweep", run)
    wait_until(lambda: json.loads((run_dir / "data/server.json").read_text()).get("owner_pid") == run.proc.pid, 60,
               "the resume's own server in server.json", run)
    kept = digests(sorted((run_dir / "data/serving").glob("level_*.parquet")))
    info = json.loads((run_dir / "data/server.json").read_text())
    own_tmp = Path(privatedirs.server_tmp_dir(info["run_token"], tempfile.gettempdir()))
    out["own_tmp_while_up"] = {p.name: p.is_socket() for p in own_tmp.iterdir()}
    out["links_while_up"] = {p.name: os.readlink(p) for p in own_tmp.iterdir() if p.is_symlink()}
    os.kill(info["pid"], signal.SIGKILL)  # the API server only: its engine core and workers stay up
    t_kill = time.monotonic()
    rc = run.wait(300)
    detect_s = time.monotonic() - t_kill
    left = left_after_teardown(run_dir)  # polled, not after a fixed 0.5 s: CI's loaded 2-core machine
    out.update(kept=kept, rc=rc, stderr=run.stderr, detect_s=detect_s,
               manifest=manifest(run_dir), left=left, port_free=port_is_free("127.0.0.1", 8801),
               kept_after_kill=digests(kept))

    t_resume = time.monotonic()
    resumed = Run(tmp, params, "--resume", str(run_dir), "--phases", "01_serving", "04_profile", label="resume")
    # the port is locked for the run's whole life: once its phase runs, a second run must be refused
    wait_until(lambda: phase_running(run_dir, "01_serving"), 600, "the resumed sweep", resumed)
    second = Run(tmp, params, "--phases", "01_serving", label="second")
    out["second_rc"] = second.wait(120)
    out.update(second_s=time.monotonic() - second.t0, second_stderr=second.stderr, first_pid=resumed.proc.pid,
               run_dirs=len(list(run_dir.parent.glob("*-killsweep"))))
    log = run_dir / "logs/server.log"
    wait_until(lambda: "POST /start_profile HTTP" in log.read_text(errors="replace"), 900, "the profile to start",
               resumed)
    out["recover_s"] = time.monotonic() - t_resume  # the sweep finished: 04 runs after it
    os.kill(json.loads((run_dir / "data/server.json").read_text())["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    out["resume_rc"] = resumed.wait(900)
    profile_detect_s = time.monotonic() - t_kill
    resume_left = left_after_teardown(run_dir)  # polled, not after a fixed 0.5 s: CI's loaded 2-core machine
    out.update(resume_stderr=resumed.stderr, profile_detect_s=profile_detect_s,
               resume_manifest=manifest(run_dir), resume_left=resume_left)
    return out


def test_server_killed_mid_sweep_fails_the_phase_tears_down_and_resume_remeasures(killed_mid_sweep):
    k = killed_mid_sweep
    run_dir, kept = k["run_dir"], k["kept"]
    assert k["rc"] == EXIT_PHASE_FAILED, k["stderr"][-3000:]
    m = k["manifest"]
    assert m["status"] == "failed"
    assert m["phases"]["01_serving"]["status"] == "failed"
    assert "server_died" in m["phases"]["01_serving"]["error"]
    assert k["left"] == ([], []), f"processes and shared-memory files of the run left: {k['left']}"
    # vLLM made its temporary files in the server's own folder: its ZMQ sockets and its workers' init file
    # (on the gloo path no shm segment names that file, which the teardown once found it by); a killed API
    # server removes none of them, and the teardown removed the folder (leftovers: tmp_dirs_left)
    made = k["own_tmp_while_up"]
    assert sum(made.values()) >= 3 and any(n.startswith("vllm_dist_") for n, sock in made.items() if not sock), made
    # ... but not inductor's compile cache, which would go with it: its folder there links to the one a server
    # with the default TMPDIR uses, which the teardown left, so the next start reuses what this one compiled
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    inductor = f"torchinductor_{user}"
    assert k["links_while_up"] == {inductor: os.path.join(tempfile.gettempdir(), inductor)}, made
    assert Path(tempfile.gettempdir(), inductor).is_dir()
    assert k["kept_after_kill"] == kept
    assert k["port_free"]

    assert k["resume_manifest"]["phases"]["01_serving"]["status"] == "ok", k["resume_stderr"][-3000:]
    assert digests(kept) == kept  # finished levels were not measured again
    import pandas as pd

    levels = pd.read_parquet(run_dir / "data/serving_levels.parquet").set_index("level")
    assert sorted(levels.index) == [1, 2, 4, 8]
    assert (levels["failed"] == 0).all(), levels["failed"]
    assert k["resume_left"] == ([], [])
    assert_nothing_left(run_dir)
    record_fault("server killed mid-sweep (SIGKILL to the API server)",
                 "phase and run fail with server_died and the log tail; engine core and workers torn down; "
                 "finished levels kept; --resume re-measures the levels the dead server spoiled",
                 rc=k["rc"], results_lost="none (levels 1, 2 byte-identical)", processes_left=0,
                 shm_files_left=0, detect_and_stop_s=round(k["detect_s"], 1), recover_s=round(k["recover_s"], 1))


def test_server_killed_mid_profile_fails_the_phase_and_tears_down(killed_mid_sweep):
    """killed_mid_sweep's last resume: its API server SIGKILLed once 04's profile has started."""
    k = killed_mid_sweep
    assert k["resume_rc"] == EXIT_PHASE_FAILED, k["resume_stderr"][-3000:]
    m = k["resume_manifest"]
    assert m["phases"]["04_profile"]["status"] == "failed"
    assert "server_died" in m["phases"]["04_profile"]["error"]
    assert k["resume_left"] == ([], []), f"processes and shared-memory files of the run left: {k['resume_left']}"
    record_fault("server killed mid-profile", "phase fails with server_died; every server process and shm "
                 "file removed", rc=k["resume_rc"], results_lost="none (the capture had not finished)",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(k["profile_detect_s"], 1))


def test_server_never_healthy_fails_its_phases_within_the_startup_timeout(tmp_path):
    params = fault_params(tmp_path, 8803, "neverup", {"startup_timeout_s: 600": "startup_timeout_s: 8"})
    run = Run(tmp_path, params, "--phases", "01_serving")
    rc = run.wait(300)
    wall_s = time.monotonic() - run.t0
    run_dir = run.run_dir()
    assert rc == EXIT_PHASE_FAILED
    m = manifest(run_dir)
    assert "did not become healthy within 8 s" in m["phases"]["01_serving"]["error"]
    n_procs, n_shm = assert_nothing_left(run_dir)
    no_traceback(run.stderr)
    record_fault("server never healthy", "phase fails after server.startup_timeout_s with the log tail; the "
                 "half-started server torn down", rc=rc, results_lost="none", processes_left=n_procs,
                 shm_files_left=n_shm, detect_and_stop_s=round(wall_s, 1))


def test_port_taken_is_refused_before_launch(tmp_path):
    params = fault_params(tmp_path, 8804, "porttaken")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 8804))
        s.listen()
        run = Run(tmp_path, params, "--phases", "01_serving")
        rc = run.wait(300)
    wall_s = time.monotonic() - run.t0
    run_dir = run.run_dir()
    assert rc == EXIT_PHASE_FAILED
    assert "already in use" in manifest(run_dir)["phases"]["01_serving"]["error"]
    assert manifest(run_dir).get("servers", []) == []  # nothing was launched
    n_procs, n_shm = assert_nothing_left(run_dir)
    record_fault("port taken by another program", "clear error before launch", rc=rc, results_lost="none",
                 processes_left=n_procs, shm_files_left=n_shm, detect_and_stop_s=round(wall_s, 1))


def _worker_pid(server, tp_rank: int) -> int:
    import psutil

    for pid in server.process_tree():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if f"Worker_TP{tp_rank}" in " ".join([p.name()] + p.cmdline()):
                return pid
    raise AssertionError(f"no Worker_TP{tp_rank} among {server.process_tree()}")


def test_stop_profile_that_never_completes_keeps_the_traces_that_arrived(tmp_path):
    """Rank 1's worker hangs (SIGSTOP) just before /stop_profile: rank 0 writes its trace, the server
    never answers; the capture reports the missing rank and rank 0 is still analysed. The flush timeout is
    10 s: the capture waits it twice (for /stop_profile, then for the traces), and rank 0's trace of this
    small workload is whole ~3 s after /stop_profile here (20 s a wait was 40 s of the test's ~96 s)."""
    from decodescope.exec.runserver import start_for_params
    from decodescope.profiling.capture import capture_profile
    from decodescope.trace.load import load_trace_dir
    from decodescope.trace.profile import analyze_traces

    params = load_params(fault_params(tmp_path, 8805, "stopprof", {"flush_timeout_s: 600": "flush_timeout_s: 10"},
                                      small=True))
    trace_dir = tmp_path / "run/traces"
    server = start_for_params(params, tmp_path / "run", profiler_dir=trace_dir)
    shm_files = set(server.shm_files)
    stalled = {}

    class StallRank1:
        """The real server, with rank 1's worker stopped right before /stop_profile."""

        def __getattr__(self, name):
            return getattr(server, name)

        def stop_profile(self, timeout_s):
            stalled["pid"] = _worker_pid(server, 1)
            os.kill(stalled["pid"], signal.SIGSTOP)
            return server.stop_profile(timeout_s)

    try:
        t0 = time.monotonic()
        result = capture_profile(StallRank1(), params, trace_dir)
        detect_s = time.monotonic() - t0 - result.start_profile_s - result.workload_s
    finally:
        server.stop()  # the stopped worker too (SIGKILL after the grace period)
    assert result.problems and "/stop_profile" in result.problems[0]
    assert len(result.rank_files) == 1 and "rank0" in result.rank_files[0].name
    loaded = load_trace_dir(trace_dir)
    analysed = analyze_traces(loaded, params.model_config_dict(), params.server.tensor_parallel)
    assert sorted(analysed.ops["rank"].unique()) == [0]
    assert not analysed.breakdown.empty
    left = procs.run_processes(server.run_token, [server.pgid])
    shm_left = shm_files_of(procs.shm_idents(shm_files))
    assert left == [] and shm_left == []
    with pytest.raises(Exception, match="stop_profile"):
        result.raise_if_incomplete()
    record_fault("/stop_profile never completes (a TP worker hangs)", "the traces that arrived are analysed; "
                 "the phase then fails naming the missing ranks; the hung worker is killed",
                 rc=EXIT_PHASE_FAILED, results_lost="rank 1's trace (never written)", processes_left=len(left),
                 shm_files_left=len(shm_left), detect_and_stop_s=round(detect_s, 1))


def test_truncated_and_corrupt_traces_are_named_and_the_good_ranks_analysed(tmp_path, cpu_traces):
    import shutil

    traces = tmp_path / "traces"
    shutil.copytree(cpu_traces, traces)
    files = sorted(traces.glob("*.gz"))
    assert len(files) == 2
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # truncated mid-stream
    (traces / "rank9.pt.trace.json.gz").write_bytes(b"not a trace at all")  # corrupt
    t0 = time.monotonic()
    proc = subprocess.run(DECODESCOPE + ["analyze-trace", str(traces), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert files[1].name in proc.stderr and "rank9" in proc.stderr
    summary = json.loads((tmp_path / "out/profile_summary.json").read_text())
    assert summary["ranks"] == [0]
    no_traceback(proc.stderr)
    record_fault("truncated or corrupt trace files", "each bad file named; the good ranks analysed", rc=0,
                 results_lost="the bad files only", processes_left=0, shm_files_left=0,
                 detect_and_stop_s=round(wall_s, 1))


# ---- the disk fills up --------------------------------------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> None:
    with contextlib.suppress(OSError), open(directory / "filler", "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * (1 << 16))


def _disk_params(tmp: Path, out: Path, name: str) -> Path:
    p = fault_params(tmp, 8809, name)
    p.write_text(p.read_text().replace(f"output_dir: {tmp / 'out'}", f"output_dir: {out}"))
    return p


def _assert_clean_write_failure(run: Run, run_dir: Path | None, rc: int) -> None:
    assert rc == EXIT_WRITE_FAILED, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not write" in errors[0] and "Errno 28" in errors[0], run.stderr[-3000:]
    no_traceback(run.stderr)
    if run_dir is not None:
        assert not list(run_dir.rglob(".*.tmp")), "half-written files left"


def test_disk_full_during_a_phase_keeps_the_finished_phases_and_says_failed(tmp_path):
    with tmpfs(tmp_path / "disk", "64m") as disk:
        run = Run(tmp_path, _disk_params(tmp_path, disk, "diskphase"), "--phases", "00_host", "02_gemm")
        run_dir = run.run_dir()
        wait_until(lambda: manifest(run_dir)["phases"]["00_host"]["status"] == "ok", 300, "00_host ok", run)
        kept = digests([run_dir / "data/host.json", run_dir / "notebooks/00_host.ipynb"])
        # the run is paused while the disk fills, so the filler does not take the space that the run
        # frees for its last manifest write
        os.killpg(run.proc.pid, signal.SIGSTOP)
        try:
            _fill(disk)
        finally:
            os.killpg(run.proc.pid, signal.SIGCONT)
        rc = run.wait(600)
        _assert_clean_write_failure(run, run_dir, rc)
        m = manifest(run_dir)
        assert m["status"] == "failed" and m["phases"]["00_host"]["status"] == "ok"
        assert m["phases"]["02_gemm"]["status"] in ("failed", "running")
        assert digests(kept) == kept
    record_fault("disk full during a phase", "finished phases kept; one error line naming path and errno; "
                 "manifest says failed (space reserved for it)", rc=rc, results_lost="the phase in flight",
                 processes_left=0, shm_files_left=0)


def test_disk_full_at_the_manifest_ends_with_one_line_and_a_readable_manifest(tmp_path):
    with tmpfs(tmp_path / "disk", "160k") as disk:
        run = Run(tmp_path, _disk_params(tmp_path, disk, "diskmanifest"), "--phases", "00_host")
        rc = run.wait(600)
        run_dirs = list(disk.glob("*-diskmanifest"))
        run_dir = run_dirs[0] if run_dirs else None
        _assert_clean_write_failure(run, run_dir, rc)
        if run_dir is not None and (run_dir / "manifest.json").is_file():
            assert manifest(run_dir)["status"] == "failed"
    record_fault("disk full at the manifest", "one error line naming path and errno (exit 3); the manifest is "
                 "whole and says failed", rc=rc, results_lost="the phase in flight", processes_left=0,
                 shm_files_left=0)


def test_disk_full_at_the_report_says_failed_and_leaves_no_report(tmp_path):
    with tmpfs(tmp_path / "disk", "3m") as disk:
        run = Run(tmp_path, _disk_params(tmp_path, disk, "diskreport"), "--phases", "00_host")
        rc = run.wait(600)
        run_dir = run.run_dir()
        _assert_clean_write_failure(run, run_dir, rc)
        m = manifest(run_dir)
        assert m["phases"]["00_host"]["status"] == "ok"
        assert m["status"] == "failed" and m["error"].startswith("report:")
        assert not (run_dir / "report.html").exists()
        assert (run_dir / "data/host.json").is_file()
    record_fault("disk full at the report", "phases kept; no report.html; manifest says failed with the "
                 "report's error", rc=rc, results_lost="the report only", processes_left=0, shm_files_left=0)


# ---- interruptions and concurrency --------------------------------------------------------------
def test_ctrl_c_in_every_phase_keeps_what_finished_and_leaves_nothing_running(tmp_path):
    """One run interrupted once in each phase, resumed after each interrupt: every interrupt exits 130
    with no traceback, the phases already ok keep their files byte-identical, nothing is left running
    and the port is free. Each run starts with SIGINT ignored, as a shell script's background job does
    (`decodescope run ... &`): the run must still stop on it (this covers the interrupt once the server
    is up, which test_integration_vllm.py ran as a run of its own)."""
    params = fault_params(tmp_path, 8806, "ctrlc", small=True)
    run_dir, kept, times = None, {}, {}
    for phase in execution_order(list(PHASES)):
        args = ("--resume", str(run_dir)) if run_dir else ()
        run = Run(tmp_path, params, *args, label=f"ctrlc-{phase}", sigint_ignored=True)
        run_dir = run_dir or run.run_dir()
        wait_until(lambda: phase_running(run_dir, phase), 900, f"{phase} to run", run)
        if phase in ("01_serving", "04_profile"):
            wait_until(lambda: (run_dir / "logs/server.log").is_file() and
                       "POST /v1/completions" in (run_dir / "logs/server.log").read_text(errors="replace"),
                       300, "requests to reach the server", run)
            up = server_up(run_dir)
            assert up and psutil.pid_exists(up["pid"]), "the server is up and running when Ctrl-C comes"
        else:
            time.sleep(1.0)
        os.killpg(run.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t_int = time.monotonic()
        rc = run.wait(300)
        times[phase] = round(time.monotonic() - t_int, 1)
        assert rc == EXIT_SIGINT, (phase, run.stderr[-3000:])
        no_traceback(run.stderr)
        m = manifest(run_dir)
        assert m["status"] == "interrupted"
        assert m["phases"][phase]["status"] == "failed" and "interrupted" in m["phases"][phase]["error"]
        assert digests(kept) == kept, phase
        assert_nothing_left(run_dir)
        assert port_is_free("127.0.0.1", 8806), phase
        # what this resume will keep: the files of every phase that is ok by now
        # (files the interrupted phase wrote before the interrupt are its own: the resume may redo them)
        started = datetime.fromisoformat(m["phases"][phase]["start"].replace("Z", "+00:00")).timestamp()
        kept = digests(p for p in (run_dir / "data").rglob("*") if p.is_file() and p.name not in (
            "server.json",) and not p.name.startswith("profile_") and "serving" not in p.name
            and p.stat().st_mtime < started)
    final = Run(tmp_path, params, "--resume", str(run_dir), label="ctrlc-final")
    assert final.wait(1500) == 0, final.stderr[-3000:]
    assert manifest(run_dir)["status"] == "ok"
    assert_nothing_left(run_dir)
    record_fault("Ctrl-C in each phase", "exit 130, manifest interrupted, earlier phases' files byte-identical, "
                 "no traceback; --resume finishes the run", rc=EXIT_SIGINT, results_lost="the phase in flight",
                 processes_left=0, shm_files_left=0,
                 detect_and_stop_s=max(times.values()), stop_s_per_phase=times)


def test_two_runs_at_once_the_second_says_who_holds_the_port(killed_mid_sweep):
    """The second run starts while the first (killed_mid_sweep's resume) holds the port and its run
    directory, sweeping: it exits 2 before making anything, naming that run; the first is untouched."""
    k = killed_mid_sweep
    run_dir = k["run_dir"]
    assert k["second_rc"] == EXIT_BAD_INPUT, k["second_stderr"]
    assert f"pid {k['first_pid']}" in k["second_stderr"] and str(run_dir) in k["second_stderr"], k["second_stderr"]
    assert k["run_dirs"] == 1  # the second run made nothing
    assert k["resume_manifest"]["phases"]["01_serving"]["status"] == "ok", k["resume_stderr"][-3000:]
    assert k["resume_left"] == ([], [])
    record_fault("two runs at once on one port", "the second exits 2 before making anything, naming the run "
                 "that holds the port; the first is untouched", rc=k["second_rc"], results_lost="none",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(k["second_s"], 1))


def test_sigterm_from_a_scheduler_stops_the_run_like_ctrl_c(killed_mid_sweep):
    """killed_mid_sweep's first run, SIGTERMed after level 1 of its sweep."""
    k = killed_mid_sweep
    assert k["term_rc"] == EXIT_SIGTERM, k["term_stderr"][-3000:]
    no_traceback(k["term_stderr"])
    m = k["term_manifest"]
    assert m["status"] == "interrupted" and "SIGTERM" in m["phases"]["01_serving"]["error"]
    assert k["term_kept_after"] == k["term_kept"]
    # stopped mid-sweep, and no level written in part: the level in flight when the stop landed is whole (it
    # ended before the runner saw the signal: 24 requests of 32 tokens take ~1.5 s at concurrency 2 on the native
    # path, about as long as a SIGTERM takes to stop the kernel) or absent
    assert 8 not in k["levels_after_term"], k["levels_after_term"]
    assert set(k["levels_after_term"].values()) == {24}, k["levels_after_term"]
    assert k["term_left"] == ([], []), f"processes and shared-memory files of the run left: {k['term_left']}"
    record_fault("SIGTERM from a scheduler", "exit 143, manifest interrupted, finished levels kept, every "
                 "process (kernel, server, workers) stopped", rc=k["term_rc"], results_lost="the level in flight",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(k["term_stop_s"], 1))


# ---- a probe interrupted while its segments are made, held and removed ----------------------------------
def _probe_procs(run_dir: Path, agent: bool) -> list[int]:
    """This run's collectives probe: its torchrun agent (agent) or its ranks, by their command lines (the
    plan's path is in the run directory)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "decodescope.probes.collectives" in cmd and str(run_dir) in cmd and \
                ("torch.distributed.run" in cmd) == agent:
            out.append(p.pid)
    return out


def _rank_file_has(run_dir: Path, part: str) -> bool:
    f = run_dir / "data/collectives_ranks/collectives_rank0.json"
    with contextlib.suppress(OSError, ValueError):
        return any(r.get("part") == part for r in json.loads(f.read_text()).get("rows", []))
    return False


# Where the signal lands in 03 (the collectives probe), chosen to cover where its processes and segments are
# made and released, not one fixed delay: the agent started and no rank yet; the ranks' segments made and not yet
# unlinked (the ranks held there by the fault hook, probes/communicators.py), dying at once or ignoring SIGTERM as
# a rank stuck in a collective on a busy host does (the leak of issue 55: the kernel that launched them is killed
# by jupyter 5 s after the interrupt, before its own sweep); the names removed and the sweep measuring; the last
# part done, the ranks tearing down their process group.
PROBE_POINTS = {
    "agent_started": lambda run_dir, hold: bool(_probe_procs(run_dir, agent=True)),
    "segments_held": lambda run_dir, hold: len(list(hold.parent.glob(hold.name + ".rank[0-9]"))) == 2,
    "segments_held_slow_to_die": lambda run_dir, hold: len(list(hold.parent.glob(hold.name + ".rank[0-9]"))) == 2,
    "measuring": lambda run_dir, hold: _rank_file_has(run_dir, "burst"),
    "tearing_down": lambda run_dir, hold: _rank_file_has(run_dir, "all_to_all"),
}
PROBE_CASES = [(point, "SIGTERM") for point in PROBE_POINTS] + [("segments_held_slow_to_die", "SIGINT"),
                                                                 ("measuring", "SIGINT")]


@pytest.mark.parametrize("load", ["quiet", "loaded"])
@pytest.mark.parametrize("point,sig", PROBE_CASES)
def test_an_interrupted_probe_leaves_no_segment_whenever_the_signal_lands(tmp_path, point, sig, load):
    """`decodescope run --phases 03_collectives` stopped by SIGTERM (to the runner, as a scheduler's kill) or
    Ctrl-C (SIGINT to its process group) at each point of PROBE_POINTS, on a quiet host and beside one busy loop
    a core: exit 143 / 130, the manifest says interrupted, no process of the run left and no segment of its
    probe (by the run's key in their names) left in /dev/shm. Where the ranks were held with their segments
    made, those segments were there when the signal landed (the window was hit, not missed)."""
    if FAULT_LOAD and load == "quiet":
        pytest.skip("DECODESCOPE_FAULT_LOAD=1 runs every test loaded; this case is the quiet one")
    params = fault_params(tmp_path, 8811, "probeint", small=True)
    hold = tmp_path / "hold"
    env = {}
    if point.startswith("segments_held"):
        env[FAULT_HOLD_ENV] = str(hold)
        if point.endswith("slow_to_die"):
            env[FAULT_IGNORE_TERM_ENV] = "1"
    with busy_host() if load == "loaded" and not FAULT_LOAD else contextlib.nullcontext():
        run = Run(tmp_path, params, "--phases", "03_collectives", label=f"probe-{point}", env=env)
        run_dir = run.run_dir()
        wait_until(lambda: PROBE_POINTS[point](run_dir, hold), 600, f"the probe at {point}", run, poll_s=0.02)
        held = []
        if point.startswith("segments_held"):
            held = sorted({procs.SHM_DIR / n for f in hold.parent.glob(hold.name + ".rank[0-9]")
                           for n in json.loads(f.read_text())["segments"]})
            assert all(p.exists() for p in held), held  # the segments exist when the signal lands
            assert {p.name.split("-")[3] for p in held} <= {procs.probe_run_key(run_dir.name)}
        if sig == "SIGTERM":
            os.kill(run.proc.pid, signal.SIGTERM)
        else:
            os.killpg(run.proc.pid, signal.SIGINT)
        t_sig = time.monotonic()
        rc = run.wait(300)
        stop_s = time.monotonic() - t_sig
        pids, shm = left_after_teardown(run_dir)
    assert rc == (EXIT_SIGTERM if sig == "SIGTERM" else EXIT_SIGINT), run.stderr[-3000:]
    no_traceback(run.stderr)
    m = manifest(run_dir)
    assert m["status"] == "interrupted" and "interrupted" in m["phases"]["03_collectives"]["error"]
    assert pids == [], f"processes of the run left: {pids}"
    assert shm == [] and not [p for p in held if p.exists()], f"probe segments left: {shm} {held}"
    _probe_stops.setdefault((sig, load), {})[point] = {"stop_s": round(stop_s, 1), "segments_held": len(held)}
    points = _probe_stops[(sig, load)]
    what = "SIGTERM" if sig == "SIGTERM" else "Ctrl-C"
    n_points = sum(1 for _, s in PROBE_CASES if s == sig)
    record_fault(f"{what} during the collectives probe ({n_points} points: agent up, segments made, measuring, "
                 "tearing down)" if n_points > 2 else f"{what} during the collectives probe (segments made, measuring)",
                 f"exit {rc}, manifest interrupted; every rank stopped and every segment of the probe removed "
                 "wherever the signal lands (before, while and after the segments are made; ranks slow to die "
                 "too): the launcher sweeps its token's, the runner the run's, once no process of it is alive",
                 load=load, rc=rc, results_lost="the phase in flight", processes_left=len(pids),
                 shm_files_left=len(shm), detect_and_stop_s=max(v["stop_s"] for v in points.values()),
                 stop_s_per_point={k: v["stop_s"] for k, v in points.items()})


_probe_stops: dict = {}
