"""A rank file -> time by name, reduced chunk by chunk as it is read, with numpy.

This is the streamed breakdown's reduction (breakdown.py) for the files its C reduction (creduce.py) leaves.
No event table is built.
So memory stays a few chunks (and the names seen), whatever the trace's size.
Neither pandas nor the typed records are imported.

It reduces what op_table + category_breakdown compute from the table: the same figures, by the same rules.
On a GPU trace that is every kernel, memcpy and memset at its duration.
On a CPU trace it is every CPU op at its self time: its duration less its direct children's.
A call is counted once when an op of its own category encloses it (c10d::allreduce_ around gloo:all_reduce).

Self times stream because a rank's CPU ops come in start order per thread; torch's export writes them so.
An op still open at a chunk's end is carried into the next chunk, with what its children have taken so far.
It is closed once no later op of its thread can start inside it.
Ops that tie on the last start time of a chunk wait for the next chunk.
A longer op starting then would enclose them.
A file whose ops go back in time on a thread is read whole instead, with a warning: correct, not flat.
"""
from __future__ import annotations

from functools import partial
from itertools import islice
from pathlib import Path
from typing import Optional

import numpy as np

from decodescope.trace.categorize import categorize_names
from decodescope.trace.cscan import NameIndex, scan_chunk
from decodescope.trace.totals import RankTotals
from decodescope.trace.load import parse_all
from decodescope.trace.nesting import NEST_EPS_US, parents_in_order, prev_in_thread
from decodescope.trace.columns import _Columns
from decodescope.trace.parse import TraceError, TraceMeta, _read_chunk, parse_columns, small_pages
from decodescope.trace.reader import GPU_WORK


class _Unordered(Exception):
    """A CPU op starts before an op of its thread already closed: the file is read whole."""


