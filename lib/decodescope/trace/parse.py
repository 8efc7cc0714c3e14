"""Kineto / Chrome traces (.json or .json.gz) -> a columnar table, in one streamed pass.

A reader thread decompresses the file chunk by chunk.
zlib releases the GIL, so decompression runs on one core while the events are found on another.
The thread hands the chunks over through a queue of two.
The parser cuts each chunk at its last complete event and carries the rest over.
Memory is the chunks in flight (CHUNK_BYTES each, at most four), one chunk's index arrays and the kept columns.
The index arrays take some 20 bytes a byte of text.
That memory does not grow with the file's size.
There is no second copy of the decompressed text.

Torch's Kineto writer lays every event out as "\\n  {" ... "\\n  }", its keys as '"key": value'.
On that layout nothing is decoded into Python objects but the names of the kept events.
Numpy finds the quotes, the keys and the event starts in the chunk's bytes, and tells the keys apart.
It reads the values of the kept events from their offsets.
Numbers are parsed in numpy; names are sliced once and interned.
So `python_function` events, most of a with_stack trace, cost only those array passes.
So does everything else not kept.
Layout reading cannot take some chunks whole: an escaped quote, a key without its space, a name that is not a string.
Such a chunk is decoded with orjson, its kept events only.
Traces laid out otherwise (compact JSON from other tools) fall back to a streaming `raw_decode`.

Only numpy and orjson are imported here; pandas when the table is built (`_Columns.frame`).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import re
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import pandas as pd

from decodescope.trace.columns import _Columns, _loads
from decodescope.trace.layout import _NotLayout, _layout_chunk
# the reading itself (numpy-free) lives in reader.py; its names are re-exported here for the callers
from decodescope.trace.reader import (  # noqa: F401
    CHUNK_BYTES, COMM_CPU_OP, COMM_NAME, EVENT_END, EVENT_START, GPU_CATS, KEPT_CATS, LAUNCH_NAME, LAUNCH_RUNTIME, PAD,
    RANK_IN_NAME, TraceError, TraceMeta, _generic, _gunzip, _json_string, _kineto, _parse_trailer, _rank_from_name,
    _read_header, _Reader, _wanted, body_start, finish_meta, json_size, name_rule, new_meta, opened)


# ---- memory: small pages ------------------------------------------------------------------------------
@contextmanager
def small_pages() -> Iterator[None]:
    """numpy asks the kernel for 2 MiB pages on its big arrays (madvise). Where transparent huge pages
    are on for madvised memory with direct compaction (defrag 'madvise', a common default), each such
    page fault can stall for hundreds of microseconds while the kernel compacts memory: here, building
    and analysing a 4M-row table took 2.5 s + 3.6 s of system time with them, 0.9 s + 0.35 s without.
    So they are off while the table is made, and restored after."""
    try:
        # numpy's private switch: moved between numpy 1.x and 2.x
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]  # private: no stub
    except ImportError:  # pragma: no cover  (numpy 1.x)
        try:
            # numpy's private switch: moved between numpy 1.x and 2.x
            from numpy.core.multiarray import _set_madvise_hugepage  # type: ignore[no-redef]  # the same switch
        except ImportError:
            yield
            return
    before = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(before)


# ---- the Kineto layout, decoded (the chunks the layout reader leaves) --------------------------------
def _keep_pattern(is_gpu: bool) -> re.Pattern:
    """The head of every Kineto event parse_trace keeps, on the raw text: GPU work and annotations,
    runtime calls that launch something, and CPU ops (on a GPU trace only those that communicate)."""
    comm = r'|cpu_op",\s*"name": "(?=[^"]*(?i:' + COMM_NAME + "))" if is_gpu else '|cpu_op"'
    return re.compile((r'\n  \{\s*"ph": "X",\s*"cat": "(?:kernel"|gpu_memcpy"|gpu_memset"|gpu_user_annotation"'
                       r'|user_annotation"|cuda_(?:runtime|driver)",\s*"name": "(?=[^"]*(?i:' + LAUNCH_NAME + "))"
                       + comm + ")").encode())


_KEEP: dict[bool, re.Pattern] = {}  # compiled at first use: only chunks the layout reader leaves need them


def decode_body(body: "bytes | str", is_gpu: bool, lo: int = 0, hi: Optional[int] = None) -> list[dict]:
    """The kept events of a Kineto text body (body[lo:hi]), decoded in one call; the text prefilter
    already applied the same rules as _wanted, so these need no second filter."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    hi = len(body) if hi is None else hi
    find = body.find
    end = EVENT_END.encode()
    keep = _KEEP.get(is_gpu) or _KEEP.setdefault(is_gpu, _keep_pattern(is_gpu))
    kept = [body[p:find(end, p) + 4] for p in (m.start() for m in keep.finditer(body, lo, hi))]
    if not kept:
        return []
    text = b"[" + b",".join(kept) + b"]"
    try:
        return _loads(text)
    except ValueError:  # not UTF-8: read as the decoder would have after replacing the bad bytes
        return json.loads(text.decode("utf-8", "replace"))


