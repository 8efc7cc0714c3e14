"""The fault table (docs/faults.md) from what tests/test_faults.py measured (outputs/fault_table.json), each row
with its figures on a quiet host and on a loaded one (one busy loop a core, outside the run).

    python benchmarks/fault_table.py [--json outputs/fault_table.json] [--readme docs/faults.md]
    python benchmarks/fault_table.py --run [--tests tests/test_x.py] [-k EXPR] [--json FILE] [--readme docs/faults.md]

Prints the table; with --readme, replaces the block between the fault-table markers in the README. With
--run, first runs the fault tests selected by -k (default: the probe interrupted at each point of its life,
quiet and loaded, which the test parametrizes itself), then once more with DECODESCOPE_FAULT_LOAD=1 (every
other selected fault injected beside busy loops, for the whole pytest session: module fixtures too), each
writing its figures into --json. --tests names the module (default tests/test_faults.py; the other fault rows are
in tests/test_attach.py, test_host_ssh.py, test_integration_ssh.py, test_integration_vllm.py and
test_hostile_input.py); arguments it does not know go to pytest (e.g. --cpu-path=avx2).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- fault-table:start -->", "<!-- fault-table:end -->"
DEFAULT_K = "interrupted_probe"
DEFAULT_TESTS = "tests/test_faults.py"
SELF_LOADED = "interrupted_probe"
NO_TESTS = 5  # pytest's exit status when -k selected nothing


def _figures(row: dict, load: str) -> dict | None:
    """A row's quiet or loaded figures; a row written before rows had both is its quiet one."""
    if "quiet" in row or "loaded" in row:
        return row.get(load)
    return row if load == "quiet" else None


def _left(m: dict | None) -> str:
    if m is None:
        return "not run"
    return f"{m.get('processes_left', '')} / {m.get('shm_files_left', '')}"


def _stop(m: dict | None) -> str:
    if m is None:
        return "–"
    per = m.get("stop_s_per_point") or m.get("stop_s_per_phase")
    main = m.get("detect_and_stop_s", "–")
    if per and len(per) > 1:
        return f"{main} (max of {', '.join(f'{k} {v}' for k, v in per.items())})"
    return str(main)


def table(faults: dict) -> str:
    lines = ["| fault (injected for real) | what decodescope guarantees | exit | results lost | "
             "quiet: processes / shm files left | quiet: detect + stop (s) | "
             "loaded: processes / shm files left | loaded: detect + stop (s) | recover (s), quiet / loaded |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fault, row in faults.items():
        quiet, loaded = _figures(row, "quiet"), _figures(row, "loaded")
        any_ = quiet or loaded or {}
        recover = " / ".join(str(m["recover_s"]) for m in (quiet, loaded) if m and "recover_s" in m) or "–"
        lines.append(f"| {fault} | {row['guarantee']} | {any_.get('rc', '')} | {any_.get('results_lost', '')} | "
                     f"{_left(quiet)} | {_stop(quiet)} | {_left(loaded)} | {_stop(loaded)} | {recover} |")
    return "\n".join(lines)


def run_tests(k: str, json_path: Path, extra: list[str], tests: str = DEFAULT_TESTS) -> int:
    """The selected fault tests quiet, then loaded; returns the worse exit status."""
    worst = 0
    for loaded in (False, True):
        env = dict(os.environ, DECODESCOPE_FAULT_TABLE=str(json_path), DECODESCOPE_FAULT_LOAD="1" if loaded else "0")
        # the interrupted probe's test is parametrized quiet and loaded itself: its cases run in the first pass
        sel = f"({k}) and not {SELF_LOADED}" if loaded else k
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(REPO / tests), "-k", sel, *extra], env=env, cwd=REPO)
        rc = 0 if rc == NO_TESTS else rc
        print(f"fault tests {'loaded' if loaded else 'quiet'} ({tests} -k {k!r}): exit {rc} in {time.monotonic() - t0:.0f} s",
              flush=True)
        worst = worst or rc
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(REPO / "outputs" / "fault_table.json"))
    ap.add_argument("--readme")
    ap.add_argument("--run", action="store_true", help="run the selected fault tests quiet and loaded first")
    ap.add_argument("--tests", default=DEFAULT_TESTS, help="the test module holding the rows; default: %(default)s")
    ap.add_argument("-k", default=DEFAULT_K, help="the fault tests to run (pytest -k); default: %(default)s")
    args, extra = ap.parse_known_args()
    rc = run_tests(args.k, Path(args.json), extra, args.tests) if args.run else 0
    faults = json.loads(Path(args.json).read_text())
    text = table(faults)
    print(text)
    if args.readme:
        readme = Path(args.readme)
        body = readme.read_text()
        block = f"{START}\n{text}\n{END}"
        body, n = re.subn(re.escape(START) + ".*?" + re.escape(END), lambda _: block, body, flags=re.S)
        if n != 1:
            raise SystemExit(f"{readme}: no {START} ... {END} block to fill")
        readme.write_text(body)
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
