"""Benchmark: decodescope's trace parse + category breakdown against HolisticTraceAnalysis (HTA).

Same traces, side by side from one benchmark process: each tool runs in a child process of its own
(so each one's peak RSS is its own, read with os.wait4), HTA as `TraceAnalysis(trace_dir=...)` then
`get_gpu_kernel_breakdown()`, ours as `load_trace_dir` + `op_table` + `category_breakdown` with its
default parallelism (one process per core; peak RSS counts the largest process, as for HTA). Reported: wall time, peak RSS, MB/s of decompressed JSON, and the ratios. Correctness:
our per-name total durations must equal an independent sum over the raw JSON events (json.load).

python benchmarks/trace_parse_vs_hta.py DIR [DIR ...] [--out results.json] [--no-hta]
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
sys.path.insert(0, str(HERE.parent / "lib"))

HTA_CHILD = """
import sys
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
kt, kernels = a.get_gpu_kernel_breakdown(visualize=False)
print("rows", len(kernels))
"""

OURS_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[3])
from decodescope.trace.load import load_trace_dir
from decodescope.trace.analyze import op_table, category_breakdown
loaded = load_trace_dir(sys.argv[1])
ops = op_table(loaded.events)
bd = category_breakdown(ops)
totals = {str(k): v for k, v in ops.groupby("name", observed=True)["dur_us"].sum().items()}
json.dump({"device": ops.attrs["device"], "totals": totals, "categories": len(bd),
           "kept": int(len(loaded.events)), "other_share": float(bd.loc[bd["category"].astype(str) == "other", "time_us"].sum() / bd["time_us"].sum())},
          open(sys.argv[2], "w"))
"""


def _tree_rss_mb(pid: int) -> float:
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


def run_child(code: str, args: list[str]) -> dict:
    """Wall time, peak RSS of the largest process (wait4) and peak summed PSS of the whole process
    tree (sampled every 20 ms), for one tool's run."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_tree = [0.0]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak_tree[0] = max(peak_tree[0], _tree_rss_mb(proc.pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"child failed: {err[-2000:]}")
    return {"wall_s": wall, "peak_rss_mb": rusage.ru_maxrss / 1024,
            "peak_tree_rss_mb": peak_tree[0], "stdout": out}


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


def bench(trace_dir: Path, with_hta: bool) -> dict:
    import tempfile

    out_json = Path(tempfile.mkstemp(suffix=".json")[1])
    ours = run_child(OURS_CHILD, [str(trace_dir), str(out_json), str(HERE.parent / "lib")])
    result = json.loads(out_json.read_text())
    json_bytes, ref, events = json_bytes_and_totals(trace_dir, result["device"])
    mismatched = [n for n in set(ref) | set(result["totals"])
                  if abs(ref.get(n, 0.0) - result["totals"].get(n, 0.0)) > 1e-6 * max(1.0, abs(ref.get(n, 0.0)))]
    row = {"trace_dir": str(trace_dir), "device": result["device"], "json_mb": json_bytes / 1e6, "events": events,
           "ours_wall_s": ours["wall_s"], "ours_peak_rss_mb": ours["peak_rss_mb"],
           "ours_peak_tree_rss_mb": ours["peak_tree_rss_mb"], "cores": os.cpu_count(),
           "ours_mb_s": json_bytes / 1e6 / ours["wall_s"], "names_checked": len(ref), "names_mismatched": len(mismatched),
           "other_share": result["other_share"]}
    if with_hta:
        hta = run_child(HTA_CHILD, [str(trace_dir)])
        row.update({"hta_wall_s": hta["wall_s"], "hta_peak_rss_mb": hta["peak_rss_mb"],
                    "hta_peak_tree_rss_mb": hta["peak_tree_rss_mb"],
                    "hta_mb_s": json_bytes / 1e6 / hta["wall_s"],
                    "speedup_x": hta["wall_s"] / ours["wall_s"],
                    "memory_pct_of_hta": 100 * ours["peak_tree_rss_mb"] / hta["peak_tree_rss_mb"]})
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dirs", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--no-hta", action="store_true")
    args = ap.parse_args()
    rows = []
    for d in args.trace_dirs:
        row = bench(Path(d), not args.no_hta)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{os.cpu_count()} cores. RSS = peak of the summed PSS (proportional set size) of each tool's process tree.")
    print("| trace | JSON MB | events | ours s | ours MB/s | ours RSS MB | HTA s | HTA MB/s | HTA RSS MB | speed x | mem % of HTA | names ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['trace_dir']).name} | {r['json_mb']:.0f} | {r['events']:,} | {r['ours_wall_s']:.2f} | "
              f"{r['ours_mb_s']:.0f} | {r['ours_peak_tree_rss_mb']:.0f} | {r.get('hta_wall_s', float('nan')):.2f} | "
              f"{r.get('hta_mb_s', float('nan')):.0f} | {r.get('hta_peak_tree_rss_mb', float('nan')):.0f} | "
              f"{r.get('speedup_x', float('nan')):.1f} | {r.get('memory_pct_of_hta', float('nan')):.0f} | "
              f"{r['names_checked'] - r['names_mismatched']}/{r['names_checked']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["names_mismatched"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
