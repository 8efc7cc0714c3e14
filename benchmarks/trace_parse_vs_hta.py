"""Benchmark: decodescope's trace parse + category breakdown against HolisticTraceAnalysis (HTA).

Same traces, side by side from one benchmark process: each tool runs in a child process of its own, HTA
as `TraceAnalysis(trace_dir=...)` then `get_gpu_kernel_breakdown()`; ours (--ours) as
`decodescope analyze-trace DIR --breakdown` (stream: each chunk reduced into per-name sums as it is read,
no event table; the default), or as `load_trace_dir` + `op_table` + `category_breakdown` (table: what
the full analysis builds first). Both with their default parallelism (per-rank processes, or none, from
the files' sizes) and numpy's huge-page requests off (decodescope.trace.parse.small_pages). Per trace
set it reports:

- wall: from spawning the child to its exit, median of --repeat runs (HTA: --hta-repeat runs);
- MB/s: decompressed JSON bytes of the rank files / wall;
- peak memory: the peak of the summed PSS (proportional set size: pages shared by forked workers are
  split between them) of the child's whole process tree, sampled every 50 ms (PSS_SAMPLE_S);
- start-up: from spawning our child to the end of its imports, before a byte is parsed (median), and,
  once per session, `python -X importtime` of the same imports (the heaviest modules in the JSON);
- the gunzip limit: `zcat FILE > /dev/null` of every rank file, as many at once as there are cores
  (ours parses rank files in parallel the same way), and our wall as a multiple of it;
- the load average (1 min) before each timing: other work on the machine shows there.

Correctness: our per-name total durations must equal an independent sum over the raw JSON events
(json.load), on every trace.

The trace sets: directories given on the command line, and with --set the standard set, made once and
cached under --cache by benchmarks/trace_set.py from two real captures: the embedded default's vLLM CPU
TP=2 traces (`--cpu-capture`, default: the newest outputs/*/traces) and the GPU step replay's traces
(tests/fixtures/traces/h200x2_step_replay_graph), their decode steps repeated to 20 MB .. 1 GB of JSON
(see that file), plus the captures as they are.

HTA runs in its own virtual environment (`pip install HolisticTraceAnalysis`; HTA 0.5 needs pandas<2.3):
give its python with --hta-python or $HTA_PYTHON.

python benchmarks/trace_parse_vs_hta.py [DIR ...] [--set] [--out results.json] [--table results.txt]
       [--no-hta] [--hta-python PATH] [--repeat 3] [--lib PATH]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "lib"))

HTA_CHILD = """
import sys
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
kt, kernels = a.get_gpu_kernel_breakdown(visualize=False)
print("rows", len(kernels))
"""

# argv: trace dir, result json, lib dir. Imports what parsing needs, notes the time (start-up ends
# there), then what the results need, as `decodescope analyze-trace` does.
OURS_IMPORTS = """
import sys, time
sys.path.insert(0, sys.argv[3])
from decodescope.trace.load import load_trace_dir
"""
OURS_CHILD = OURS_IMPORTS + """
ready = time.time()
import contextlib, json
try:  # as `decodescope analyze-trace` runs (absent from the version before it)
    from decodescope.trace.parse import small_pages
except ImportError:
    small_pages = contextlib.nullcontext
with small_pages():
    loaded = load_trace_dir(sys.argv[1])
    from decodescope.trace.analyze import op_table, category_breakdown
    ops = op_table(loaded.events)
    bd = category_breakdown(ops)
    totals = {str(k): v for k, v in ops.groupby("name", observed=True)["dur_us"].sum().items()}
json.dump({"ready": ready, "device": ops.attrs["device"], "totals": totals, "categories": len(bd),
           "kept": int(len(loaded.events)),
           "other_share": float(bd.loc[bd["category"].astype(str) == "other", "time_us"].sum() / bd["time_us"].sum())},
          open(sys.argv[2], "w"))
"""
# the critical path (trace/critpath*.py) on the same table: what the table child builds, then each step's
# path, the shares beside the summed ones and the bounds (up to 32 decode steps replayed per category)
OURS_CRITPATH_CHILD = OURS_IMPORTS + """
ready = time.time()
import contextlib, json
from decodescope.trace.parse import small_pages
with small_pages():
    loaded = load_trace_dir(sys.argv[1])
    from decodescope.trace.analyze import op_table, category_breakdown, find_steps
    from decodescope.critpath.table import critical_paths
    from decodescope.critpath.summary import attribution, fix_bounds
    ops = op_table(loaded.events)
    bd = category_breakdown(ops)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    shares = attribution(cp, ops)
    fixes = fix_bounds(cp)
    totals = {str(k): v for k, v in ops.groupby("name", observed=True)["dur_us"].sum().items()}
