"""The embedded default end to end with `host: ssh://root@127.0.0.1:PORT` (a real sshd standing in for the
GPU host: tests/test_host_ssh.Sshd), and the faults of a remote run injected for real: the ssh link
killed mid-sweep and mid-profile (then --resume), the remote vLLM server killed. Each starts the real
vLLM CPU server (only one at a time on a 2-core machine), so they are `integration` tests.

The faults and the whole run share one run directory (one server start fewer than a run of its own): the
faults' runs measure 01 and profile 04 through three faults, and the last --resume runs every phase left
(00, 02, 03 over ssh, 04 again, 05 and the report), which is the embedded default end to end over ssh. The
whole-run test also sets the session's local end-to-end run of the same params (tests/conftest.py e2e_run)
beside it: the two reports have the same sections (figure titles, table captions) and the two runs' data
files the same columns and keys.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from decodescope.exec import procs
from decodescope.cli.main import EXIT_PHASE_FAILED
from decodescope.exec.hostcore import HOST_RUN_ID_ENV, RUN_ID_ENV, SSH_RUN_ID_ENV
from decodescope.schema.params import PHASES
from tests.faultload import record_fault
from tests.test_faults import Run, digests, manifest, settled, shm_files_of, tmp_dirs_left, wait_until
from tests.test_host_ssh import SSHD, Sshd
from tests.test_integration_vllm import _params

pytestmark = [pytest.mark.integration, pytest.mark.ssh,
              pytest.mark.skipif(not Path(SSHD).exists(), reason="needs Debian's openssh-server (make test installs it)")]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    d = Sshd(tmp_path_factory.mktemp("sshd"))
    yield d
    d.stop()


def ssh_params(tmp: Path, port: int, name: str, sshd: Sshd, replace: dict | None = None) -> Path:
    path = _params(REPO, tmp, port, name=name)
    text = path.read_text()
    assert "host: local\n" in text
    text = text.replace("host: local\n", f"host:\n  url: {sshd.url}\n  python: {sys.executable}\n"
                                         f"  workdir: {tmp / 'remote'}\n  identity: {sshd.identity}\n"
                                         f"  known_hosts: {sshd.known_hosts}\n")
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


def left_on_host(run_dir: Path) -> list[int]:
    """Processes the run started on the host (the stand-in is this machine): by its run id there and by
    each server's run token."""
    m = manifest(run_dir)
    pids = set(procs.run_processes(run_dir.name, env_name=HOST_RUN_ID_ENV))
    pids |= set(procs.run_processes(run_dir.name, env_name=RUN_ID_ENV))
    for s in m.get("servers", []):
        pids |= set(procs.run_processes(s.get("run_token")))
    return sorted(pids)


def shm_left(run_dir: Path) -> list[Path]:
    """The host's /dev/shm files and IPC socket folders (in its /tmp) of the run's servers still there."""
    servers = manifest(run_dir).get("servers", [])
    shm = shm_files_of(procs.shm_idents(Path(f) for s in servers for f in s.get("shm_files", [])))
    return shm + tmp_dirs_left(servers, "/tmp")


def left_after_teardown(run_dir: Path) -> tuple[list[int], list[Path]]:
    """What of the run is left on the host once its supervisor there has had time to tear down alone (after
    a dropped link it notices the drop itself)."""
    pids, shm = settled(lambda: (left_on_host(run_dir), shm_left(run_dir)))
    return pids, shm


def assert_nothing_left(run_dir: Path) -> tuple[int, int]:
    assert left_after_teardown(run_dir) == ([], [])
    return 0, 0


def kill_link(run: Run) -> int:
    """SIGKILL the run's ssh connection (its ControlMaster): the link drops."""
    for p in psutil.Process(run.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0] == "ssh" and "ControlMaster=yes" in cmd and "-N" in cmd:
            p.kill()
            return p.pid
    pytest.fail("no ssh ControlMaster under the run")


# ---- the whole embedded default over ssh --------------------------------------------------------------
# The run over ssh is compared with the local run by its sections and its files' columns, not by what it
# measured: a workload of the same shape (the same GEMM shapes and dtypes, profiled levels; the faults' one
# more serving level, 8, and their longer profile, which the faults need to land mid-sweep and mid-profile),
# fewer micro-benchmark iterations, the collective sweep to 1 MiB.
LIGHT = {"  iterations: 10\n  warmup: 3\n": "  iterations: 5\n  warmup: 2\n  sweep_max_bytes: 1048576\n"}


