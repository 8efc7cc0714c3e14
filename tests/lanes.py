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

Each line of output is prefixed with its lane; the exit status is the first failing lane's.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def _pump(name: str, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def main(argv: list[str]) -> int:
    argvs = lane_argvs(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lock = threading.Lock()
    procs: dict[str, subprocess.Popen] = {}
    pumps = []
    try:
        for name, cmd in argvs.items():
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=env, cwd=TESTS.parent)
            pumps.append(threading.Thread(target=_pump, args=(name, procs[name].stdout, lock), daemon=True))
            pumps[-1].start()
        codes = {name: p.wait() for name, p in procs.items()}
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
    for t in pumps:
        t.join(timeout=10)
    for name, rc in codes.items():
        print(f"[{name}] exit status {rc}")
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