json.dump({"ready": ready, "device": ops.attrs["device"], "totals": totals, "categories": len(bd),
           "kept": int(len(loaded.events)), "steps": len(cp.windows), "segments": len(cp.segments),
           "other_share": float(bd.loc[bd["category"].astype(str) == "other", "time_us"].sum() / bd["time_us"].sum())},
          open(sys.argv[2], "w"))
"""
# `decodescope analyze-trace DIR --breakdown` (breakdown.py: reduced in C as read, no table), as a user runs it;
# then its breakdown.json read back for the per-name check (a few hundred names: not timed apart).
OURS_STREAM_IMPORTS = """
import sys, time
sys.path.insert(0, sys.argv[3])
from decodescope.cli.main import main
from decodescope.trace import breakdown, creduce
"""
OURS_STREAM_CHILD = OURS_STREAM_IMPORTS + """
ready = time.time()
import json
out = sys.argv[2] + ".d"
rc = main(["analyze-trace", sys.argv[1], "--breakdown", "--out", out])
if rc:
    sys.exit(rc)
from decodescope.trace.breakdown_file import BreakdownFile
b = BreakdownFile.read(out + "/breakdown.json")
totals = {}
for per in b.names.values():
    for n, v in per.items():
        totals[n] = totals.get(n, 0.0) + v["dur_us"]
time_us = sum(r["time_us"] for r in b.categories)
json.dump({"ready": ready, "device": b.device, "totals": totals, "categories": len(b.categories),
           "kept": sum(v["rows"] for per in b.names.values() for v in per.values()),
           "other_share": sum(r["time_us"] for r in b.categories if r["category"] == "other") / time_us},
          open(sys.argv[2], "w"))
"""
# what each of ours runs: (child, its imports before a byte is parsed, the command's own start-up argv)
OURS = {"stream": (OURS_STREAM_CHILD, OURS_STREAM_IMPORTS, ["--breakdown"]),
        "table": (OURS_CHILD, OURS_IMPORTS, []),
        "critpath": (OURS_CRITPATH_CHILD, OURS_IMPORTS, ["--critical-path"])}
# the command itself, up to where it would read the first file (a directory that is not there)
CLI_STARTUP = """
import sys
sys.path.insert(0, sys.argv[1])
from decodescope.cli.main import main
sys.exit(main(["analyze-trace", "/nonexistent-trace-dir"] + sys.argv[2:]))
"""


def _tree_pss_mb(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            # PSS: pages shared by forked workers are split between them, not counted once per process
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 1e6


PSS_SAMPLE_S = 0.05  # reading smaps_rollup walks the page tables under the mm lock: every 10 ms slowed
                    # a 1 GB run by 20%, every 50 ms by 3% (and found the same peak)


def run_child(python: str, code: str, args: list[str]) -> dict:
    """Wall time and peak summed PSS of the whole process tree (sampled every PSS_SAMPLE_S) of one
    tool's run. (Not the kernel's peak RSS from wait4: a child forked from this process, grown by the
    json.load reference, starts with this process's high-water mark.)"""
    import tempfile
    import threading

    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    spawn = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-c", code, *args], stdout=out, stderr=err)
    peak_tree = [0.0]
    done = threading.Event()

    def sample():
        while True:
            peak_tree[0] = max(peak_tree[0], _tree_pss_mb(proc.pid))
            if done.wait(PSS_SAMPLE_S):
                return
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, _ = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    out.seek(0)
    err.seek(0)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed: {err.read().decode()[-2000:]}")
    return {"wall_s": wall, "spawn": spawn, "peak_tree_pss_mb": peak_tree[0], "stdout": out.read().decode()}


def import_profile(python: str, lib: str, imports: str, top: int = 8) -> list[tuple[str, float]]:
    """`python -X importtime` of our child's imports (what is loaded before a byte is parsed): the
    packages that cost most (each module's own time, summed per top-level package), in seconds."""
    runs = []
    for _ in range(3):  # the median of three (the first may compile bytecode)
        proc = subprocess.run([python, "-X", "importtime", "-c", imports, "", "", lib],
                              capture_output=True, text=True, check=True)
        own: dict[str, float] = {}
        for line in proc.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            self_us, _, name = line[len("import time:"):].split("|")
            if not self_us.strip().isdigit():
                continue
            root = name.strip().split(".")[0]
            own[root] = own.get(root, 0.0) + int(self_us) / 1e6
        runs.append(own)
    median = {k: _median([r.get(k, 0.0) for r in runs]) for k in runs[-1]}
    return sorted(median.items(), key=lambda kv: -kv[1])[:top]


