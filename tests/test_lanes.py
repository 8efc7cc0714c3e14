"""make test's stages and lanes (tests/lanes.py): every test module runs in exactly one lane, the modules that
time something run alone, a test deferred to the last stage runs there only, and the lanes' exit statuses
make one."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import lanes
from tests.conftest import Handoff
from tests.lanes import (ALONE, BESIDE_SERVERS, FAST_DEFAULT_S, FAST_WEIGHT_S, FAULTS, HANDOFF_ENV, LATE, NO_TESTS,
                         SERVERS, TESTS, TO_UNITS, fast_argvs, fast_weights, lanes_status, stage_argvs,
                         unit_modules)


def _modules(argv: list[str]) -> list[str]:
    return [Path(a).name for a in argv if a.endswith(".py")]


def test_every_test_module_runs_in_exactly_one_lane():
    stages = stage_argvs(["-q"])
    assert [sorted(s) for s in stages] == [["servers", "units"], ["alone"]]
    lanes = [argv for stage in stages for argv in stage.values()]
    ran = [m for argv in lanes for m in _modules(argv)]
    modules = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert sorted(ran) == modules  # each once
    assert _modules(stages[0]["servers"]) == list(FAULTS)
    assert _modules(stages[0]["units"]) == unit_modules() + list(BESIDE_SERVERS)
    assert _modules(stages[1]["alone"]) == list(ALONE)
    assert all(argv[-1] == "-q" for argv in lanes)


def test_make_test_fast_splits_every_module_over_two_lanes_by_weight_in_one_stage(tmp_path):
    stages = fast_argvs(["-m", "not integration"], tmp_path)
    assert [sorted(s) for s in stages] == [["units-a", "units-b"]]
    lanes = {name: _modules(argv) for stage in stages for name, argv in stage.items()}
    ran = [m for ms in lanes.values() for m in ms]
    assert sorted(ran) == sorted(p.name for p in TESTS.glob("test_*.py"))   # each once
    weight = fast_weights(TESTS.parent)
    load = {name: sum(weight.get(m, FAST_DEFAULT_S) for m in lanes[name]) for name in ("units-a", "units-b")}
    assert abs(load["units-a"] - load["units-b"]) <= max(weight.values())   # balanced as greedily as can be
    assert all(argv[-2:] == ["-m", "not integration"] for stage in stages for argv in stage.values())
    assert {a for stage in stages for argv in stage.values() for a in argv if a.startswith("--basetemp")} == {
        f"--basetemp={tmp_path / n}" for n in ("units-a", "units-b")}


def test_mypys_cold_cache_weighs_on_test_imports_only(tmp_path):
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    (warm / ".mypy_cache").mkdir(parents=True)
    cold.mkdir()
    assert fast_weights(warm) == FAST_WEIGHT_S
    assert fast_weights(cold) == {**FAST_WEIGHT_S, "test_imports.py": FAST_WEIGHT_S["test_imports.py"] + lanes.MYPY_COLD_S}


def test_each_lane_has_a_basetemp_of_its_own_that_no_other_pytest_session_prunes(tmp_path):
    """A run a stage-1 lane makes and a LATE test reads lives under that lane's basetemp: an explicit one,
    which pytest's pruning of numbered basetemps (three kept a user) never touches."""
    stages = stage_argvs(["-q"], tmp_path)
    temps = {name: [a for a in argv if a.startswith("--basetemp=")] for stage in stages for name, argv in stage.items()}
    assert temps == {name: [f"--basetemp={tmp_path / name}"] for name in ("servers", "units", "alone")}
    # a --basetemp of the caller's is left to pytest alone
    given = stage_argvs(["--basetemp=/tmp/x"], tmp_path)
    assert all([a for a in argv if a.startswith("--basetemp")] == ["--basetemp=/tmp/x"]
               for stage in given for argv in stage.values())
    # and pytest honours it: a session's tmp_path is under it
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_t(tmp_path):\n    print('TMP', tmp_path)\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(probe),
                        f"--basetemp={tmp_path / 'lane'}"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and f"TMP {tmp_path / 'lane'}" in r.stdout, r.stdout + r.stderr


@pytest.mark.integration  # a nested pytest collects the suite's heaviest module: make test, not test-fast
def test_a_late_test_is_left_out_of_its_modules_lane_and_runs_alone_after_the_end_to_end_run():
    stages = stage_argvs([])
    for node in LATE:
        module = node.split("::")[0]
        lane = next(argv for stage in stages for argv in stage.values() if str(TESTS / module) in argv)
        deselect = next(a for a in lane if a.startswith("--deselect=") and a.endswith(node))
        # pytest leaves it out: collected without it from the lane's arguments
        kept = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               str(TESTS / module), deselect], capture_output=True, text=True, cwd=TESTS.parent)
        assert kept.returncode == 0 and "1 deselected" in kept.stdout, kept.stdout[-2000:] + kept.stderr
        assert node.split("::")[1] not in kept.stdout
        alone = stages[1]["alone"]
        assert str(TESTS / node) in alone
        assert alone.index(str(TESTS / node)) > alone.index(str(TESTS / "test_integration_vllm.py"))
    # that each id names a real test is not collected again here (7 s of make test-fast's units lane): the
    # alone lane names it explicitly, and pytest ends a session with an error on an id that collects nothing


