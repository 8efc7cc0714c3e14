"""`make test` on two cores: two stages, each of one or two pytest processes (lanes).

Stage 1, two lanes at once. The modules there that start vLLM servers, sshds and probe ranks assert exit
statuses, files, messages and what is left running (their own: by run token, run directory or port), never
how fast anything ran beyond seconds-scale limits, so two of them may share the two cores: FAULTS (the fault
and attach tests, one server at a time) in one lane; the unit tests (parsing, records, reports, packaging,
type checks), then TO_UNITS (two fault tests of a server of their own, moved from the first lane to even
the two out) and then BESIDE_SERVERS (the ssh host's tests, the runs over ssh) in the other.
Stage 2, one lane alone on the machine: ALONE, the modules that time the engine, a client or a probe, one
after the other; then LATE, tests that read what both stages made (the report over ssh of stage 1 set
against the local end-to-end run of stage 2).

A stage-1 fixture that a LATE test reads is handed over through the directory in DECODESCOPE_TEST_HANDOFF
(tests/conftest.py handoff), which this script makes for the session; without it (pytest run by hand) the
test makes the fixture itself, as before.

Two processes rather than pytest-xdist's groups: with pytest 9.2, xdist 3.8's `--dist loadgroup` no longer
groups (it renames `item._nodeid`, which pytest no longer reads), and both workers started servers at once.

    python -m tests.lanes [pytest arguments for every lane]
    python -m tests.lanes --fast [pytest arguments]   # make test-fast: every module's unit tests over two lanes

The lane of servers and the lone stage write to the terminal as they run; the unit lane's output comes whole
once it ends. Each stage ends with one line of its wall time and the CPU it took, in core-seconds: on two cores
a stage cannot take less wall than half its core-seconds. The exit status is the first failing lane's.
"""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
NO_TESTS = 5  # pytest's exit status when no test was selected
HANDOFF_ENV = "DECODESCOPE_TEST_HANDOFF"
FAULTS = ("test_faults.py", "test_attach.py")
# test_host_ssh.py (sshd, torchrun over ssh, no vLLM; 88 s alone) runs in the unit lane: the lane of servers
# was the longer by ~260 s (test_faults ~470 s + test_attach 342 s + it, against ~320 s of unit tests and
# test_integration_ssh's runs), so stage 1 waited on it
BESIDE_SERVERS = ("test_host_ssh.py", "test_integration_ssh.py")
ALONE = ("test_integration_vllm.py", "test_experiments_vllm.py", "test_probes.py",
         "test_stepmodel.py", "test_engine_comm.py", "test_serving_client.py", "test_telemetry.py",
         "test_compare_gate_vllm.py")
LATE = ("test_integration_ssh.py::test_the_report_over_ssh_has_the_sections_and_numbers_of_a_local_run",)
# Fault tests of a server of their own that run in the unit lane, before its runs over ssh, not in the lane of
# servers: that lane was the longer of stage 1 by ~320 s (23.0 min against 17.7, 2026-12-07, native; 26.0
# against 19.5 on AVX2), and these two (88 s and 27 s there) start, stall and tear down their own server, which
# asserts nothing of another module's processes. In a fresh clone the unit lane also pays mypy's cold cache
# (100 s, 2 s warm): there the lanes came out at 1,251 s (servers) and 1,319 s (units), native, 2026-12-07.
# The three disk-full tests (00 and 02 on a tmpfs of their own; ~28 s each beside the servers) followed once
# the unit lane shrank: mypy no longer reads vLLM (~120 s less there in a fresh clone on AVX2, where the lanes
# had come out at 2,149 and 2,160 s) and 00's bf16 matmul is timed once (5 s less a run).
TO_UNITS = ("test_faults.py::test_stop_profile_that_never_completes_keeps_the_traces_that_arrived",
            "test_faults.py::test_server_never_healthy_fails_its_phases_within_the_startup_timeout",
            "test_faults.py::test_disk_full_during_a_phase_keeps_the_finished_phases_and_says_failed",
            "test_faults.py::test_disk_full_at_the_manifest_ends_with_one_line_and_a_readable_manifest",
            "test_faults.py::test_disk_full_at_the_report_says_failed_and_leaves_no_report")
SERVERS = FAULTS + BESIDE_SERVERS + ALONE  # every module that starts a server, an sshd or probe ranks


def unit_modules() -> list[str]:
    """The modules of no lane above, in name order."""
    return sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in SERVERS)