def cli_startup_s(lib: str, flags: list[str], repeat: int = 5) -> float:
    """`decodescope analyze-trace` from spawn to where it would read the first file: median wall."""
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLI_STARTUP, lib, *flags], capture_output=True)
        walls.append(time.perf_counter() - t0)
    return _median(walls)


def gunzip_limit_s(files: list[Path]) -> float:
    """`zcat FILE > /dev/null` of every file, as many at once as there are cores: the time the files
    take just to decompress, in parallel as our parser reads them."""
    t0 = time.perf_counter()
    running: list[subprocess.Popen] = []
    for f in files:
        while len(running) >= (os.cpu_count() or 1):
            running.pop(0).wait()
        cmd = ["zcat", str(f)] if f.suffix == ".gz" else ["cat", str(f)]
        running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    for p in running:
        p.wait()
    return time.perf_counter() - t0


def json_bytes_and_totals(trace_dir: Path, device: str) -> tuple[int, dict, int]:
    """Independent reference: json.load each rank file, sum durations per name."""
    from decodescope.trace.load import find_trace_files

    ranks, _ = find_trace_files(trace_dir)
    total_bytes, events = 0, 0
    totals: dict[str, float] = defaultdict(float)
    want = {"kernel", "gpu_memcpy", "gpu_memset"} if device == "gpu" else {"cpu_op"}
    for p in ranks:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rb") as f:
            raw = f.read()
        total_bytes += len(raw)
        doc = json.loads(raw)
        del raw
        for ev in doc["traceEvents"]:
            events += 1
            if ev.get("ph") == "X" and ev.get("cat") in want:
                totals[ev["name"]] += float(ev.get("dur", 0))
        del doc
    return total_bytes, totals, events


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


WAIT_LOAD = [None, 60.0]  # (--wait-load, the longest wait): other work on a 2-core machine skews timings


def settle() -> float:
    """Wait (a while at most) until the 1-min load average is below --wait-load; return it."""
    limit, longest = WAIT_LOAD
    t0 = time.monotonic()
    while limit is not None and os.getloadavg()[0] > limit and time.monotonic() - t0 < longest:
        time.sleep(5)
    return os.getloadavg()[0]


