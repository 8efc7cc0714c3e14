"""make test's two lanes (tests/lanes.py): every test module runs in exactly one, the serial one in its
order, and the lanes' exit statuses make one."""
import re
from pathlib import Path

from tests.lanes import NO_TESTS, SERIAL, TESTS, lane_argvs, lanes_status


def test_every_test_module_runs_in_exactly_one_lane():
    argvs = lane_argvs(["-q"])
    serial = [Path(a).name for a in argvs["serial"] if a.endswith(".py")]
    ignored = {Path(a.removeprefix("--ignore=")).name for a in argvs["beside"] if a.startswith("--ignore=")}
    assert serial == list(SERIAL) and ignored == set(SERIAL)
    assert str(TESTS) in argvs["beside"] and argvs["serial"][-1] == argvs["beside"][-1] == "-q"
    modules = {p.name for p in TESTS.glob("test_*.py")}
    assert set(SERIAL) <= modules


def test_the_modules_that_start_a_vllm_server_or_an_sshd_run_in_the_serial_lane():
    """Two TP=2 engines on two cores would each time the other: a module that launches one is serial."""
    # an sshd, the embedded default's params or run, a fault test's run, `decodescope run` of its own
    calls = re.compile(r'\bSshd\(|\brun_e2e\(|\b_params\(|import [^\n]*\bRun\b|DECODESCOPE \+ \["run"')
    starts = {p.name for p in TESTS.glob("test_*.py") if p.name != "test_lanes.py" and calls.search(p.read_text())}
    assert starts and starts <= set(SERIAL), starts - set(SERIAL)


def test_a_lane_that_selected_nothing_is_no_failure_while_the_other_ran():
    assert lanes_status({"serial": 0, "beside": 0}) == 0
    assert lanes_status({"serial": NO_TESTS, "beside": 0}) == 0
    assert lanes_status({"serial": 1, "beside": 0}) == 1 and lanes_status({"serial": 0, "beside": 2}) == 2
    assert lanes_status({"serial": NO_TESTS, "beside": NO_TESTS}) == NO_TESTS
