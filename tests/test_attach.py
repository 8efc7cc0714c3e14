"""server.mode attach against real vLLM CPU servers that the test starts itself, as a user would: not
through decodescope's launcher, in their own session, with the profiler flag the README gives.

Every test asserts that the user's server is never endangered: its processes are the same ones after the
run (same pids, same start times: nothing restarted them) and still answer, unless the test itself killed
it. The fault tests record their figures in the fault table (tests/faultload.py record_fault; loaded under DECODESCOPE_FAULT_LOAD=1).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from decodescope.cli.main import EXIT_BAD_INPUT, EXIT_PHASE_FAILED
from decodescope.engines import engine
from decodescope.exec import privatedirs, procs
from decodescope.exec.modeldir import resolve_model_dir
from decodescope.schema.params import load_params
from decodescope.profiling.attachguard import DISK_SHARE, MEMORY_SHARE
from tests.browser import inspect_report
from tests.faultload import record_fault
from tests.test_faults import SMALL_MICRO, Run, digests, manifest, wait_until
from tests.test_integration_vllm import DECODESCOPE

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen3-moe"


class UserServer:
    """vLLM CPU serving the embedded default's model at tensor-parallel 2, started as the README says."""

    def __init__(self, tmp: Path, port: int, trace_dir: Path | None, with_stack: bool = False):
        self.port, self.trace_dir = port, trace_dir
        model, _ = resolve_model_dir(load_params(REPO / "params/default.yaml"))
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--tensor-parallel-size", "2", "--load-format", "dummy", "--dtype", "bfloat16",
                "--max-model-len", "1024", "--max-num-seqs", "16", "--distributed-executor-backend", "mp"]
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            argv += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                                                      "torch_profiler_with_stack": with_stack})]
        # its temporary files (the ZMQ sockets, the workers' init file) in a folder removed with it: vLLM
        # leaves them behind in the temporary folder otherwise (short: a socket's path fits 107 bytes)
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="user-vllm-"))
        # but its compile cache where a server with the default TMPDIR keeps it, as a user's server has it (in the
        # folder, each of the module's three starts recompiled: 27-29 s of warm-up on both workers)
        privatedirs.link_tmp_caches(str(self.tmp_dir), engine("vllm").tmp_caches)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "TMPDIR": str(self.tmp_dir)}
        self.log = tmp / f"user-server-{port}.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.identity: dict[int, float] = {}
        self.shm: set[Path] = set()
        deadline = time.monotonic() + 600
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the user's vLLM server did not start: {self.log.read_text()[-3000:]}")
            time.sleep(1.0)
        self.identity = self.processes()
        # its shared memory (the shm all-reduce's, the message queues'): a killed server leaves it behind
        self.shm = procs.mapped_shm_files(self.identity)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=5).status == 200
        except OSError:
            return False

    def processes(self) -> dict[int, float]:
        """pid -> start time of the API server and every process under it."""
        try:
            root = psutil.Process(self.proc.pid)
            return {p.pid: p.create_time() for p in [root, *root.children(recursive=True)]}
        except psutil.NoSuchProcess:
            return {}

    def completes(self) -> bool:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=120).read())["usage"]["completion_tokens"] == 4

    def assert_untouched(self) -> None:
        """The same processes as at its start (none restarted, none gone), still serving."""
        assert self.processes() == self.identity
        assert self.healthy() and self.completes()

    def kill(self) -> None:
        """SIGKILL to every process of the server (its session), as an OOM killer or an operator would."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.processes():   # any that left the session
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        self.proc.wait(timeout=60)

    def stop(self) -> list[Path]:
        """Killed, and its shared-memory files removed as its user would; the files still there after."""
        self.kill()
        procs.remove_shm(procs.shm_idents(self.shm), self.shm)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return sorted(p for p in self.shm if p.exists())


def attach_params(tmp: Path, server: UserServer, name: str, trace_dir: str | None = None,
                  profile: str = "", host: str = "local") -> Path:
    """params/default.yaml made to attach to `server` (host.trace_dir given or read from the server)."""
    text = (REPO / "params/default.yaml").read_text()
    text = text.replace("output_dir: outputs", f"output_dir: {tmp / 'out'}")
    text = text.replace("config: models/", f"config: {REPO / 'params/models'}/")
    text = text.replace("name: default", f"name: {name}")
    text = text.replace("  mode: launch\n", f"  mode: attach\n  url: {server.url}\n")
    host_lines = f"host:\n  url: {host}\n" + (f"  trace_dir: {trace_dir}\n" if trace_dir else "")
    text = text.replace("host: local\n", host_lines)
    text = text.replace("  requests_per_level: 24\n", "  requests_per_level: 12\n")
    if profile:
        text = text.replace("\nprofile:\n", f"\nprofile:\n{profile}")
    # 02 and 03 do not touch the attached server: the fault tests' small micro-benchmarks (test_faults SMALL)
    # keep their files and the report's sections at ~80 s less of the servers lane (47 + 67 s at full size)
    full, small = SMALL_MICRO
    assert text.count(full) == 1
    p = tmp / f"{name}.yaml"
    p.write_text(text.replace(full, small))
    return p


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory):
    """Started with the README's flag: traces in a directory of the user's, no stacks."""
    tmp = tmp_path_factory.mktemp("attach")
    server = UserServer(tmp, 8811, tmp / "their-traces")
    yield server
    assert server.stop() == []


@pytest.fixture(scope="module")
def attached_run(quiet_server, tmp_path_factory):
    """One `decodescope run` of every phase against the quiet server, host.trace_dir left to be read."""
    tmp = tmp_path_factory.mktemp("attach-run")
    run = Run(tmp, attach_params(tmp, quiet_server, "attached"))
    rc = run.wait(timeout=1500)
    return {"rc": rc, "run": run, "run_dir": run.run_dir(), "wall_s": time.monotonic() - run.t0}


def fits(plan: dict, share: float, ranks: int) -> bool:
    """Whether `share` of a plan's window fits the host as the plan read it: every rank's export within
    MEMORY_SHARE of the available memory, the traces within DISK_SHARE of the free disk."""
    mem, disk = plan["mem_available_bytes"], plan["disk_free_bytes"]
    return ((not mem or plan["est_export_bytes"] * share <= MEMORY_SHARE * mem * 1.0001)
            and (not disk or plan["est_trace_bytes"] * share * (ranks + 1) <= DISK_SHARE * disk * 1.0001))


def assert_decision_follows_its_numbers(plan: dict, ranks: int) -> None:
    """A level's window runs whole where its estimate fits what the host had then, and shrinks to fewer
    requests (at least one batch) only where the whole window would not. Which one a run gets depends on
    the host's memory at that moment: CI's lanes run beside each other, and one c4 window there was shrunk."""
    allowed, planned = plan["allowed_requests"], plan["planned_requests"]
    if plan["decision"].startswith("refused: "):   # its estimates are of one batch
        assert allowed == 0 and not fits(plan, 1.0, ranks), plan
        return
    whole = planned / allowed   # the plan's estimates are of the window it let run
    if plan["decision"] == "fits":
        assert allowed == planned and fits(plan, 1.0, ranks), plan
    else:
        assert plan["decision"].startswith("shrunk: "), plan
        concurrency = int(plan["label"].removeprefix("c")) if plan["label"].startswith("c") else 1
        assert concurrency <= allowed < planned, plan
        assert fits(plan, 1.0, ranks) and not fits(plan, whole, ranks), plan


def test_an_attached_server_is_measured_end_to_end_and_left_as_it_was(attached_run, quiet_server):
    run_dir = attached_run["run_dir"]
    assert attached_run["rc"] == 0, attached_run["run"].stderr[-3000:]
    phases = manifest(run_dir)["phases"]
    assert {p: v["status"] for p, v in phases.items()} == {p: "ok" for p in phases} and len(phases) == 6
    # each level's traces filed from the user's directory into the run directory, which is the one record
    levels = json.loads((run_dir / "data/profile_capture.json").read_text())["levels"]
    for c in levels:
        assert len(list((run_dir / f"traces/c{c}").glob("*rank*.pt.trace.json.gz"))) == 2
        assert (run_dir / f"data/profile/c{c}/profile_summary.json").is_file()
    assert not list(run_dir.glob("traces/node0/*.json.gz")) and not (run_dir / ".trace_sync").exists()
    guard = json.loads((run_dir / "data/profile/attach_guard.json").read_text())
    assert guard["trace_dir"] == str(quiet_server.trace_dir) and guard["with_stack"] is False
    for plan in guard["plans"]:
        assert_decision_follows_its_numbers(plan, ranks=2)
    measured = {c["label"]: c for c in guard["probes"] + guard["slices"] + guard["levels"]}
    for plan, got in zip(guard["plans"], guard["levels"]):
        # the estimate from the level's slice against what the window then wrote. The guard lets a window run
        # when its estimate needs at most half the host's memory (MEMORY_SHARE), so what it relies on is a
        # window never more than twice its estimate. Its model: a trace grows by the engine step, at the
        # slice's bytes a step, and a window takes at most est_steps (its requests one by one, which is
        # how they ran here in windows where the client stood still ~1 s at a time: 104 steps at
        # concurrency 4 where another window took 50)
        # priced by its slice, or where that saw no step (CI: c4's 12 requests ended before the profiler
        # started), by the window measured with the most bytes a step
        cut = measured[plan["priced_by"]]
        own = measured[f"slice-{plan['label']}"]
        assert cut is own or not (own["trace_steps"] and own["tokens"]), (plan, own)
        assert got["trace_steps"] and cut["trace_steps"], (cut, got)
        assert got["trace_steps"] <= plan["est_steps"], (plan, got)
        per_step = (cut["trace_bytes"] / cut["trace_steps"]) / (got["trace_bytes"] / got["trace_steps"])
        assert 0.5 <= per_step <= 2.0, (cut, got)
        assert got["trace_bytes"] <= 2.0 * plan["est_trace_bytes"], (plan, got)
        print(f"{plan['label']}: {plan['decision']} at {plan['mem_available_bytes'] / 2**30:.1f} GiB available; "
              f"est {plan['est_trace_bytes'] / 1e6:.2f} MB/rank ({plan['est_steps']:.0f} steps at "
              f"most), {plan['est_export_bytes'] / 1e6:.0f} MB export; measured {got['trace_bytes'] / 1e6:.2f} MB "
              f"({got['trace_steps']} steps), {(got['export_bytes'] or 0) / 1e6:.0f} MB; slice/window bytes a "
              f"step {per_step:.2f}")
    verdict = json.loads((run_dir / "data/verdict.json").read_text())
    assert verdict
    seen = inspect_report(run_dir / "report.html")
    assert seen["page_errors"] == [] and seen["network_requests"] == []
    for title in ("05_verdict · Verdict", "01_serving", "04_profile"):
        assert title in seen["text"]
    assert seen["statuses"].count("ok") >= 6
    quiet_server.assert_untouched()
    print(f"attached run: {attached_run['wall_s']:.0f} s; phases "
          + ", ".join(f"{p} {v['duration_s']:.0f} s" for p, v in phases.items()))


def test_an_attached_server_is_profiled_over_ssh_through_host_trace_dir(quiet_server, tmp_path):
    """The server on the ssh host (here the real sshd's), its traces copied back from host.trace_dir."""
    from tests.test_host_ssh import Sshd

    (tmp_path / "sshd").mkdir()
    sshd = Sshd(tmp_path / "sshd")
    try:
        params = attach_params(tmp_path, quiet_server, "attached-ssh", trace_dir=str(quiet_server.trace_dir),
                               profile="  host_ops_tokens: 0\n", host=sshd.url)
        text = params.read_text().replace(f"host:\n  url: {sshd.url}\n",
                                          f"host:\n  url: {sshd.url}\n  python: {sys.executable}\n"
                                          f"  workdir: {tmp_path / 'remote'}\n  identity: {sshd.identity}\n"
                                          f"  known_hosts: {sshd.known_hosts}\n  sync_interval_s: 0.5\n")
        params.write_text(text.replace("  concurrency: [1, knee]\n", "  concurrency: [2]\n"))
        run = Run(tmp_path, params, "--phases", "04_profile")
        rc = run.wait(timeout=900)
        run_dir = run.run_dir()
        assert rc == 0, run.stderr[-3000:]
        assert len(list((run_dir / "traces/c2").glob("*rank*.pt.trace.json.gz"))) == 2
        guard = json.loads((run_dir / "data/profile/attach_guard.json").read_text())
        assert [p["label"] for p in guard["plans"]] == ["c2"]
        assert_decision_follows_its_numbers(guard["plans"][0], ranks=2)   # not "fits": the host's memory decides
        summary = json.loads((run_dir / "data/profile/c2/profile_summary.json").read_text())
        assert summary["concurrency"] == 2
    finally:
        sshd.stop()
    quiet_server.assert_untouched()


def test_attached_server_killed_mid_profile_fails_the_phase_and_keeps_the_run(quiet_server, tmp_path):
    """The fault: the user's server dies (here: the test kills it) while 04 profiles it. Last in the
    module: the quiet server is gone after it."""
    params = attach_params(tmp_path, quiet_server, "attached-killed", profile="  host_ops_tokens: 0\n")
    run = Run(tmp_path, params, "--phases", "01_serving", "04_profile")
    run_dir = run.run_dir()
    guard = run_dir / "data/profile/attach_guard.json"
    wait_until(lambda: guard.is_file() and json.loads(guard.read_text())["plans"], 600, "04's first plan", run)
    kept = digests(_serving_files(run_dir))
    t_kill = time.monotonic()
    quiet_server.kill()
    rc = run.wait(timeout=600)
    waited_s = time.monotonic() - t_kill
    phases = manifest(run_dir)["phases"]
    assert rc == EXIT_PHASE_FAILED
    assert phases["01_serving"]["status"] == "ok" and phases["04_profile"]["status"] == "failed"
    error = phases["04_profile"]["error"]
    assert "died" in error and "measured before it" in error, error
    assert digests(_serving_files(run_dir)) == kept
    assert json.loads(guard.read_text())["probes"]  # what the guard measured stays
    left = [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get(
        "DECODESCOPE_RUN_ID") == run_dir.name]
    assert left == []
    record_fault("attached server killed mid-profile (SIGKILL to the user's server)",
                 "04 fails naming the death and what the guard measured before it; 01's files and the guard's record "
                 "kept; no process of the run left", rc=rc, results_lost="none (01's files byte-identical)",
                 processes_left=len(left), shm_files_left="– (the server's own)", detect_and_stop_s=round(waited_s, 1))


def _serving_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "data").rglob("*") if p.is_file() and "serving" in p.relative_to(run_dir).as_posix())


