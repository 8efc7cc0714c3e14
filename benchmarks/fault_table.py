"""The fault table (docs/faults.md) from what tests/test_faults.py measured (outputs/fault_table.json).

    python benchmarks/fault_table.py [--json outputs/fault_table.json] [--readme docs/faults.md]

Prints the table; with --readme, replaces the block between the fault-table markers in the README.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- fault-table:start -->", "<!-- fault-table:end -->"


def table(faults: dict) -> str:
    lines = ["| fault (injected for real) | what decodescope guarantees | exit | results lost | processes left | "
             "shm files left | detect + stop (s) | recover (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for fault, m in faults.items():
        lines.append(f"| {fault} | {m['guarantee']} | {m.get('rc', '')} | {m.get('results_lost', '')} | "
                     f"{m.get('processes_left', '')} | {m.get('shm_files_left', '')} | "
                     f"{m.get('detect_and_stop_s', '–')} | {m.get('recover_s', '–')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(REPO / "outputs" / "fault_table.json"))
    ap.add_argument("--readme")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
