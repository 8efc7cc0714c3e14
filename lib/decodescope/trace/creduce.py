"""One rank file reduced in C as it is read (kr_* in _kscan.c): the streamed breakdown's fast path, with
no numpy and no event columns. Python cuts the decompressed text into runs of whole events (reader.py);
each run goes to kr_feed, which tokenizes it and adds every event to per-name sums at once: GPU work at
its duration, CPU ops at their self time off a stack of open ops per thread. ctypes lets the GIL go for
the call, and zlib for each inflate, so rank files read in threads use every core.

A file this path does not take (a layout other than Kineto's, a value the scanner leaves to the numpy
reader, CPU ops out of start order on a thread) raises NotReduced, and stream.reduce_file reads it.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

from decodescope.trace.categorize import categorize_names
from decodescope.trace.totals import RankTotals
from decodescope.trace.cscan import NOT_MINE, library
from decodescope.trace.reader import TraceMeta, _kineto, body_start, finish_meta, name_rule, opened

UNORDERED, NOMEM = -3, -4
_WHY = {NOT_MINE: "a run of events the C scanner does not read", UNORDERED: "CPU ops out of start order on a thread",
        NOMEM: "out of memory in the C reduction"}


class NotReduced(Exception):
    """The C reduction leaves this file to stream.reduce_file; the message says why."""


def available() -> bool:
    return library() is not None


def _array(ctype, n: int):
    return (ctype * max(n, 1))()


def _kept(names: list[str], op_rows, rt_rows, op_nameless: int, rt_nameless: int, is_gpu: bool) -> int:
    """Events of the categories kept by name that the rule keeps (reader.name_rule), as the readers
    that build columns keep them."""
    kept = 0
    for cat, rows, nameless in (("cpu_op", op_rows, op_nameless), ("cuda_runtime", rt_rows, rt_nameless)):
        rule = name_rule(cat, is_gpu)
        if rule is None:
            kept += sum(rows) + nameless
            continue
        kept += sum(k for x, k in zip(names, rows) if k and rule.search(x))
        kept += nameless if rule.search("") else 0
    return kept


def _results(lib, state, cpu: bool, is_gpu: bool, rules) -> tuple[RankTotals, dict]:
    sizes = _array(ctypes.c_int64, 9)
    lib.kr_sizes(state, sizes)
    n, blob_len, n_pairs, kernel_rows, kernel_seen, seen, kept, op_nameless, rt_nameless = sizes[:9]
    blob = ctypes.create_string_buffer(max(blob_len, 1))
    off, length = _array(ctypes.c_int64, n), _array(ctypes.c_int32, n)
    lib.kr_names(state, blob, off, length)
    raw = blob.raw
    names = [raw[o:o + k].decode("utf-8", "replace") for o, k in zip(off[:n], length[:n])]
    gpu_dur, cpu_self, cpu_dur = (_array(ctypes.c_double, n) for _ in range(3))
    gpu_rows, cpu_rows = _array(ctypes.c_int64, n), _array(ctypes.c_int64, n)
    lib.kr_sums(state, gpu_dur, gpu_rows, cpu_self, cpu_dur, cpu_rows)
    op_rows, rt_rows = _array(ctypes.c_int64, n), _array(ctypes.c_int64, n)
    lib.kr_ruled(state, op_rows, rt_rows)
    kept += _kept(names, op_rows[:n], rt_rows[:n], op_nameless, rt_nameless, is_gpu)
    calls = [0] * n
    if cpu and n_pairs:
        child, parent = _array(ctypes.c_int32, n_pairs), _array(ctypes.c_int32, n_pairs)
        count = _array(ctypes.c_int64, n_pairs)
        lib.kr_pairs(state, child, parent, count)
        mapping = categorize_names(names, "cpu", rules)
        category = [mapping[x] for x in names]
        # a call is counted once: not again inside an op of its own category (c10d::allreduce_ > gloo:all_reduce)
        for c, p, k in zip(child[:n_pairs], parent[:n_pairs], count[:n_pairs]):
            if p < 0 or category[p] != category[c]:
                calls[c] += k
    totals = RankTotals(names=names, kernel_rows=kernel_rows, gpu_dur_us=gpu_dur[:n], gpu_rows=gpu_rows[:n],
                        cpu_time_us=cpu_self[:n], cpu_calls=calls, cpu_dur_us=cpu_dur[:n], cpu_rows=cpu_rows[:n],
                        cpu_read=cpu)
    return totals, {"kernel_seen": kernel_seen, "events_seen": seen, "events_kept": kept}


def reduce_file(path: "str | Path", rules=None, cpu: Optional[bool] = None) -> tuple[RankTotals, TraceMeta]:
    """One rank file reduced in C (CPU ops too where `cpu`, else where its header names no GPU).
    Raises TraceError naming a damaged file, NotReduced for one stream.reduce_file must read."""
    lib = library()
    if lib is None:
        raise NotReduced("no C library")
    path = Path(path)
    state = None
    chunks_read = 0
    try:
        with opened(path) as (meta, chunks):
            is_gpu, rest, layout = body_start(chunks, path, meta)
            if layout == "generic":
                raise NotReduced("not Kineto's layout")
            cpu = (not is_gpu) if cpu is None else cpu
            state = lib.kr_new(int(cpu))
            if not state:
                raise MemoryError("kr_new")
            if layout == "kineto":
                feed = lib.kr_feed
                for buf, lo, hi in _kineto(rest, chunks, path, meta):
                    chunks_read += 1
                    rc = feed(state, buf, lo, hi)
                    if rc:
                        raise NotReduced(_WHY.get(rc, f"kr_feed returned {rc}"))
            rc = lib.kr_finish(state)
            if rc:
                raise NotReduced(_WHY.get(rc, f"kr_finish returned {rc}"))
            totals, counts = _results(lib, state, cpu, is_gpu, rules)
    finally:
        if state:
            lib.kr_free(state)
    totals.chunks_by_reader = {"c_reduce": chunks_read}
    meta.events_seen, meta.events_kept = counts["events_seen"], counts["events_kept"]
    finish_meta(meta, saw_kernel=counts["kernel_seen"] > 0)
    return totals, meta