@pytest.fixture(scope="module")
def over_ssh(ssh_faults, handoff):
    """The embedded default end to end over ssh: ssh_faults' last --resume, which runs every phase its
    faulted runs left (00, 02 and 03 never ran; 04 failed; 01 is kept), on the run directory of the faults.
    Its run directory and exit status are handed to make test's second stage (tests/lanes.py LATE)."""
    r = ssh_faults["resume"]
    run_dir = Path(r.stdout.strip().splitlines()[-1]).parent if r.stdout.strip() else None
    handoff.save("over_ssh", {"run_dir": run_dir and str(run_dir), "returncode": r.returncode})
    return {"proc": r, "returncode": r.returncode, "run_dir": run_dir, "wall_s": ssh_faults["resume_s"],
            "tmp": ssh_faults["tmp"], "masters": ssh_faults["masters"]}


@pytest.fixture
def over_ssh_run(request, handoff) -> dict:
    """over_ssh's run directory and exit status: in make test's second stage, what its first stage handed
    over (the run over ssh ran beside the fault tests; the local run it is set against runs alone later);
    otherwise over_ssh itself."""
    handed = handoff.load("over_ssh")
    if handed is not None:
        return {"run_dir": handed["run_dir"] and Path(handed["run_dir"]), "returncode": handed["returncode"]}
    return request.getfixturevalue("over_ssh")


@pytest.fixture
def local(e2e_run):
    """The local run of the same embedded default: the session's end-to-end run (tests/conftest.py e2e_run),
    which test_integration_vllm checks in full. It differs from these params in what it plants (secrets, and
    markup as the served model's name, which outline() reads as the model's name), in the workload's size
    (LIGHT above), which outline() reads as numbers and data_shapes() not at all, and in what the experiments
    campaign adds (its variants and repeats: baseline_of_campaign)."""
    assert e2e_run["proc"].returncode == 0, e2e_run["proc"].stderr[-3000:]
    return e2e_run["run_dir"]


