"""A directory of per-rank traces -> one table: rank files parsed in parallel processes when they are
big enough to gain from it, else in this one.

Damaged files, missing ranks and traces of two runs in one directory give warnings naming the
files; the other ranks are still analysed. pandas is imported only to build the table.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from decodescope.trace.reader import TraceError, TraceMeta, json_size

if TYPE_CHECKING:
    import pandas as pd

    from decodescope.trace.columns import _Columns

TRACE_FILE = re.compile(r"\.json(\.gz)?$")
FRONTEND_TRACE = re.compile(r"async_llm|api_server|frontend", re.I)
_Result = TypeVar("_Result")  # what parse_all's `received` (or another reader) made of a file


@dataclass
class LoadedTraces:
    events: "pd.DataFrame"
    metas: list[TraceMeta]
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in self.events["rank"].unique()) if not self.events.empty else []


def find_trace_files(trace_dir: Path) -> tuple[list[Path], list[Path]]:
    """(rank traces, front-end traces) under trace_dir."""
    files = sorted(p for p in Path(trace_dir).rglob("*") if p.is_file() and TRACE_FILE.search(p.name))
    front = [p for p in files if FRONTEND_TRACE.search(p.name)]
    return [p for p in files if p not in front], front


def rank_trace_files(trace_dir: Path) -> tuple[list[Path], list[Path]]:
    """find_trace_files, or an error naming the directory when it is not one or holds no rank trace."""
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"{trace_dir}: not a directory of traces")
    files, front = find_trace_files(trace_dir)
    if not files:
        raise TraceError(f"{trace_dir}: no *.json or *.json.gz trace files (rank traces) found")
    return files, front


# When to use more processes: from the crossover measured on this project's 2-core machine
# (benchmarks/trace_crossover.py, benchmarks/results/cpu_trace_crossover.txt). A forked worker costs its
# start and a copy of its columns through a pipe; a rank file reads at ~110-170 MB/s of JSON a core, its
# decompression already overlapped by a thread. So:
# - rank files in processes of their own (one rank stays in this process) once the files handed to the
#   others hold this much JSON: about even at 4 MB handed over, 1.2x at 10 MB, 1.3-1.7x from 25 MB;
FILES_IN_PROCESSES_MIN_BYTES = 8 << 20
# - one file's chunks spread over worker processes (a file read alone) from this much JSON: a loss up to
#   25 MB, even at 50 MB, 1.2x at 100 MB (each chunk crosses two pipes, and only an idle core gains).
FILE_POOL_MIN_BYTES = 96 << 20


def workers_for(path: Path, workers: int) -> int:
    """Processes to read one file's chunks in when it is read alone: 1 (this process, its decompression
    in a thread) below FILE_POOL_MIN_BYTES of JSON, else up to `workers`."""
    return workers if workers > 1 and json_size(Path(path)) >= FILE_POOL_MIN_BYTES else 1


def plan_processes(sizes: list[int], workers: int, min_bytes: int = FILES_IN_PROCESSES_MIN_BYTES) -> list[int]:
    """Which process reads each file: 0 is this one, 1.. forked workers. Files are spread largest first
    onto the least loaded process (this one included); one process when the files the others would
    take hold less than min_bytes in all."""
    n = min(workers, len(sizes))
    if n < 2:
        return [0] * len(sizes)
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        p = min(range(n), key=lambda p: (load[p], p))
        owner[i] = p
        load[p] += sizes[i]
    if sum(load[1:]) < min_bytes:
        return [0] * len(sizes)
    return owner


def _parse_one(path: str, workers: int = 1, as_payload: bool = False):
    """(path, columns, meta, error) of one file; the columns as plain arrays when sent back from a worker."""
    # lean: trace.parse loads pandas; analyze-trace --breakdown loads this module without it (start-up budget)
    from decodescope.trace.parse import parse_columns

    try:
        cols, meta = parse_columns(path, workers=workers_for(Path(path), workers))
        return path, (cols.payload() if as_payload else cols), meta, None
    except TraceError as e:
        return path, None, None, str(e)
    except Exception as e:  # any other damage: name the file, keep going with the other ranks
        return path, None, None, f"{path}: {type(e).__name__}: {e}"


def _columns_from(payload) -> Optional[_Columns]:
    """A worker's columns, as _parse_one sent them back."""
    if payload is None:
        return None
    # lean: trace.parse loads pandas; analyze-trace --breakdown loads this module without it (start-up budget)
    from decodescope.trace.columns import _Columns

    cols = _Columns()
    cols.merge(payload)
    return cols


