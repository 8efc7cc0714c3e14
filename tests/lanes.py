"""`make test` on two cores: two pytest processes at once, one lane each.

The serial lane runs, one module after another in SERIAL's order, every test module that starts a vLLM
server, an sshd or probe ranks of its own, or times something (a client's TPOT, a probe's microseconds):
only one vLLM server runs at a time, as two cores hold one TP=2 engine. It opens with the tests that assert
statuses, files and what is left running, which hold with unit tests beside them; the tests that time the
engine or a client come after, when the other lane is long done. The other lane runs everything else
(parsing, records, reports, packaging, type checks) beside it.

Two processes rather than pytest-xdist's groups: with pytest 9.2, xdist 3.8's `--dist loadgroup` no longer
groups (it renames `item._nodeid`, which pytest no longer reads), and both workers started servers at once.

    python -m tests.lanes [pytest arguments for both lanes]

The serial lane writes to the terminal as it runs; the beside lane's output comes whole once it ends. The exit
status is the first failing lane's.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

TESTS = Path(__file__).resolve().parent
NO_TESTS = 5  # pytest's exit status when no test was selected
SERIAL = ("test_faults.py", "test_host_ssh.py",
          "test_integration_vllm.py", "test_integration_ssh.py", "test_experiments_vllm.py", "test_probes.py",
          "test_stepmodel.py", "test_engine_comm.py", "test_serving_client.py", "test_telemetry.py")


def lane_argvs(pytest_args: list[str]) -> dict[str, list[str]]:
    """The two lanes' pytest command lines: the serial modules in order, and the rest of tests/."""
    missing = [m for m in SERIAL if not (TESTS / m).is_file()]
    if missing:
        raise SystemExit(f"tests/lanes.py SERIAL names modules that are not in tests/: {', '.join(missing)}")
    pytest = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    serial = pytest + [str(TESTS / m) for m in SERIAL] + pytest_args
    beside = pytest + [str(TESTS)] + [f"--ignore={TESTS / m}" for m in SERIAL] + pytest_args
    return {"serial": serial, "beside": beside}


def _print_when_done(proc: subprocess.Popen, log) -> None:
    proc.wait()
    log.seek(0)
    sys.stdout.write(f"\n---- the beside lane (exit status {proc.returncode}) ----\n{log.read()}---- end of the beside lane ----\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """The serial lane writes to this terminal as it runs (its progress is the suite's); the beside lane's
    output is kept and printed whole once it ends, so the two do not interleave line by line."""
    argvs = lane_argvs(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryFile("w+") as log:
        try:
            procs["beside"] = subprocess.Popen(argvs["beside"], stdout=log, stderr=subprocess.STDOUT, text=True,
                                               env=env, cwd=TESTS.parent)
            printer = threading.Thread(target=_print_when_done, args=(procs["beside"], log), daemon=True)
            printer.start()
            procs["serial"] = subprocess.Popen(argvs["serial"], env=env, cwd=TESTS.parent)
            codes = {name: procs[name].wait() for name in ("serial", "beside")}
            printer.join(timeout=30)
        except KeyboardInterrupt:
            # the terminal's Ctrl-C reached both lanes too (one process group); wait for them to stop
            for p in procs.values():
                p.send_signal(signal.SIGINT)
            for p in procs.values():
                p.wait()
            return 130
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    print(f"lanes: serial exit status {codes['serial']}, beside exit status {codes['beside']}")
    return lanes_status(codes)


def lanes_status(codes: dict[str, int]) -> int:
    """The first failing lane's status; a lane that selected no test (pytest's 5, e.g. under -k) is no
    failure while the other ran some."""
    ran = {name: rc for name, rc in codes.items() if rc != NO_TESTS}
    if not ran:
        return NO_TESTS
    return next((rc for rc in ran.values() if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