def test_the_embedded_default_runs_end_to_end_over_ssh(over_ssh):
    """ssh_faults' last --resume: every phase the faulted runs left, then the report, on their run directory."""
    proc, run_dir = over_ssh["proc"], over_ssh["run_dir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = manifest(run_dir)
    assert {p: v["status"] for p, v in m["phases"].items()} == {p: "ok" for p in PHASES}
    assert m["host"]["kind"].startswith("ssh://root@127.0.0.1:")
    assert (run_dir / "report.html").is_file()
    server = json.loads((run_dir / "data/server.json").read_text())
    assert server["host"].startswith("root@127.0.0.1") and server["pid"] is None and server["host_pid"]
    link = json.loads((run_dir / "data/link.json").read_text())
    assert link["via_tunnel_p50_ms"] > 0 and "added_p50_ms" in link
    # what ran there came back: the server's log, the probes' logs and outputs, every rank's trace
    assert "Uvicorn running" in (run_dir / "logs/server.log").read_text(errors="replace") or \
        "Application startup complete" in (run_dir / "logs/server.log").read_text(errors="replace")
    for name in ("logs/gemm_probe.log", "logs/collectives_probe.log", "data/gemm_raw.json",
                 "data/collectives_ranks/collectives_rank1.json"):
        assert (run_dir / name).is_file(), name
    assert len(list((run_dir / "traces").rglob("*.json.gz"))) >= 2
    # 03's check of the critical path against a known skew ran there and its traces came back; what it
    # recovers is test_integration_vllm's claim, alone on the machine: here the servers lane runs beside it
    # (rank 0 preempted past the 250 us delay named it late in 10 of 40 instances once)
    skew = json.loads((run_dir / "data/skew_calibration.json").read_text())
    assert skew["ran"] and [r["injected_us"] for r in skew["settings"]] == [0.0, 250.0]
    assert all(r["instances"] >= skew["steps"] * (1 + 2 * 4) - 2 for r in skew["settings"]), skew
    assert len(list((run_dir / "traces/skew_calibration/d250").glob("*rank[01].pt.trace.json.gz"))) == 2
    assert "ssh tunnel" in (run_dir / "report.html").read_text(errors="replace")
    assert_nothing_left(run_dir)
    print(f"embedded default over ssh: wall {over_ssh['wall_s']:.0f} s, tunnel adds {link['added_p50_ms']:.2f} ms")


def test_the_phases_run_over_ssh_from_the_cli_over_one_connection(over_ssh):
    """`decodescope run` with an ssh host (moved here from tests/test_host_ssh.py, whose own run of 00, 02 and
    03 over ssh this run repeats): the host's inventory is taken there, the probes run there, their files come
    back, the notebooks and report stay here; the run's kernels (and its server's tunnel) multiplex over the
    runner's one ControlMaster; nothing is left on either side."""
    proc, run_dir = over_ssh["proc"], over_ssh["run_dir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = manifest(run_dir)
    assert all(m["phases"][p]["status"] == "ok" for p in ("00_host", "02_gemm", "03_collectives"))
    masters = over_ssh["masters"]
    assert len(masters) == 1  # one connection for the whole run, kernels included
    host = json.loads((run_dir / "data/host.json").read_text())
    assert host["cpu"]["hostname"] and host["cpu_matmul"]
    remote_run = over_ssh["tmp"] / "remote" / run_dir.name
    assert (remote_run / "data/gemm_raw.json").is_file() and (run_dir / "data/gemm_raw.json").is_file()
    assert (run_dir / "logs/gemm_probe.log").stat().st_size > 0
    assert (run_dir / "report.html").is_file() and not (remote_run / "report.html").exists()
    assert procs.run_processes(run_dir.name, env_name=HOST_RUN_ID_ENV) == []
    assert procs.run_processes(run_dir.name, env_name=SSH_RUN_ID_ENV) == []
    assert not any(psutil.pid_exists(p) for p in masters)


def outline(run_dir: Path) -> dict:
    """Per phase: the figure titles and table captions it shows, without the run-specific source and with
    numbers as N (the profiled levels follow each run's own knee)."""
    import re

    from html import escape

    import yaml

    model = yaml.safe_load((run_dir / "params.yaml").read_text())["model"]["name"]

    def norm(text) -> str:
        text = str(text or "").replace(model, "MODEL").replace(escape(model), "MODEL")
        return re.sub(r"\d+(\.\d+)?", "N", text)
    out = {}
    for nb_path in sorted((run_dir / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        items = set()
        for cell in nb.cells:
            for o in cell.get("outputs", []):
                data = o.get("data", {})
                if "application/vnd.plotly.v1+json" in data:
                    title = ((data["application/vnd.plotly.v1+json"].get("layout") or {}).get("title") or {})
                    items.add(("figure", norm(title.get("text") if isinstance(title, dict) else title)))
                elif "<table" in str(data.get("text/html", "")):
                    html = str(data["text/html"])
                    cap = html.split("<caption>")[1].split("</caption>")[0] if "<caption>" in html else ""
                    items.add(("table", norm(cap.split(" - ")[0])))
        out[nb_path.stem] = items
    return out


def data_shapes(run_dir: Path) -> dict:
    import pandas as pd

    shapes = {}
    for p in sorted((run_dir / "data").glob("*")):
        if p.suffix == ".parquet":
            shapes[p.name] = sorted(pd.read_parquet(p).columns)
        elif p.suffix == ".json" and p.name not in ("server.json", "link.json"):
            doc = json.loads(p.read_text())
            shapes[p.name] = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
    return shapes


# What the experiments campaign (the local run) shows beyond a run of the embedded default: its variants in
# 05, and of its repeats a table a row per level and repeat, a band per level, each request's repeat
VARIANT_SECTIONS = {"05_verdict": {("figure", "Variants: measured TPOT against the baseline and the projection"),
                                   ("table", "variants: measured (their N) vs baseline and vs projection")}}
REPEATS_FILE = "serving_levels_repeats.parquet"


def baseline_of_campaign(sections: dict, shapes: dict) -> tuple[dict, dict]:
    """A campaign's outline and data shapes less what its variants and repeats add, each of which must be
    there."""
    for phase, items in VARIANT_SECTIONS.items():
        assert items <= sections[phase], (phase, sorted(sections[phase]))
    assert REPEATS_FILE in shapes and "repeats" in shapes["serving_levels.parquet"]
    sections = {k: v - VARIANT_SECTIONS.get(k, set()) for k, v in sections.items()}
    shapes = {k: v for k, v in shapes.items() if k != REPEATS_FILE}
    shapes["serving_levels.parquet"] = [c for c in shapes["serving_levels.parquet"]
                                        if c != "repeats" and not c.endswith(("_low", "_high"))]
    shapes["serving_requests.parquet"] = [c for c in shapes["serving_requests.parquet"] if c != "repeat"]
    return sections, shapes


def test_the_report_over_ssh_has_the_sections_and_numbers_of_a_local_run(over_ssh_run, local):
    ssh_run = over_ssh_run["run_dir"]
    assert over_ssh_run["returncode"] == 0
    sections, theirs = baseline_of_campaign(outline(local), data_shapes(local))
    assert outline(ssh_run) == sections
    ours = data_shapes(ssh_run)
    assert set(theirs) <= set(ours) and set(ours) - set(theirs) <= {"link.json"}
    assert {k: ours[k] for k in theirs} == theirs


# ---- faults over ssh: one run directory through three of them, then the whole run ------------------------
@pytest.fixture(scope="module")
def ssh_faults(sshd, tmp_path_factory) -> dict:
    """One run directory over ssh through three faults, each on a server of its own, and what each step saw,
    for the tests below (one server start fewer than a run per fault, and no level measured twice): a run of
    01 whose API server there is SIGKILLed after level 1; its --resume, whose ssh link is killed
    once level 2 is written again; the next --resume of 01 and 04, which finishes the sweep and whose link is killed once
    04's profile has started; and the last --resume of every phase, which profiles again and runs the phases
    the faulted runs did not select (00, 02, 03, 05): the embedded default end to end over ssh (over_ssh)."""
    tmp = tmp_path_factory.mktemp("sshfaults")
    params = ssh_params(tmp, 8823, "sshfaults", sshd, {"concurrency: [1, 2, 4]": "concurrency: [1, 2, 4, 8]",
                                                       "  requests: 12\n": "  requests: 24\n", **LIGHT})
    out: dict = {"tmp": tmp}
    killed = Run(tmp, params, "--phases", "01_serving", label="killed")
    run_dir = out["run_dir"] = killed.run_dir()
    level1, level2 = (run_dir / f"data/serving/level_0000{n}.parquet" for n in (1, 2))
    wait_until(level1.is_file, 900, "level 1", killed)
    os.kill(json.loads((run_dir / "data/server.json").read_text())["host_pid"], signal.SIGKILL)
    out["killed"] = _fault_outcome(killed, run_dir, "01_serving")

    # the killed run may have written level 2 already (spoiled: its requests failed when the server died),
    # which the resume measures again: wait for the resume's own level 2, with its link up
    spoiled = level2.stat().st_mtime_ns if level2.is_file() else None
    swept = Run(tmp, params, "--resume", str(run_dir), "--phases", "01_serving", label="sweep")
    wait_until(lambda: level2.is_file() and level2.stat().st_mtime_ns != spoiled, 900, "level 2 of the sweep", swept)
    out["sweep_kept"] = digests([level1, level2])
    kill_link(swept)
    out["sweep"] = _fault_outcome(swept, run_dir, "01_serving")
    out["sweep_kept_after_drop"] = digests(out["sweep_kept"])

    log = run_dir / "logs/server.log"
    profiled = Run(tmp, params, "--resume", str(run_dir), "--phases", "01_serving", "04_profile", label="profile")
    wait_until(lambda: manifest(run_dir)["phases"]["01_serving"]["status"] == "ok", 900, "the sweep to finish",
               profiled)
    out["sweep_recover_s"] = time.monotonic() - profiled.t0
    wait_until(lambda: log.is_file() and "POST /start_profile HTTP" in log.read_text(errors="replace"), 900,
               "the profile to start", profiled)
    kill_link(profiled)
    out["profile"] = _fault_outcome(profiled, run_dir, "04_profile")
    out["sweep_kept_after_profile"] = digests(out["sweep_kept"])

    t_resume = time.monotonic()
    resumed = Run(tmp, params, "--resume", str(run_dir), label="resume")
    out["masters"] = set()  # the run's ssh ControlMasters, sampled while it runs
    while resumed.proc.poll() is None and time.monotonic() - t_resume < 1800:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[:1] == ["ssh"] and "ControlMaster=yes" in cmd and str(sshd.port) in cmd:
                out["masters"].add(p.pid)
        time.sleep(0.1)
    out["resume_rc"], out["resume_stderr"] = resumed.wait(60), resumed.stderr
    out["resume_s"] = time.monotonic() - t_resume
    out["resume"] = subprocess.CompletedProcess(resumed.proc.args, out["resume_rc"], resumed.out.read_text(),
                                                out["resume_stderr"])
    m = manifest(run_dir)
    # what profiling again took (its server's start and 04), apart from the phases this resume also ran
    out["profile_recover_s"] = (m["servers"][-1]["start_s"] + m["phases"]["04_profile"]["duration_s"]
                                if out["resume_rc"] == 0 else out["resume_s"])
    out["resume_left"] = left_after_teardown(run_dir)
    return out


def _fault_outcome(run: Run, run_dir: Path, phase: str) -> dict:
    """A faulted run's exit status, how long it took to stop, its phase's error and what it left there."""
    t_fault = time.monotonic()
    rc = run.wait(300)
    detect_s = time.monotonic() - t_fault
    m = manifest(run_dir)
    return {"rc": rc, "stderr": run.stderr, "detect_s": detect_s, "error": m["phases"][phase].get("error") or "",
            "status": m["phases"][phase]["status"], "manifest": m, "left": left_after_teardown(run_dir)}


def test_remote_server_killed_fails_the_phase_and_leaves_nothing_there(ssh_faults):
    k = ssh_faults["killed"]
    assert k["rc"] == EXIT_PHASE_FAILED, k["stderr"][-3000:]
    assert k["status"] == "failed" and "server_died" in k["error"], k["error"]
    assert k["left"] == ([], []), f"processes and shm files of the run left there: {k['left']}"
    record_fault("server on the ssh host killed (SIGKILL to the API server there)",
                 "phase fails with server_died and the log tail (copied back); engine core and workers there "
                 "torn down by the host's supervisor, their shm files removed", rc=k["rc"], results_lost="none",
                 processes_left=0, shm_files_left=0, detect_and_stop_s=round(k["detect_s"], 1))


def test_link_dropped_mid_sweep_keeps_the_finished_levels_and_resume_finishes(ssh_faults):
    import pandas as pd

    k, run_dir = ssh_faults["sweep"], ssh_faults["run_dir"]
    assert k["rc"] == EXIT_PHASE_FAILED, k["stderr"][-3000:]
    assert "server_died" in k["error"] and ("ssh link" in k["error"] or "did not answer" in k["error"]), k["error"]
    assert k["left"] == ([], []), f"processes and shm files of the run left there: {k['left']}"
    kept = ssh_faults["sweep_kept"]
    assert ssh_faults["sweep_kept_after_drop"] == kept
    # the next resume finished the sweep before its own fault, in 04, without measuring levels 1 and 2 again
    assert ssh_faults["profile"]["manifest"]["phases"]["01_serving"]["status"] == "ok"
    assert ssh_faults["sweep_kept_after_profile"] == kept and digests(kept) == kept
    levels = pd.read_parquet(run_dir / "data/serving_levels.parquet").set_index("level")
    assert sorted(levels.index) == [1, 2, 4, 8] and (levels["failed"] == 0).all()
    record_fault("ssh link dropped mid-sweep (ssh killed)",
                 "phase fails (server_died: the link dropped); the host's supervisor tears the server down alone; "
                 "finished levels kept; --resume re-measures the spoiled levels", rc=k["rc"],
                 results_lost="none (levels 1, 2 byte-identical)", processes_left=0, shm_files_left=0,
                 detect_and_stop_s=round(k["detect_s"], 1), recover_s=round(ssh_faults["sweep_recover_s"], 1))


def test_link_dropped_mid_profile_tears_down_there_and_resume_finishes(ssh_faults):
    k, run_dir = ssh_faults["profile"], ssh_faults["run_dir"]
    assert k["rc"] == EXIT_PHASE_FAILED, k["stderr"][-3000:]
    assert k["status"] == "failed", k["manifest"]["phases"]
    assert k["left"] == ([], []), f"processes and shm files of the run left there: {k['left']}"
    assert ssh_faults["resume_rc"] == 0, ssh_faults["resume_stderr"][-3000:]
    assert json.loads((run_dir / "data/profile_summary.json").read_text())["ranks"] == [0, 1]
    assert ssh_faults["resume_left"] == ([], [])
    record_fault("ssh link dropped mid-profile (ssh killed)",
                 "phase fails; server, engine core and workers there torn down by the host's supervisor; "
                 "--resume profiles again", rc=k["rc"], results_lost="the capture in flight", processes_left=0,
                 shm_files_left=0, detect_and_stop_s=round(k["detect_s"], 1), recover_s=round(ssh_faults["profile_recover_s"], 1))
