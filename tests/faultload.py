"""The fault table's shared parts for every module that injects a fault (tests/test_faults.py, test_attach.py,
test_host_ssh.py, test_integration_ssh.py, test_integration_vllm.py, test_hostile_input.py): where each fault's
figures go (record_fault, outputs/fault_table.json, rendered by benchmarks/fault_table.py) and the busy host a
loaded row is measured on (busy_host).

DECODESCOPE_FAULT_LOAD=1: the whole pytest session runs beside one busy loop a core (tests/conftest.py's
_fault_load, session-scoped, so a fault injected inside a module's or the session's fixture is injected loaded
too) and every fault is recorded as its row's loaded figures; =outside: the caller holds the cores busy itself
(busy loops around the whole pytest) and the figures are recorded as loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT_TABLE = Path(os.environ.get("DECODESCOPE_FAULT_TABLE", REPO / "outputs" / "fault_table.json"))
FAULT_LOAD_ENV = "DECODESCOPE_FAULT_LOAD"
FAULT_LOAD = os.environ.get(FAULT_LOAD_ENV, "") not in ("", "0")
FAULT_LOAD_HERE = FAULT_LOAD and os.environ.get(FAULT_LOAD_ENV) != "outside"


def record_fault(fault: str, guarantee: str, load: str | None = None, **measured) -> None:
    """Merge one fault's measured figures into the fault table file, under the row's "quiet" or "loaded"
    figures (`load`; by default as DECODESCOPE_FAULT_LOAD says); under a lock, as the two pytest workers of
    `make test` may each record one at once."""
    from decodescope.core.io import write_text_atomic

    load = load or ("loaded" if FAULT_LOAD else "quiet")
    FAULT_TABLE.parent.mkdir(parents=True, exist_ok=True)
    with open(FAULT_TABLE.with_name(FAULT_TABLE.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = json.loads(FAULT_TABLE.read_text()) if FAULT_TABLE.is_file() else {}
        row = table.get(fault, {})
        if "quiet" not in row and "loaded" not in row:  # a row written before rows had both figures: quiet
            row = {"guarantee": row.get("guarantee", guarantee),
                   **({"quiet": {k: v for k, v in row.items() if k != "guarantee"}} if row else {})}
        row["guarantee"] = guarantee
        row[load] = {**measured, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        table[fault] = row
        write_text_atomic(FAULT_TABLE, json.dumps(table, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def busy_host(n: int | None = None):
    """One busy loop a core (os.cpu_count()), in a process group of their own outside any run (no run id, no
    run token): the host a user's run meets when it serves or shares a CI runner."""
    from decodescope.exec import procs
    from decodescope.exec.hostcore import RUN_ID_ENV

    env = {k: v for k, v in os.environ.items() if k not in (RUN_ID_ENV, procs.RUN_TOKEN_ENV)}
    loops = [subprocess.Popen(["python3", "-c", "while True: pass"], env=env, start_new_session=True)
             for _ in range(n or os.cpu_count() or 1)]
    try:
        yield loops
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
