"""Where a `make test` spends the machine's CPU: every process sampled from /proc once a second while the suite
runs, then summed by kind of process (vLLM's API server, its engine core and workers, probes, notebook
kernels, inductor's compiler, ...) and by the test that started it (PYTEST_CURRENT_TEST, which a process
inherits from the pytest process that started it; processes started through the test sshd carry none).

    python benchmarks/suite_cpu.py sample OUT.json &      # beside `make test`; SIGTERM ends it (one dump a minute)
    python benchmarks/suite_cpu.py report OUT.json [REF.json]

report prints the kinds, then the tests, by CPU; with REF, each line's figure beside the reference's and the
change. A process's CPU is its own user + system time at its last sample, so one shorter than a second (a
compiler run, a `python -c`) or the last second of one is missed: the totals are below the machine's
(tests/lanes.py prints that per stage), by ~10% on a suite of ~3,200 core-s.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

# decodescope.core.io is the standard library only: the system python3 that samples a fresh clone's suite,
# started before its .venv exists, imports it from lib/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from decodescope.core.io import write_text_atomic  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")
# (kind, a substring of the command line), the first that matches names the process
KINDS = (
    ("pip install", "pip install"), ("lanes", "tests.lanes"), ("pytest", "-m pytest"),
    ("vLLM API server", "vllm.entrypoints"), ("vLLM engine core / worker", "multiprocessing.spawn"),
    ("vllm bench client", "vllm.benchmarks"), ("notebook kernel", "ipykernel"),
    ("inductor's compiler", "cc1plus"), ("inductor's compiler", "/usr/bin/ld"),
    ("load spinner", "while True: pass"), ("decodescope run", "decodescope.cli.main run"),
    ("probe", "decodescope.probes"), ("torchrun", "torchrun"), ("torchrun", "torch.distributed.run"),
    ("telemetry", "decodescope.serving.telemetry"), ("host agent", "decodescope.exec.hostagent"),
    ("chromium", "chrom"), ("ssh / sshd", "ssh"), ("mypy", "mypy"),
)


def kind_of(cmdline: str) -> str:
    return next((kind for kind, needle in KINDS if needle in cmdline), "other")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sample(out: str, period_s: float = 1.0) -> None:
    """Until SIGTERM: per process (pid and start time) its command line, test, CPU at first and last sight."""
    seen: dict[str, dict] = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    n = 0
    while not stop:
        now = time.time()
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                stat = _read(f"/proc/{d}/stat").decode()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / HZ
            entry = seen.get(f"{d}:{fields[19]}")
            if entry is None:
                try:
                    cmd = _read(f"/proc/{d}/cmdline").replace(b"\0", b" ")[:300].decode(errors="replace")
                    env = _read(f"/proc/{d}/environ").split(b"\0")
                except OSError:
                    cmd, env = "", []
                test = next((kv[20:].decode(errors="replace") for kv in env
                             if kv.startswith(b"PYTEST_CURRENT_TEST=")), "")
                entry = seen[f"{d}:{fields[19]}"] = {"cmd": cmd, "test": test.split(" ")[0], "first_s": now,
                                                     "cpu_first_s": cpu_s}
            entry["cpu_s"], entry["last_s"] = cpu_s, now
        n += 1
        if n % 60 == 0 or stop:
            _dump(out, seen)
        time.sleep(period_s)
    _dump(out, seen)


def _dump(out: str, seen: dict) -> None:
    write_text_atomic(Path(out), json.dumps(seen))


def totals(path: str) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """(CPU by kind, CPU by test, processes by kind), core-seconds; a process seen at the first sample counts
    only what it used after it (the machine's own daemons, a shell that started the suite)."""
    seen = json.loads(open(path).read())
    t0 = min(e["first_s"] for e in seen.values())
    by_kind: dict[str, float] = defaultdict(float)
    by_test: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in seen.values():
        used = e["cpu_s"] - (e["cpu_first_s"] if e["first_s"] <= t0 + 1.5 else 0.0)
        k = kind_of(e["cmd"])
        by_kind[k] += used
        count[k] += 1
        by_test[e["test"] or "(no test: the lanes, pytest itself, the sshd's, the machine's)"] += used
    return dict(by_kind), dict(by_test), dict(count)


def _table(now: dict[str, float], ref: dict[str, float] | None, top: int) -> list[str]:
    keys = sorted(set(now) | set(ref or {}), key=lambda k: -now.get(k, 0.0))[:top]
    lines = []
    for k in keys:
        if ref is None:
            lines.append(f"{now.get(k, 0.0):8.0f}  {k}")
        else:
            a, b = ref.get(k, 0.0), now.get(k, 0.0)
            lines.append(f"{a:8.0f} {b:8.0f} {b - a:+8.0f}  {k}")
    total_now, total_ref = sum(now.values()), sum((ref or {}).values())
    lines.append(f"{total_now:8.0f}  total" if ref is None else f"{total_ref:8.0f} {total_now:8.0f} "
                 f"{total_now - total_ref:+8.0f}  total ({total_now / total_ref:.2f} of the reference)")
    return lines


def report(path: str, ref_path: str | None = None, top: int = 25) -> str:
    kinds, tests, count = totals(path)
    ref_kinds, ref_tests = totals(ref_path)[:2] if ref_path else (None, None)
    head = "core-s" if ref_path is None else "   ref      now   change (core-s)"
    out = [f"# {path}" + (f" against {ref_path}" if ref_path else ""), f"## by kind of process ({head})"]
    out += _table(kinds, ref_kinds, top)
    out += [f"## by test ({head})"] + _table(tests, ref_tests, top)
    by_count = sorted(count.items(), key=lambda kv: -kv[1])
    out.append("## processes seen by kind: " + ", ".join(f"{k} {n}" for k, n in by_count))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "sample":
        sample(argv[1])
        return 0
    if len(argv) in (2, 3) and argv[0] == "report":
        print(report(argv[1], argv[2] if len(argv) == 3 else None))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