def bench(trace_dir: Path, hta_python: str | None, repeat: int, hta_repeat: int, lib: str, child: str) -> dict:
    import tempfile

    from decodescope.trace.load import find_trace_files

    files, _ = find_trace_files(trace_dir)
    out_json = Path(tempfile.mkstemp(suffix=".json")[1])
    runs, loads = [], []
    for _ in range(repeat):
        loads.append(settle())
        r = run_child(sys.executable, child, [str(trace_dir), str(out_json), lib])
        result = json.loads(out_json.read_text())
        r["startup_s"] = result["ready"] - r["spawn"]
        runs.append(r)
    out_json.unlink()
    gz = []
    for _ in range(repeat):
        loads.append(settle())
        gz.append(gunzip_limit_s(files))
    json_bytes, ref, events = json_bytes_and_totals(trace_dir, result["device"])
    mismatched = [n for n in set(ref) | set(result["totals"])
                  if abs(ref.get(n, 0.0) - result["totals"].get(n, 0.0)) > 1e-6 * max(1.0, abs(ref.get(n, 0.0)))]
    wall = _median([r["wall_s"] for r in runs])
    row = {"trace_dir": str(trace_dir), "device": result["device"], "json_mb": json_bytes / 1e6,
           "gz_mb": sum(f.stat().st_size for f in files) / 1e6, "rank_files": len(files), "events": events,
           "kept": result["kept"], "cores": os.cpu_count(), "load_1m": max(loads),
           "ours_wall_s": wall, "ours_wall_s_runs": [r["wall_s"] for r in runs],
           "ours_startup_s": _median([r["startup_s"] for r in runs]),
           "ours_peak_tree_pss_mb": max(r["peak_tree_pss_mb"] for r in runs),
           "ours_mb_s": json_bytes / 1e6 / wall, "gunzip_s": _median(gz), "gunzip_mb_s": json_bytes / 1e6 / _median(gz),
           "x_of_gunzip": wall / _median(gz),
           "names_checked": len(ref), "names_mismatched": len(mismatched), "other_share": result["other_share"]}
    if child is OURS_CRITPATH_CHILD:  # the table's breakdown beside it, timed the same way: the ratios
        bruns = []
        for _ in range(repeat):
            row["load_1m"] = max(row["load_1m"], settle())
            bruns.append(run_child(sys.executable, OURS_CHILD, [str(trace_dir), str(out_json) + ".b", lib]))
        Path(str(out_json) + ".b").unlink(missing_ok=True)
        bwall = _median([b["wall_s"] for b in bruns])
        bmem = max(b["peak_tree_pss_mb"] for b in bruns)
        row.update({"breakdown_wall_s": bwall, "breakdown_peak_tree_pss_mb": bmem, "critpath_x_time": wall / bwall,
                    "critpath_x_memory": row["ours_peak_tree_pss_mb"] / bmem, "steps": result.get("steps"),
                    "segments": result.get("segments")})
        print(f"{trace_dir.name}: critical path {wall:.2f} s {row['ours_peak_tree_pss_mb']:.0f} MB | breakdown "
              f"{bwall:.2f} s {bmem:.0f} MB | x {wall / bwall:.2f} time, {row['ours_peak_tree_pss_mb'] / bmem:.2f} "
              "memory", flush=True)
    if hta_python:
        hruns = []
        for _ in range(hta_repeat):
            row["load_1m"] = max(row["load_1m"], settle())
            hruns.append(run_child(hta_python, HTA_CHILD, [str(trace_dir)]))
        hwall = _median([h["wall_s"] for h in hruns])
        hmem = max(h["peak_tree_pss_mb"] for h in hruns)
        row.update({"hta_wall_s": hwall, "hta_wall_s_runs": [h["wall_s"] for h in hruns],
                    "hta_peak_tree_pss_mb": hmem, "hta_mb_s": json_bytes / 1e6 / hwall,
                    "speedup_x": hwall / wall, "memory_pct_of_hta": 100 * row["ours_peak_tree_pss_mb"] / hmem})
    return row


def standard_set(cache: Path, cpu_capture: Path | None) -> list[Path]:
    """The captures as they are, then each grown to 20 MB .. 1 GB of JSON (made once, kept in cache)."""
    sys.path.insert(0, str(HERE))
    from trace_set import grow_dir

    if cpu_capture is None:
        # a run's traces: outputs/<run>/traces, or one level per concurrency below it (traces/c1)
        found = sorted((p for p in [*(REPO / "outputs").glob("*/traces"), *(REPO / "outputs").glob("*/traces/*")]
                        if list(p.glob("*rank*.json*"))), key=lambda p: (p.parts[-3:],))
        if not found:
            raise SystemExit("no vLLM CPU capture under outputs/*/traces: run the embedded default "
                             "(`decodescope run params/default.yaml`) or give --cpu-capture")
        cpu_capture = found[-1]
    gpu_capture = REPO / "tests/fixtures/traces/h200x2_step_replay_graph"
    dirs = []
    for name, src, sizes in (("cpu_tp2", cpu_capture, (20, 50, 100, 200, 500, 1000)),
                             ("gpu_replay", gpu_capture, (20, 50, 200, 1000))):
        capture = cache / f"{name}_capture"
        if not capture.exists():  # the rank files only (the front-end trace is not a rank)
            capture.mkdir(parents=True)
            for p in src.iterdir():
                if "rank" in p.name and ".json" in p.name:
                    (capture / p.name).write_bytes(p.read_bytes())
        dirs.append(capture)
        dirs += [grow_dir(src, cache / f"{name}_{mb}MB", mb) for mb in sizes]
    return dirs