@pytest.fixture(scope="module")
def stack_server(tmp_path_factory):
    """Started as vLLM documents the flag, stacks on (its default): the server the issue's user lost."""
    tmp = tmp_path_factory.mktemp("attach-stack")
    server = UserServer(tmp, 8812, tmp / "their-traces", with_stack=True)
    yield server
    assert server.stop() == []


def test_the_guard_refuses_a_server_with_stacks_on_before_any_window_and_the_server_stays_healthy(stack_server,
                                                                                                  tmp_path):
    """The issue's user: the flag as vLLM documents it (stacks on by default). Every window the guard could
    take there has killed a worker on this host (the smallest, one request of one token, at 11.5 GB), so
    04 refuses before /start_profile, and 00-03 and 01's files are unaffected."""
    params = attach_params(tmp_path, stack_server, "attached-stack", profile="  host_ops_tokens: 0\n")
    theirs = set(stack_server.trace_dir.iterdir())
    run = Run(tmp_path, params, "--phases", "01_serving", "04_profile")
    rc = run.wait(timeout=900)
    run_dir = run.run_dir()
    phases = manifest(run_dir)["phases"]
    assert rc == EXIT_PHASE_FAILED and phases["01_serving"]["status"] == "ok"
    error = phases["04_profile"]["error"]
    assert phases["04_profile"]["status"] == "failed" and "torch_profiler_with_stack false" in error, error
    assert "No profile was started" in error
    guard = json.loads((run_dir / "data/profile/attach_guard.json").read_text())
    assert guard["with_stack"] is True and guard["probes"] == [] and guard["plans"] == []
    assert set(stack_server.trace_dir.iterdir()) == theirs      # not one profile was taken
    stack_server.assert_untouched()
    print(f"refused: {error[:400]}")


