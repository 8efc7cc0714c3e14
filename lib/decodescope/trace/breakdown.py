"""`analyze-trace --breakdown`: a directory of per-rank traces -> time by category and by name per rank,
each file reduced as it is read (no event table), with the figures op_table + category_breakdown give
from the table.

Each rank file is reduced in C (creduce.py) in a thread of its own, the files at once up to `workers`:
the C code and zlib let the GIL go, so the cores are used without forking, and neither numpy nor
pandas is imported. A file the C reduction does not take (no compiler, another layout, a value its
scanner leaves, CPU ops out of start order) is read by the numpy reduction (stream.py) instead.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, cast

from decodescope.trace.load import rank_trace_files, ranked
from decodescope.trace.reader import TraceError, TraceMeta
from decodescope.trace import creduce
from decodescope.trace.categorize import categorize_names
from decodescope.trace.cscan import library
from decodescope.trace.totals import RankTotals


@dataclass
class StreamedBreakdown:
    device: str
    ranks: list[int]
    # per rank and category: time_us, calls, share (of the rank's time), mean_us; by rank, then time
    categories: list[dict]
    # per rank, per name: time_us (self on CPU), dur_us, calls (counted), rows
    names: dict[int, dict[str, dict]]
    metas: list[TraceMeta]
    warnings: list[str]
    skipped: list[str]
    chunks_by_reader: dict[str, int] = field(default_factory=dict)  # summed over the ranks read

    def other_share(self) -> float:
        from decodescope.trace.categorize import OTHER  # loads the rules, as breakdown_dir already has

        total = sum(r["time_us"] for r in self.categories)
        return sum(r["time_us"] for r in self.categories if r["category"] == OTHER) / total if total else 0.0


def _by_category(rank: int, names: dict[str, dict], device: str, rules) -> list[dict]:
    mapping = categorize_names(list(names), device, rules)
    acc: dict[str, list] = {}
    for n, v in names.items():
        a = acc.setdefault(mapping[n], [0.0, 0])
        a[0] += v["time_us"]
        a[1] += v["calls"]
    total = sum(a[0] for a in acc.values())
    rows = [{"rank": rank, "category": c, "time_us": t, "calls": k, "share": t / total if total else float("nan"),
             "mean_us": t / k if k else float("nan")} for c, (t, k) in acc.items()]
    return sorted(rows, key=lambda r: -r["time_us"])


def _in_threads(fn: Callable, items: list, n_threads: int) -> list:
    """fn over items in up to n_threads threads, results in order (fn catches its own errors)."""
    results: list = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = fn(items[i])

    threads = [threading.Thread(target=work, name="trace-reduce", daemon=True)
               for _ in range(max(1, min(n_threads, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _reduce_in_c(path: Path, rules, cpu: Optional[bool] = None):
    """(path, totals, meta, error), or None where the numpy reduction must read the file."""
    try:
        totals, meta = creduce.reduce_file(path, rules, cpu)
        return str(path), totals, meta, None
    except creduce.NotReduced:
        return None
    except TraceError as e:
        return str(path), None, None, str(e)
    except Exception as e:  # any other damage: name the file, keep going with the other ranks
        return str(path), None, None, f"{path}: {type(e).__name__}: {e}"


def reduce_all(files: list[Path], workers: int, rules=None, cpu: Optional[bool] = None) -> list:
    """(path, totals, meta, error) of every file: in C in threads, the files it leaves by the numpy
    reduction."""
    results = _in_threads(lambda f: _reduce_in_c(f, rules, cpu), files, workers) if creduce.available() else [None] * len(files)
    left = [i for i, r in enumerate(results) if r is None]
    if left:
        from decodescope.trace.stream import reduce_files  # numpy: imported only where a file needs it

        for i, r in zip(left, reduce_files([files[i] for i in left], workers, rules, cpu)):
            results[i] = r
    return results


def _per_name(t: RankTotals, device: str) -> dict[str, dict]:
    if device == "gpu":
        return {n: {"time_us": float(d), "dur_us": float(d), "calls": int(k), "rows": int(k)}
                for n, d, k in zip(t.names, t.gpu_dur_us, t.gpu_rows) if k}
    return {n: {"time_us": float(s), "dur_us": float(d), "calls": int(c), "rows": int(k)}
            for n, s, d, c, k in zip(t.names, t.cpu_time_us, t.cpu_dur_us, t.cpu_calls, t.cpu_rows) if k}


def breakdown_dir(trace_dir: "str | Path", workers: Optional[int] = None, rules=None) -> StreamedBreakdown:
    """Every rank file of trace_dir reduced, and the time by category per rank, as category_breakdown
    gives it from the table."""
    trace_dir = Path(trace_dir)
    files, front = rank_trace_files(trace_dir)
    workers = workers or (os.cpu_count() or 1)
    # the rules and the C library loaded once, before any thread or worker needs them
    from decodescope.trace.categorize import default_rules

    if rules is None:
        default_rules()
    library()
    chosen: list[tuple[Path, RankTotals, TraceMeta]]
    chosen, metas, warnings, skipped = ranked(reduce_all(files, workers, rules), trace_dir, front)
    device = "gpu" if any(t.kernel_rows for _, t, _ in chosen) else "cpu"
    unread = [p for p, t, _ in chosen if device == "cpu" and not t.cpu_read]
    if unread:  # a file whose header named a GPU but that had no kernel: its CPU ops after all
        again = {Path(p): t for p, t, _, err in reduce_all(unread, workers, rules, cpu=True) if not err}
        chosen = [(p, again.get(p, t), m) for p, t, m in chosen]
    categories: list[dict] = []
    names: dict[int, dict[str, dict]] = {}
    for (path, t, meta) in chosen:
        warnings += t.warnings
        rank = cast(int, meta.rank)  # ranked() leaves out every trace without a rank
        names[rank] = _per_name(t, device)
        categories += _by_category(rank, names[rank], device, rules)
    readers: dict[str, int] = {}
    for _, t, _ in chosen:
        for k, v in t.chunks_by_reader.items():
            readers[k] = readers.get(k, 0) + v
    return StreamedBreakdown(device=device, ranks=sorted(names), categories=categories, names=names, metas=metas,
                             warnings=warnings, skipped=skipped, chunks_by_reader=readers)
