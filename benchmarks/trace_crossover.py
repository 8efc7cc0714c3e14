"""Where more processes start to pay, for decodescope.trace.load's two thresholds, on this machine.

- rank files in processes of their own (FILES_IN_PROCESSES_MIN_BYTES): a directory of two rank files
  read with every file in this process vs one file here and one in a forked worker;
- one file's chunks in worker processes (FILE_POOL_MIN_BYTES): one rank file read by this process
  alone (its decompression in a thread) vs its chunks handed to `cores` workers;
- with --stream, the streamed breakdown's rank files in threads (breakdown.breakdown_dir, each file
  reduced in C, creduce.py): the directory reduced one file after the other (workers=1) vs every file
  in a thread of its own at once; the rules and the C library are loaded before the clock;
- with --stream-numpy, its numpy fallback's threshold (stream.STREAM_PROCESSES_MIN_BYTES, the C reduction
  turned off): every file here vs one file here and one in a forked worker (a worker sends back per-name
  sums, not columns).

Each timing is a fresh interpreter (imports done before the clock starts, pandas included, so only the
reading and the table are timed), the median of --repeat runs; the load average is printed with it.

python benchmarks/trace_crossover.py DIR [DIR ...] [--repeat 5] [--out results.txt]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import sys, time, json
sys.path.insert(0, sys.argv[1])
import pandas  # imported before the clock: the same in both modes
from decodescope.trace import load, parse
mode, target = sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
with parse.small_pages():
    if mode in ("one-process", "per-rank-processes"):
        load.FILES_IN_PROCESSES_MIN_BYTES = 0 if mode == "per-rank-processes" else 1 << 62
        rows = len(load.load_trace_dir(target).events)
    else:
        cols, meta = parse.parse_columns(target, workers=1 if mode == "file-alone" else int(sys.argv[4]))
        rows = len(cols.frame())
print(json.dumps({"wall_s": time.perf_counter() - t0, "rows": rows}))
"""
STREAM_CHILD = """
import sys, time, json
sys.path.insert(0, sys.argv[1])
from decodescope.trace import breakdown, creduce, cscan, stream
from decodescope.trace.categorize import default_rules
default_rules(), cscan.library()  # loaded before the clock: the same in both modes
mode, target = sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if mode in ("one-process", "per-rank-processes"):  # the numpy fallback
    creduce.available = lambda: False
    stream.STREAM_PROCESSES_MIN_BYTES = 0 if mode == "per-rank-processes" else 1 << 62
b = breakdown.breakdown_dir(target, workers=1 if mode == "one-thread" else None)
print(json.dumps({"wall_s": time.perf_counter() - t0, "rows": sum(v["rows"] for p in b.names.values() for v in p.values())}))
"""


def timed(mode: str, target: Path, repeat: int, cores: int, child: str = CHILD) -> float:
    walls = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", child, str(REPO / "lib"), mode, str(target), str(cores)],
                             capture_output=True, text=True, check=True).stdout
        walls.append(json.loads(out)["wall_s"])
    walls.sort()
    return walls[len(walls) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="directories of two rank files each (e.g. the benchmark's set)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--stream", action="store_true", help="the streamed breakdown's rank threads only")
    ap.add_argument("--stream-numpy", action="store_true", help="its numpy fallback's rank processes only")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "lib"))
    from decodescope.trace.load import find_trace_files
    from decodescope.trace.reader import json_size

    cores = os.cpu_count() or 1
    lines = [f"{cores} cores; median of {args.repeat} fresh interpreters each; seconds to read and build the table.",
             "", "| trace | rank files | JSON MB | load | one process | per-rank processes | gain | "
             "one file alone | its chunks in workers | gain |", "|---|---|---|---|---|---|---|---|---|---|"]
    modes = (("one-thread", "per-rank-threads") if args.stream else
             ("one-process", "per-rank-processes") if args.stream_numpy else None)
    if modes:
        lines[0] = (f"{cores} cores; median of {args.repeat} fresh interpreters each; seconds to reduce the directory "
                    "(breakdown.breakdown_dir" + (", the numpy fallback" if args.stream_numpy else ", in C") + ").")
        lines[2:] = [f"| trace | rank files | JSON MB | load | {modes[0]} | {modes[1]} | gain |",
                     "|---|---|---|---|---|---|---|"]
    for d in map(Path, args.dirs):
        files, _ = find_trace_files(d)
        mb = sum(json_size(f) for f in files) / 1e6
        load = os.getloadavg()[0]
        if modes:
            one = timed(modes[0], d, args.repeat, cores, STREAM_CHILD)
            per = timed(modes[1], d, args.repeat, cores, STREAM_CHILD)
            lines.append(f"| {d.name} | {len(files)} | {mb:.0f} | {load:.2f} | {one:.3f} | {per:.3f} | {one / per:.2f}x |")
            print(lines[-1], flush=True)
            continue
        one, per = timed("one-process", d, args.repeat, cores), timed("per-rank-processes", d, args.repeat, cores)
        alone, pool = timed("file-alone", files[0], args.repeat, cores), timed("file-pool", files[0], args.repeat, cores)
        lines.append(f"| {d.name} | {len(files)} | {mb:.0f} | {load:.2f} | {one:.3f} | {per:.3f} | {one / per:.2f}x | "
                     f"{alone:.3f} ({json_size(files[0]) / 1e6:.0f} MB) | {pool:.3f} | {alone / pool:.2f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