def parse_all(files: list[Path], workers: int, one=_parse_one, received=lambda payload: payload,
              min_bytes: int = FILES_IN_PROCESSES_MIN_BYTES) -> list:
    """Every file read by `one(path, workers, as_payload)` -> (path, result, meta, error), in order:
    this process reads its share while forked workers read theirs; `received` turns what a worker
    sent back into the result."""
    owner = plan_processes([json_size(f) for f in files], workers, min_bytes)
    n_workers = max(owner)
    if not n_workers:
        return [one(str(f), workers) for f in files]
    # lean: trace.parse loads pandas; analyze-trace --breakdown loads this module without it (start-up budget)
    from decodescope.trace.parse import _process_pool

    results: list = [None] * len(files)
    pool = _process_pool(n_workers)
    try:
        futures = {i: pool.submit(one, str(f), 1, True) for i, f in enumerate(files) if owner[i]}
        for i, f in enumerate(files):  # this process's share, while the workers read theirs
            if not owner[i]:
                results[i] = one(str(f), 1)
        for i, fut in futures.items():
            try:
                path, payload, meta, err = fut.result()
            except Exception as e:  # the worker itself died (killed, out of memory): name its file
                path, payload, meta, err = str(files[i]), None, None, f"{files[i]}: {type(e).__name__}: {e}"
            results[i] = (path, received(payload) if payload is not None else None, meta, err)
    finally:
        pool.shutdown()
    return results


def _lone_trace_as_rank0(results: list, trace_dir: Path) -> Optional[str]:
    """A directory with one trace and no rank anywhere (a single-GPU run, or a trace saved by hand) is
    rank 0: there is no other rank it could be. Returns the warning saying so, or None."""
    if len(results) != 1:
        return None
    path, _, meta, err = results[0]
    if err or meta.rank is not None:
        return None
    meta.rank, meta.rank_source = 0, "single trace"
    return (f"{path}: no rank in distributedInfo or the file name; the only trace in {trace_dir}, "
            "so it is read as rank 0")


def load_trace_dir(trace_dir: Path, workers: Optional[int] = None) -> LoadedTraces:
    # lean: trace.parse loads pandas; analyze-trace --breakdown loads this module without it (start-up budget)
    from decodescope.trace.parse import small_pages

    with small_pages():
        return _load_trace_dir(Path(trace_dir), workers)


def _load_trace_dir(trace_dir: Path, workers: Optional[int]) -> LoadedTraces:
    files, front = rank_trace_files(trace_dir)
    workers = workers or (os.cpu_count() or 1)
    results = parse_all(files, workers, received=_columns_from)
    chosen, metas, warnings, skipped = ranked(results, trace_dir, front)
    tables: list[_Columns] = [cols for _, cols, _ in chosen]
    return LoadedTraces(events=_table(tables, metas), metas=metas, warnings=warnings, skipped=skipped)


def ranked(results: list[tuple[Any, _Result, Any, Optional[str]]], trace_dir: Path, front: list[Path]
           ) -> tuple[list[tuple[Path, _Result, TraceMeta]], list[TraceMeta], list[str], list[str]]:
    """parse_all's results -> ((path, result, meta) of each rank's trace, by rank; the metas; warnings;
    files skipped). Damaged files, files without a rank, front-end traces and a rank's older traces
    (several runs in one directory) are left out, each with a warning naming it."""
    warnings = [f"{p}: front-end (API server) trace, not a rank: not analysed" for p in front]
    lone = _lone_trace_as_rank0(results, trace_dir)
    if lone:
        warnings.append(lone)
    by_rank: dict[int, list[tuple[Path, _Result, TraceMeta]]] = {}
    for path, result, meta, err in results:
        if err:
            warnings.append(err)
            continue
        if meta.rank is None:
            warnings.append(f"{path}: no rank in distributedInfo or the file name: not analysed")
            continue
        by_rank.setdefault(meta.rank, []).append((Path(path), result, meta))
    chosen, metas, skipped = [], [], []
    for rank, items in sorted(by_rank.items()):
        if len(items) > 1:
            # two runs in one directory: keep the newest file of each rank
            items.sort(key=lambda t: t[0].stat().st_mtime)
            for p, _, _ in items[:-1]:
                skipped.append(str(p))
            warnings.append(f"rank {rank}: {len(items)} traces ({', '.join(p.name for p, _, _ in items)}); "
                            f"traces of several runs are mixed in {trace_dir}: using the newest, {items[-1][0].name}")
        chosen.append(items[-1])
        metas.append(items[-1][2])
        warnings += items[-1][2].warnings
    world = max((m.world_size or 0 for m in metas), default=0)
    missing = sorted(set(range(world)) - set(by_rank)) if world else []
    if missing:
        warnings.append(f"{trace_dir}: world size {world} but no usable trace for rank(s) {missing}; "
                        "analysing the ranks present")
    return chosen, metas, warnings, skipped


def _table(parts: list[_Columns], metas: list[TraceMeta]) -> "pd.DataFrame":
    """One table of every rank's columns, built once (no per-rank tables to concatenate): the string
    dictionaries are united in rank order, as pandas' union_categoricals would."""
    # lean: trace.parse loads pandas; analyze-trace --breakdown loads this module without it (start-up budget)
    import numpy as np
    import pandas as pd

    from decodescope.trace.columns import _Columns

    if not parts:
        return pd.DataFrame()
    if len(parts) == 1:
        return parts[0].frame(rank=metas[0].rank)
    rank = np.concatenate([np.full(cols.rows, m.rank, dtype=np.int64) for cols, m in zip(parts, metas)])
    table = _Columns()
    for cols in parts:
        table.take(cols)  # each rank's columns are handed over, not copied
    df = table.frame(rank=rank)
    # the column order of the tables this function used to concatenate: strings last
    strings = list(_Columns.STR)
    return df[[c for c in df.columns if c not in strings] + strings]
