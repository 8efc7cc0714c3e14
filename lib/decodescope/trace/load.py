"""A directory of per-rank traces -> one table, ranks parsed in parallel processes.

Damaged files, missing ranks and traces of two runs in one directory give warnings naming the
files; the other ranks are still analysed.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.trace.parse import TraceError, TraceMeta, parse_trace

TRACE_FILE = re.compile(r"\.json(\.gz)?$")
FRONTEND_TRACE = re.compile(r"async_llm|api_server|frontend", re.I)


@dataclass
class LoadedTraces:
    events: pd.DataFrame
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


# A decoding process costs its own baseline memory: one per this much decompressed JSON, no more.
JSON_BYTES_PER_WORKER = 96 << 20


def workers_for(path: Path, workers: int) -> int:
    size = Path(path).stat().st_size * (8 if str(path).endswith(".gz") else 1)  # gzip ~8x on traces
    return max(1, min(workers, size // JSON_BYTES_PER_WORKER))


def _parse_one(path: str, workers: int = 1):
    try:
        df, meta = parse_trace(path, workers=workers_for(Path(path), workers))
        return path, df, meta, None
    except TraceError as e:
        return path, None, None, str(e)
    except Exception as e:  # any other damage: name the file, keep going with the other ranks
        return path, None, None, f"{path}: {type(e).__name__}: {e}"


def _lone_trace_as_rank0(results: list, trace_dir: Path) -> Optional[str]:
    """A directory with one trace and no rank anywhere (a single-GPU run, or a trace saved by hand) is
    rank 0: there is no other rank it could be. Returns the warning saying so, or None."""
    if len(results) != 1:
        return None
    path, df, meta, err = results[0]
    if err or meta.rank is not None:
        return None
    meta.rank, meta.rank_source = 0, "single trace"
    df["rank"] = 0
    return (f"{path}: no rank in distributedInfo or the file name; the only trace in {trace_dir}, "
            "so it is read as rank 0")


def load_trace_dir(trace_dir: Path, workers: Optional[int] = None) -> LoadedTraces:
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"{trace_dir}: not a directory of traces")
    files, front = find_trace_files(trace_dir)
    if not files:
        raise TraceError(f"{trace_dir}: no *.json or *.json.gz trace files (rank traces) found")
    workers = workers or (os.cpu_count() or 1)
    if len(files) > 1 and 2 * len(files) >= workers:
        # enough files to keep most cores busy: one process per rank file
        with ProcessPoolExecutor(max_workers=min(workers, len(files))) as pool:
            results = list(pool.map(_parse_one, map(str, files)))
    else:
        # fewer files than cores: one file at a time, its chunks decoded by every core
        results = [_parse_one(str(f), workers) for f in files]
    warnings = [f"{p}: front-end (API server) trace, not a rank: not analysed" for p in front]
    lone = _lone_trace_as_rank0(results, trace_dir)
    if lone:
        warnings.append(lone)
    by_rank: dict[int, list[tuple[Path, pd.DataFrame, TraceMeta]]] = {}
    for path, df, meta, err in results:
        if err:
            warnings.append(err)
            continue
        if meta.rank is None:
            warnings.append(f"{path}: no rank in distributedInfo or the file name: not analysed")
            continue
        by_rank.setdefault(meta.rank, []).append((Path(path), df, meta))
    frames, metas, skipped = [], [], []
    for rank, items in sorted(by_rank.items()):
        if len(items) > 1:
            # two runs in one directory: keep the newest file of each rank
            items.sort(key=lambda t: t[0].stat().st_mtime)
            for p, _, _ in items[:-1]:
                skipped.append(str(p))
            warnings.append(f"rank {rank}: {len(items)} traces ({', '.join(p.name for p, _, _ in items)}); "
                            f"traces of several runs are mixed in {trace_dir}: using the newest, {items[-1][0].name}")
        _, df, meta = items[-1]
        frames.append(df)
        metas.append(meta)
        warnings += meta.warnings
    world = max((m.world_size or 0 for m in metas), default=0)
    missing = sorted(set(range(world)) - set(by_rank)) if world else []
    if missing:
        warnings.append(f"{trace_dir}: world size {world} but no usable trace for rank(s) {missing}; "
                        "analysing the ranks present")
    if len(frames) > 1:
        # union the string dictionaries so the columns stay categorical (no per-row strings)
        from pandas.api.types import union_categoricals

        cat_cols = ("name", "cat", "coll_name", "coll_dtype", "pg_name")
        combined = {c: union_categoricals([f[c] for f in frames]) for c in cat_cols}
        events = pd.concat([f.drop(columns=list(cat_cols)) for f in frames], ignore_index=True)
        for c in cat_cols:
            events[c] = combined[c]
    else:
        events = frames[0] if frames else pd.DataFrame()
    return LoadedTraces(events=events, metas=metas, warnings=warnings, skipped=skipped)
