"""Per-module wall time of a pytest run, from its `--durations=0` lines (setup + call + teardown of every
test, module-scoped fixtures included in the first test that needs them):

    python -m pytest --durations=0 ... > run.log
    python benchmarks/test_durations.py run.log [more.log ...]

Prints one line per module, slowest first, then the total and the run's own summary line.
"""
from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+?)::")
SUMMARY = re.compile(r"\d+ (passed|failed|error).* in [0-9.]+s")


def per_module(lines) -> tuple[dict[str, float], list[str]]:
    sums: dict[str, float] = defaultdict(float)
    summaries = []
    for line in lines:
        m = LINE.match(line)
        if m:
            sums[m.group(3)] += float(m.group(1))
        elif SUMMARY.search(line):
            summaries.append(line.strip().strip("= "))
    return dict(sums), summaries


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, errors="replace") as f:
            sums, summaries = per_module(f)
        print(f"# {path}")
        for module, s in sorted(sums.items(), key=lambda kv: -kv[1]):
            print(f"{s:9.1f} s  {module}")
        print(f"{sum(sums.values()):9.1f} s  total of the durations")
        for line in summaries:
            print(f"           {line}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