def stage_argvs(pytest_args: list[str], basetemp_root: Path | None = None) -> list[dict[str, list[str]]]:
    """Each stage's lanes as pytest command lines, lane name -> argv.

    basetemp_root: each lane's --basetemp is a folder of its own under it (unless the arguments name one).
    Pytest keeps only the three newest numbered basetemps of a user and deletes the rest as each session
    starts. A LATE test reads a run directory under a stage-1 lane's basetemp. Three pytest sessions started
    meanwhile by anyone on the machine deleted it once (FileNotFoundError on its params.yaml)."""
    missing = [m for m in SERVERS + tuple(t.split("::")[0] for t in LATE + TO_UNITS) if not (TESTS / m).is_file()]
    if missing:
        raise SystemExit(f"tests/lanes.py names modules that are not in tests/: {', '.join(missing)}")
    pytest = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    def deselected(nodes: tuple[str, ...]) -> list[str]:
        # pytest matches --deselect against node ids as it names them, relative to the root directory
        return [f"--deselect={TESTS.name}/{t}" for t in nodes]
    late_out, moved_out = deselected(LATE), deselected(TO_UNITS)
    own = basetemp_root is not None and not any(a.startswith("--basetemp") for a in pytest_args)

    def temp(lane: str) -> list[str]:
        return [f"--basetemp={basetemp_root / lane}"] if own and basetemp_root is not None else []
    return [
        {"servers": pytest + [str(TESTS / m) for m in FAULTS] + moved_out + temp("servers") + pytest_args,
         "units": pytest + [str(TESTS / m) for m in unit_modules() + list(TO_UNITS) + list(BESIDE_SERVERS)]
         + late_out + temp("units") + pytest_args},
        {"alone": pytest + [str(TESTS / m) for m in ALONE] + [str(TESTS / t) for t in LATE] + temp("alone")
         + pytest_args},
    ]


# make test-fast selects no server, sshd, torchrun, browser, package build or process importing vLLM, so every
# module's selected tests split over two processes, one a core, in one stage. The ALONE modules' selected tests are
# unit tests against fake servers and the probes' own interpreters: they wait more than they compute, and a lone
# stage after the others left a core idle for that long (test-fast 3 min 39 s, 2026-12-07). The split's weights:
# each module's selected tests' seconds in one test-fast with mypy's cache warm, on this 2-core AVX2 host under
# its own two lanes, 2026-12-07; a module not listed counts FAST_DEFAULT_S. mypy with no cache (a fresh clone)
# adds MYPY_COLD_S to test_imports: one split for both left the lanes at 138 and 185 s once the cache was warm.
FAST_WEIGHT_S = {
    "test_trace_stream.py": 48.8, "test_telemetry.py": 27.4, "test_serving_client.py": 23.7,
    "test_compare_gate.py": 23.1, "test_trace_parse.py": 17.3, "test_compare.py": 17.0,
    "test_fixture_verdicts.py": 15.7, "test_imports.py": 14.8, "test_runner_report.py": 14.7,
    "test_speculative.py": 11.0, "test_vllm_gpu_kimi.py": 8.2, "test_critpath_chrome.py": 7.8,
    "test_stepmodel.py": 6.2, "test_critpath.py": 6.0, "test_step_model_page.py": 5.9,
    "test_vllm_gpu_hostops.py": 5.8, "test_procs.py": 5.6, "test_params.py": 4.9, "test_vllm_gpu.py": 4.4,
    "test_records.py": 3.8, "test_capture_window.py": 3.6, "test_spec_loo.py": 3.3, "test_attachguard.py": 2.9,
    "test_records_probe.py": 2.5,
}
FAST_DEFAULT_S = 1.0
MYPY_COLD_S = 40.0


def fast_weights(repo: Path) -> dict[str, float]:
    """FAST_WEIGHT_S, with MYPY_COLD_S on test_imports where mypy has no cache in `repo` yet."""
    cold = 0.0 if (repo / ".mypy_cache").is_dir() else MYPY_COLD_S
    return {**FAST_WEIGHT_S, "test_imports.py": FAST_WEIGHT_S["test_imports.py"] + cold}