def test_a_test_moved_to_the_unit_lane_runs_there_once_before_the_runs_over_ssh():
    """TO_UNITS: each node is left out of its module's lane of servers (by the --deselect whose effect the test
    above shows) and named in the unit lane, after the unit modules and before BESIDE_SERVERS."""
    stages = stage_argvs([])
    servers, units = stages[0]["servers"], stages[0]["units"]
    assert TO_UNITS
    for node in TO_UNITS:
        assert str(TESTS / node.split("::")[0]) in servers and f"--deselect={TESTS.name}/{node}" in servers
        assert units.count(str(TESTS / node)) == 1 and not any(node in a for a in stages[1]["alone"])
        assert units.index(str(TESTS / node)) < units.index(str(TESTS / BESIDE_SERVERS[0]))
        assert units.index(str(TESTS / node)) > units.index(str(TESTS / unit_modules()[-1]))


def test_the_modules_that_start_a_vllm_server_or_an_sshd_run_in_a_lane_of_servers():
    """A module that launches a TP=2 engine, an sshd or a run is never among the unit tests; those that time
    something run alone, the lanes of servers hold at most one such module at a time each."""
    # an sshd, the embedded default's params or run, a fault test's run, `decodescope run` of its own
    calls = re.compile(r'\bSshd\(|\brun_e2e\(|\b_params\(|import [^\n]*\bRun\b|DECODESCOPE \+ \["run"')
    starts = {p.name for p in TESTS.glob("test_*.py") if p.name != "test_lanes.py" and calls.search(p.read_text())}
    assert starts and starts <= set(SERVERS), starts - set(SERVERS)
    assert not set(unit_modules()) & set(SERVERS)


def test_the_modules_that_time_something_or_read_every_process_run_alone():
    """Stage 1's modules assert statuses, files and leftovers of their own runs only; a module with a timing
    bound on a server or client (side by side, the step model, the probes' microseconds) or a check over every
    process or probe segment of the machine is in ALONE."""
    timing = re.compile(r"tpot_p50_us|projection_error_pct|SIDE_BY_SIDE|"
                        r"if \"decodescope\.(probes|serving\.remote)[a-z.]*\" in \" \"\.join|"
                        r"list\(Path\(\"/dev/shm\"\)\.glob\(\"decodescope-probe-\*\"\)\)")
    timed = {p.name for p in TESTS.glob("test_*.py") if p.name in SERVERS and timing.search(p.read_text())}
    assert timed and timed <= set(ALONE), timed - set(ALONE)
    assert {"test_integration_vllm.py", "test_experiments_vllm.py"} <= timed


def test_a_fixture_is_handed_from_one_process_to_another_through_the_named_directory(tmp_path):
    Handoff(tmp_path).save("over_ssh", {"run_dir": tmp_path / "run", "returncode": 0})
    code = (f"import os; os.environ['{HANDOFF_ENV}'] = {str(tmp_path)!r}\n"
            "from pathlib import Path; from tests.conftest import Handoff\n"
            "print(Handoff(Path(os.environ['" + HANDOFF_ENV + "'])).load('over_ssh'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS.parent)
    assert out.stdout.strip() == str({"run_dir": str(tmp_path / "run"), "returncode": 0}), out.stderr
    assert Handoff(None).load("over_ssh") is None and Handoff(tmp_path).load("nothing") is None
    Handoff(None).save("x", {"a": 1})  # no directory: nothing is written anywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["over_ssh.json"]
    assert json.loads((tmp_path / "over_ssh.json").read_text())["returncode"] == 0


def test_a_lane_that_selected_nothing_is_no_failure_while_another_ran():
    assert lanes_status({"servers": 0, "units": 0, "alone": 0}) == 0
    assert lanes_status({"servers": NO_TESTS, "units": 0, "alone": NO_TESTS}) == 0
    assert lanes_status({"servers": 1, "units": 0, "alone": 0}) == 1
    assert lanes_status({"servers": 0, "units": 0, "alone": 2}) == 2
    assert lanes_status({"servers": NO_TESTS, "units": NO_TESTS, "alone": NO_TESTS}) == NO_TESTS


def test_a_stages_cpu_counts_its_processes_and_the_machines_busy_time():
    """A child that spins for 0.5 s of CPU: the suite's count grows by about that once it is waited for,
    and the machine's busy time by at least as much (the line each stage of make test ends with)."""
    cpu0, busy0 = lanes.children_cpu_s(), lanes.machine_busy_s()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)
    cpu, busy = lanes.children_cpu_s() - cpu0, lanes.machine_busy_s() - busy0
    assert 0.5 <= cpu < 5 and busy >= 0.45  # the machine's ticks are 10 ms apart
    line = lanes.stage_cost_line(2, 10.0, 12.0, 19.0)
    assert line.startswith("stage 2: 10 s wall; CPU 12 core-s of the suite's processes, 19 core-s of the machine's")
    assert f"(1.90 of {os.cpu_count()} cores busy)" in line