def table(rows: list[dict]) -> str:
    def f(r, k, fmt):
        return format(r[k], fmt) if k in r else "-"
    lines = ["| trace | rank files | JSON MB | gz MB | events | load | ours s | start-up s | ours MB/s | "
             "ours mem MB | gunzip s | x gunzip | HTA s | HTA mem MB | speed x | mem % of HTA | names ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {Path(r['trace_dir']).name} | {r['rank_files']} | {r['json_mb']:.0f} | {r['gz_mb']:.1f} | "
                     f"{r['events']:,} | {r['load_1m']:.2f} | {r['ours_wall_s']:.2f} | {r['ours_startup_s']:.2f} | "
                     f"{r['ours_mb_s']:.0f} | {r['ours_peak_tree_pss_mb']:.0f} | {r['gunzip_s']:.2f} | "
                     f"{r['x_of_gunzip']:.1f} | {f(r, 'hta_wall_s', '.2f')} | {f(r, 'hta_peak_tree_pss_mb', '.0f')} | "
                     f"{f(r, 'speedup_x', '.1f')} | {f(r, 'memory_pct_of_hta', '.0f')} | "
                     f"{r['names_checked'] - r['names_mismatched']}/{r['names_checked']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dirs", nargs="*")
    ap.add_argument("--set", action="store_true", help="add the standard set (made once under --cache)")
    ap.add_argument("--cache", default="/tmp/decodescope-trace-set")
    ap.add_argument("--cpu-capture", help="a directory of vLLM CPU TP=2 rank traces (default: newest outputs/*/traces)")
    ap.add_argument("--only", help="with --set: only the sets whose name contains this")
    ap.add_argument("--out", help="results as JSON")
    ap.add_argument("--table", help="the table (and the notes above it) as text")
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--hta-python", default=os.environ.get("HTA_PYTHON"),
                    help="python of a virtual environment with HolisticTraceAnalysis (default: $HTA_PYTHON)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of ours (and of zcat) per trace; the median is shown")
    ap.add_argument("--hta-repeat", type=int, default=1)
    ap.add_argument("--lib", default=str(REPO / "lib"), help="import decodescope from here (to time another version)")
    ap.add_argument("--ours", choices=sorted(OURS), default="stream",
                    help="stream: `decodescope analyze-trace DIR --breakdown` (default); table: load_trace_dir + "
                         "op_table + category_breakdown, the event table the full analysis builds; critpath: "
                         "the table's breakdown, then the critical paths, shares and bounds")
    ap.add_argument("--label", default="", help="a line saying what was measured, for the table file")
    ap.add_argument("--wait-load", type=float, help="before each timing, wait (1 min at most) for the 1-min load "
                    "average to fall below this")
    args = ap.parse_args()
    WAIT_LOAD[0] = args.wait_load
    hta_python = None if args.no_hta else (args.hta_python or sys.executable)
    dirs = [Path(d) for d in args.trace_dirs]
    if args.set:
        dirs += [d for d in standard_set(Path(args.cache), Path(args.cpu_capture) if args.cpu_capture else None)
                 if not args.only or args.only in d.name]
    child, child_imports, cli_flags = OURS[args.ours]
    imports = import_profile(sys.executable, args.lib, child_imports)
    cli_s = cli_startup_s(args.lib, cli_flags)
    print("heaviest imports (s):", imports, "; decodescope analyze-trace start-up (s):", round(cli_s, 3), flush=True)
    rows = []
    for d in dirs:
        row = bench(d, hta_python, args.repeat, args.hta_repeat, args.lib, child)
        rows.append(row)
        print(json.dumps(row), flush=True)
    notes = [args.label] if args.label else []
    notes += [f"{os.cpu_count()} cores; load = the highest 1-min load average seen before a timing of the row"
              + (f" (each timing waited, 1 min at most, for it to fall below {args.wait_load})." if args.wait_load else "."),
              f"ours s, start-up s: median of {args.repeat} runs; HTA s: median of {args.hta_repeat} (HTA's own time varies"
              " most on the big traces); mem = peak summed PSS of the process tree (MB);",
              "gunzip s: zcat of every rank file, as many at once as there are cores; x gunzip = ours s / gunzip s.",
              f"ours: {args.ours} ({'`decodescope analyze-trace DIR --breakdown`' if args.ours == 'stream' else 'load_trace_dir + op_table + category_breakdown'}).",
              "start-up: spawn to the end of the imports parsing needs, median; "
              f"`decodescope analyze-trace{' --breakdown' if cli_flags else ''}` itself to where it reads the first "
              f"file: {cli_s:.3f} s (median of 5).",
              "costliest imports before parsing (python -X importtime, own time summed per package, s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in imports)]
    text = "\n".join(notes) + "\n\n" + table(rows)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(json.dumps({"label": args.label, "imports_s": imports, "cli_startup_s": cli_s,
                                              "rows": rows}, indent=2))
    if args.table:
        Path(args.table).write_text(text + "\n")
    return 0 if all(r["names_mismatched"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