def _grown(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate([a, np.zeros(n - len(a), a.dtype)])


class _Reduction:
    """parse_columns' on_chunk: each chunk's rows drained from the columns and reduced into per-name
    sums; the CPU ops still open carried to the next chunk."""

    def __init__(self, rules=None, cpu: Optional[bool] = None):
        self.rules = rules
        self.cpu = cpu  # None: decided by the first chunk's header (no deviceProperties: a CPU trace)
        self.kernel_rows = 0
        self.gpu_dur = np.zeros(0)
        self.gpu_rows = np.zeros(0, np.int64)
        self.cpu_time = np.zeros(0)
        self.cpu_calls = np.zeros(0, np.int64)
        self.cpu_dur = np.zeros(0)
        self.cpu_rows = np.zeros(0, np.int64)
        self.category_of = np.zeros(0, np.int32)  # name code -> category id (CPU rules)
        self.category_ids: dict[str, int] = {}
        self.open = {k: np.zeros(0, np.int64 if k in ("tid", "name") else bool if k == "counted" else float)
                     for k in ("tid", "ts", "dur", "self", "name", "counted")}
        self.pending: dict[str, np.ndarray] = {}
        self.horizon: dict[int, float] = {}  # thread -> the least start any later op of it can have
        self.cols: Optional[_Columns] = None

    # -- parse_columns' callback ------------------------------------------------------------------
    def __call__(self, cols: _Columns, is_gpu: bool) -> None:
        if self.cpu is None:
            self.cpu = not is_gpu
        self.cols = cols
        self.add(cols.drain(), final=False)

    def add(self, rows: dict[str, np.ndarray], final: bool) -> None:
        cols = self.cols
        assert cols is not None  # __call__ set it before handing the chunk's rows here
        n_names = len(cols.dicts["name"])
        cat_code = cols.dicts["cat"]
        name, cat = rows["name"], rows["cat"]
        gpu = np.isin(cat, [cat_code[c] for c in GPU_WORK if c in cat_code]) & (name >= 0)
        if gpu.any():
            if "kernel" in cat_code:
                self.kernel_rows += int((cat[gpu] == cat_code["kernel"]).sum())
            self.gpu_dur = _grown(self.gpu_dur, n_names)
            self.gpu_rows = _grown(self.gpu_rows, n_names)
            self.gpu_dur[:n_names] += np.bincount(name[gpu], rows["dur"][gpu], minlength=n_names)
            self.gpu_rows[:n_names] += np.bincount(name[gpu], minlength=n_names)
        if self.cpu:
            sel = (cat == cat_code["cpu_op"]) & (name >= 0) if "cpu_op" in cat_code else np.zeros(len(cat), bool)
            self._cpu({"tid": rows["tid"][sel], "ts": rows["ts"][sel], "dur": rows["dur"][sel],
                       "name": name[sel].astype(np.int64)}, final)

    # -- CPU ops: self times across chunks -------------------------------------------------------
    def _categories(self, codes: np.ndarray) -> np.ndarray:
        cols = self.cols
        assert cols is not None  # only rows of a chunk read into cols come here
        if len(self.category_of) < len(cols.dicts["name"]):  # new names this chunk: only they are listed
            new = list(islice(cols.dicts["name"], len(self.category_of), None))
            mapping = categorize_names(new, "cpu", self.rules)
            ids = [self.category_ids.setdefault(mapping[n], len(self.category_ids)) for n in new]
            self.category_of = np.concatenate([self.category_of, np.array(ids, np.int32)])
        return self.category_of[codes]

    def _horizon_of(self, tid: np.ndarray, unknown: float) -> np.ndarray:
        """Each row's thread's horizon (`unknown` for a thread not seen yet)."""
        if not len(tid):
            return np.zeros(0)
        threads, inv = np.unique(tid, return_inverse=True)
        return np.array([self.horizon.get(t, unknown) for t in threads.tolist()])[inv]

    def _cpu(self, new: dict[str, np.ndarray], final: bool) -> None:
        tid, ts = new["tid"], new["ts"]
        if len(ts) and self.horizon and (ts < self._horizon_of(tid, -np.inf)).any():
            raise _Unordered
        if self.pending:
            new = {k: np.concatenate([self.pending[k], new[k]]) for k in new}
            tid, ts = new["tid"], new["ts"]
        self.pending = {}
        if not final and len(ts):
            # per thread, the ops on its last start wait: a longer op starting then may come next
            threads, inv = np.unique(tid, return_inverse=True)
            last = np.full(len(threads), -np.inf)
            np.maximum.at(last, inv, ts)
            wait = ts == last[inv]
            self.horizon.update(zip(threads.tolist(), last.tolist()))
            self.pending = {k: v[wait] for k, v in new.items()}
            new = {k: v[~wait] for k, v in new.items()}
        o = self.open
        n_open, n_new = len(o["ts"]), len(new["ts"])
        if not n_new and not final:
            return
        tid = np.concatenate([o["tid"], new["tid"]])
        ts = np.concatenate([o["ts"], new["ts"]])
        dur = np.concatenate([o["dur"], new["dur"]])
        end = ts + dur
        name = np.concatenate([o["name"], new["name"]])
        self_us = np.concatenate([o["self"], new["dur"]])
        counted = np.concatenate([o["counted"], np.zeros(n_new, bool)])
        is_new = np.r_[np.zeros(n_open, bool), np.ones(n_new, bool)]
        # (thread, start, longest first), stable: the carried ops came first in the file
        order = np.lexsort((-dur, ts, tid))
        t_s, e_s = ts[order], end[order]
        par = parents_in_order(prev_in_thread(len(order), tid[order]), t_s, e_s)
        fresh = np.flatnonzero(is_new[order])
        p = par[fresh].astype(np.int64)
        has = p >= 0
        child, p = fresh[has], p[has]
        self_sorted = self_us[order]
        # only a new op takes from its parent: a carried one did so in the chunk it came in
        np.subtract.at(self_sorted, p, np.minimum(e_s[child], e_s[p]) - t_s[child])
        self_us[order] = self_sorted
        cats = self._categories(name)
        parent_of = np.full(len(ts), -1, np.int64)
        parent_of[order[child]] = order[p]
        newly = np.flatnonzero(is_new)
        counted[newly] = (parent_of[newly] < 0) | (cats[np.maximum(parent_of[newly], 0)] != cats[newly])
        if final:
            closed = np.ones(len(ts), bool)
        else:
            closed = end <= self._horizon_of(tid, np.inf) + NEST_EPS_US
        assert self.cols is not None  # set by the chunk these rows came in (finish() checks it too)
        n_names = len(self.cols.dicts["name"])
        for attr in ("cpu_time", "cpu_calls", "cpu_dur", "cpu_rows"):
            setattr(self, attr, _grown(getattr(self, attr), n_names))
        c = closed
        self.cpu_time[:n_names] += np.bincount(name[c], np.maximum(self_us[c], 0.0), minlength=n_names)
        self.cpu_calls[:n_names] += np.bincount(name[c], counted[c], minlength=n_names).astype(np.int64)
        self.cpu_dur[:n_names] += np.bincount(name[c], dur[c], minlength=n_names)
        self.cpu_rows[:n_names] += np.bincount(name[c], minlength=n_names)
        keep = ~closed
        self.open = {"tid": tid[keep], "ts": ts[keep], "dur": dur[keep], "self": self_us[keep],
                     "name": name[keep], "counted": counted[keep]}

    def finish(self) -> None:
        if self.cpu and self.cols is not None:
            self._cpu({k: np.zeros(0, np.int64 if k in ("tid", "name") else float) for k in ("tid", "ts", "dur", "name")},
                      final=True)

    def totals(self, warnings: list[str], readers: dict[str, int]) -> RankTotals:
        names = list(self.cols.dicts["name"]) if self.cols is not None else []
        n = len(names)
        return RankTotals(names=names, kernel_rows=self.kernel_rows, gpu_dur_us=_grown(self.gpu_dur, n),
                          gpu_rows=_grown(self.gpu_rows, n), cpu_time_us=_grown(self.cpu_time, n),
                          cpu_calls=_grown(self.cpu_calls, n), cpu_dur_us=_grown(self.cpu_dur, n),
                          cpu_rows=_grown(self.cpu_rows, n), cpu_read=bool(self.cpu), warnings=warnings,
                          chunks_by_reader=readers)


def _scanned_chunk(names, readers: dict[str, int]):
    """parse_columns' read_chunk: the C scanner (cscan.py), else the numpy reader; `readers` counts
    the chunks each read."""
    def read(buf: bytes, lo: int, hi: int, is_gpu: bool, cols: _Columns, name_ok: dict) -> int:
        seen = scan_chunk(buf, lo, hi, is_gpu, cols, names)
        if seen is not None:
            readers["c"] += 1
            return seen
        readers["numpy"] += 1
        return _read_chunk(buf, lo, hi, is_gpu, cols, name_ok)
    return read


def reduce_file(path: "str | Path", rules=None, cpu: Optional[bool] = None) -> tuple[RankTotals, TraceMeta]:
    """One rank file reduced as it is read. Raises TraceError naming the file."""
    red = _Reduction(rules, cpu)
    readers = {"c": 0, "numpy": 0}
    try:
        _, meta = parse_columns(path, on_chunk=red, read_chunk=_scanned_chunk(NameIndex(), readers))
        red.finish()
        return red.totals([], readers), meta
    except _Unordered:
        pass
    # a thread's ops out of start order: all rows at once, which is what the table does
    red = _Reduction(rules, cpu)
    cols, meta = parse_columns(path)
    red.cols = cols
    if red.cpu is None:
        red.cpu = not meta.is_gpu
    red.add(cols.drain(), final=True)
    note = (f"{path}: CPU ops out of start order on a thread: read whole, so memory grew with the file")
    return red.totals([note], {"c": 0, "numpy": 0}), meta


def _reduce_one(path: str, workers: int = 1, as_payload: bool = False, rules=None, cpu: Optional[bool] = None):
    """(path, totals, meta, error): load.parse_all's reader for one file."""
    try:
        totals, meta = reduce_file(path, rules, cpu)
        return path, totals, meta, None
    except TraceError as e:
        return path, None, None, str(e)
    except Exception as e:  # any other damage: name the file, keep going with the other ranks
        return path, None, None, f"{path}: {type(e).__name__}: {e}"


def reduce_files(files: list[Path], workers: int, rules=None, cpu: Optional[bool] = None) -> list:
    """(path, totals, meta, error) of each file, by the numpy reduction: rank files in processes of their
    own past the crossover (STREAM_PROCESSES_MIN_BYTES)."""
    with small_pages():
        return parse_all(files, workers, one=partial(_reduce_one, rules=rules, cpu=cpu),
                         min_bytes=STREAM_PROCESSES_MIN_BYTES)


# Rank files in processes of their own from this much JSON handed to the others.
# Measured on this project's 2-core machine (benchmarks/trace_crossover.py --stream,
# results/cpu_trace_stream_crossover.txt).
# One process already keeps both cores busy: decompression in its thread, the C scanner in the main one.
# So a worker gains only where the scanning and the self times outweigh the decompression.
# vLLM CPU traces: 0.91-1.15x with 4.5 MB handed over, 1.09-1.10x with 10 MB, 1.26-1.39x from 25 MB.
# The GPU replay's sparse traces: 0.62-0.82x with 3.5 MB, 0.92-0.96x with 10 MB, 1.08x with 25 MB.
# At 8 MB the dense traces gain from 20 MB up, and the sparse ones lose a few percent at 20 MB.
STREAM_PROCESSES_MIN_BYTES = 8 << 20