def test_a_server_without_a_profiler_is_refused_before_any_workload(tmp_path):
    """The fault: the profiler was never started with the server. The run ends at its preflight, before
    the run directory is made and before any request reaches the server."""
    server = UserServer(tmp_path, 8813, None)
    try:
        before = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        t0 = time.monotonic()
        run = Run(tmp_path, attach_params(tmp_path, server, "attached-noprof"))
        rc = run.wait(timeout=300)
        took_s = time.monotonic() - t0
        assert rc == EXIT_BAD_INPUT
        assert "without a torch profiler" in run.stderr and "--profiler-config" in run.stderr
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*-attached-noprof"))
        after = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        assert _requests_total(after) == _requests_total(before)
        server.assert_untouched()
    finally:
        assert server.stop() == []
    record_fault("attached server's profiler never started (no --profiler-config)",
                 "refused at the run's preflight naming the flag to add, before any request or run directory; the "
                 "server untouched", rc=rc, results_lost="none (nothing started)", processes_left=0,
                 shm_files_left=0, detect_and_stop_s=round(took_s, 1))


def _requests_total(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total"))


# ---- server.mode attach: what answers at server.url, refused before any phase runs -------------------------------
def _attach_run(tmp_path, url: str) -> tuple[int, str, float]:
    """`decodescope run` of the embedded default attached to `url`, every phase: exit status, stderr, seconds."""
    params = tmp_path / "attach.yaml"
    params.write_text((REPO / "params/default.yaml").read_text()
                      .replace("  mode: launch\n", f"  mode: attach\n  url: {url}\n")
                      .replace("config: models/", f"config: {REPO / 'params/models'}/")
                      .replace("output_dir: outputs", f"output_dir: {tmp_path / 'out'}"))
    t0 = time.monotonic()
    r = subprocess.run(DECODESCOPE + ["run", str(params)], cwd=REPO, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr, time.monotonic() - t0


def test_an_attach_run_with_nothing_listening_is_refused_before_any_phase(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: a real port with nothing on it
        rc, err, took_s = _attach_run(tmp_path, f"http://127.0.0.1:{port}")
    assert rc == EXIT_BAD_INPUT and f"nothing listens at server.url http://127.0.0.1:{port}" in err, err
    assert "not a vLLM server" not in err and "without a torch profiler" not in err
    assert not list(tmp_path.glob("out/*"))          # no run directory: no phase ran
    assert took_s < 60, took_s                         # seconds, not the 2 min 9 s of 00, 02, 03 first
    print(f"nothing listening: refused in {took_s:.1f} s")


def test_an_attach_run_to_a_plain_http_server_is_refused_as_not_vllm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                            "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as c:
                if c.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        rc, err, took_s = _attach_run(tmp_path, f"http://127.0.0.1:{port}")
    finally:
        web.terminate()
        log = web.communicate(timeout=30)[1]
    assert rc == EXIT_BAD_INPUT and f"server.url http://127.0.0.1:{port}" in err and "is not a vLLM server" in err, err
    assert "GET /health answered 404" in err and "without a torch profiler" not in err
    assert "GET /health" in log and "POST" not in log   # it was asked what it is, and sent no work
    assert not list(tmp_path.glob("out/*"))
    assert took_s < 60, took_s
    print(f"plain HTTP server: refused in {took_s:.1f} s")