def fast_argvs(pytest_args: list[str], basetemp_root: Path | None = None) -> list[dict[str, list[str]]]:
    """make test-fast's one stage: every module over two lanes at once, balanced by fast_weights (the
    heaviest first, each to the lighter lane)."""
    pytest = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    own = basetemp_root is not None and not any(a.startswith("--basetemp") for a in pytest_args)

    def temp(lane: str) -> list[str]:
        return [f"--basetemp={basetemp_root / lane}"] if own and basetemp_root is not None else []
    modules = sorted(p.name for p in TESTS.glob("test_*.py"))
    weight = fast_weights(TESTS.parent)
    lanes: dict[str, list[str]] = {"units-a": [], "units-b": []}
    load = dict.fromkeys(lanes, 0.0)
    for m in sorted(modules, key=lambda m: (-weight.get(m, FAST_DEFAULT_S), m)):
        lane = min(load, key=lambda k: (load[k], k))
        lanes[lane].append(m)
        load[lane] += weight.get(m, FAST_DEFAULT_S)
    return [{name: pytest + [str(TESTS / m) for m in sorted(ms)] + temp(name) + pytest_args
             for name, ms in lanes.items()}]


def _print_when_done(proc: subprocess.Popen, name: str, log) -> None:
    proc.wait()
    log.seek(0)
    sys.stdout.write(f"\n---- the {name} lane (exit status {proc.returncode}) ----\n{log.read()}"
                     f"---- end of the {name} lane ----\n")
    sys.stdout.flush()


def run_stage(lanes: dict[str, list[str]], env: dict[str, str], procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """The stage's lanes at once: the first writes to this terminal as it runs (its progress is the
    stage's), the others' output is kept and printed whole once each ends, so lines do not interleave."""
    names = list(lanes)
    with contextlib.ExitStack() as files:
        printers = []
        for name in names[1:]:
            log = files.enter_context(tempfile.TemporaryFile("w+"))  # one a lane: each is printed whole
            procs[name] = subprocess.Popen(lanes[name], stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                           cwd=TESTS.parent)
            printers.append(threading.Thread(target=_print_when_done, args=(procs[name], name, log), daemon=True))
            printers[-1].start()
        procs[names[0]] = subprocess.Popen(lanes[names[0]], env=env, cwd=TESTS.parent)
        codes = {name: procs[name].wait() for name in names}
        for t in printers:
            t.join(timeout=30)
    return codes


def machine_busy_s() -> float:
    """Seconds of CPU the whole machine spent busy since boot, over every core (/proc/stat: not idle, not
    iowait); 0 where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # the first 8 count (guest within)


def children_cpu_s() -> float:
    """User and system CPU seconds of the children waited for so far (theirs waited for by them included)."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def stage_cost_line(n: int, wall_s: float, suite_cpu_s: float, machine_cpu_s: float) -> str:
    """What a stage took, in the terms a time budget on this machine is set in: wall seconds and core-seconds
    (the suite's processes waited for; the machine's, everything on it included)."""
    cores = os.cpu_count() or 1
    return (f"stage {n}: {wall_s:,.0f} s wall; CPU {suite_cpu_s:,.0f} core-s of the suite's processes, "
            f"{machine_cpu_s:,.0f} core-s of the machine's ({machine_cpu_s / max(wall_s, 1e-9):.2f} of "
            f"{cores} cores busy)")


def main(argv: list[str]) -> int:
    codes: dict[str, int] = {}
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="decodescope-lanes-") as handoff:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{HANDOFF_ENV: handoff})
        try:
            fast = argv[:1] == ["--fast"]
            stages = fast_argvs(argv[1:], Path(handoff)) if fast else stage_argvs(argv, Path(handoff))
            for n, stage in enumerate(stages, 1):
                t0, cpu0, busy0 = time.monotonic(), children_cpu_s(), machine_busy_s()
                codes.update(run_stage(stage, env, procs))
                print(stage_cost_line(n, time.monotonic() - t0, children_cpu_s() - cpu0, machine_busy_s() - busy0),
                      flush=True)
        except KeyboardInterrupt:
            # the terminal's Ctrl-C reached the lanes too (one process group); wait for them to stop
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for p in procs.values():
                p.wait()
            return 130
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    print("lanes: " + ", ".join(f"{name} exit status {rc}" for name, rc in codes.items()))
    return lanes_status(codes)


def lanes_status(codes: dict[str, int]) -> int:
    """The first failing lane's status; a lane that selected no test (pytest's 5, e.g. under -k) is no
    failure while another ran some."""
    ran = {name: rc for name, rc in codes.items() if rc != NO_TESTS}
    if not ran:
        return NO_TESTS
    return next((rc for rc in ran.values() if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