def _chunk_columns(buf: bytes, lo: int, hi: int, is_gpu: bool) -> tuple[dict, int, int]:
    """One chunk read in a worker process: (payload, events seen, events kept)."""
    cols = _Columns()
    seen = _read_chunk(buf, lo, hi, is_gpu, cols, {})
    return cols.payload(), seen, cols.rows


def _read_chunk(buf: bytes, lo: int, hi: int, is_gpu: bool, cols: _Columns, name_ok: dict) -> int:
    """The events of buf[lo:hi] into cols, by layout where it can, else decoded; returns events seen."""
    try:
        return _layout_chunk(buf, lo, hi, is_gpu, cols, name_ok)
    except _NotLayout:
        cols.extend(decode_body(buf, is_gpu, lo, hi))
        return buf.count(EVENT_START.encode(), lo, hi)


def parse_columns(path: "str | Path", workers: int = 1,
                  on_chunk: Optional[Callable[[_Columns, bool], None]] = None,
                  read_chunk: Optional[Callable] = None) -> tuple[_Columns, TraceMeta]:
    """One rank's trace -> (kept columns, metadata), in one pass; raises TraceError naming the file.

    With workers > 1 the chunks are read in that many processes.
    Meanwhile this one decompresses and cuts the next ones, at most 2 x workers chunks in flight.
    That is worth it only for big files (load.py).
    The callback `on_chunk(cols, is_gpu)` is called as each chunk's rows are added.
    A reader that reduces the rows as they come (stream.py) drains them there.
    Memory then stays a few chunks, whatever the file's size.
    The function `read_chunk(buf, lo, hi, is_gpu, cols, name_ok)` reads one run of whole Kineto events in this process.
    It defaults to _read_chunk; stream.py passes the C scanner's."""
    if on_chunk is None:
        on_chunk = _keep_rows
    read_chunk = read_chunk or _read_chunk
    path = Path(path)
    cols = _Columns()
    # the workers are forked before the reader thread starts: a fork copies no thread, nor its locks
    pool = _process_pool(workers) if workers > 1 else None
    try:
        with opened(path) as (meta, chunks):
            is_gpu, rest, layout = body_start(chunks, path, meta)
            if layout == "kineto":
                name_ok: dict = {}
                pending: list = []
                for buf, lo, hi in _kineto(rest, chunks, path, meta):
                    if pool is not None:
                        pending.append(pool.submit(_chunk_columns, buf[:hi + len(PAD)], lo, hi, is_gpu))
                        while len(pending) >= 2 * workers:
                            payload, seen, _ = pending.pop(0).result()
                            cols.merge(payload)
                            meta.events_seen += seen
                            on_chunk(cols, is_gpu)
                        continue
                    meta.events_seen += read_chunk(buf, lo, hi, is_gpu, cols, name_ok)
                    on_chunk(cols, is_gpu)
                for fut in pending:
                    payload, seen, _ = fut.result()
                    cols.merge(payload)
                    meta.events_seen += seen
                    on_chunk(cols, is_gpu)
            elif layout == "generic":
                for batch in _generic(rest, chunks, path, meta):
                    cols.extend([ev for ev in batch if ev.get("ph") == "X" and _wanted(ev, is_gpu)])
                    on_chunk(cols, is_gpu)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    meta.events_kept = cols.rows + cols.drained
    finish_meta(meta, saw_kernel=cols.dicts["cat"].get("kernel") is not None)
    return cols, meta


def _keep_rows(cols: _Columns, is_gpu: bool) -> None:
    """parse_columns' default: the rows stay in the columns, for the table."""


def parse_trace(path: "str | Path", workers: int = 1) -> tuple["pd.DataFrame", TraceMeta]:
    """One rank's trace -> (events table, metadata). Raises TraceError naming the file."""
    cols, meta = parse_columns(path, workers)
    return cols.frame(rank=meta.rank if meta.rank is not None else -1), meta


def _process_pool(workers: int):
    """`workers` processes, started now. Forked where the platform can (they need no imports); so
    call this before starting threads."""
    methods = mp.get_all_start_methods()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork" if "fork" in methods else None))
    for f in [pool.submit(int) for _ in range(workers)]:  # every worker started before we go on
        f.result()
    return pool
