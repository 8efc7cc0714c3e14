"""Kineto / Chrome traces (.json or .json.gz) -> a columnar table, in one streamed pass.

A reader thread decompresses the file chunk by chunk (zlib releases the GIL, so decompression runs on
one core while the events are found on another) and hands the chunks over through a queue of two; the
parser cuts each chunk at its last complete event and carries the rest over. Memory is the chunks in
flight (CHUNK_BYTES each, at most four) and one chunk's index arrays (some 20 bytes a byte of text)
plus the kept columns, whatever the file's size; there is no second copy of the decompressed text.

Torch's Kineto writer lays every event out as "\\n  {" ... "\\n  }", its keys as '"key": value'. On that
layout nothing is decoded into Python objects but the names of the kept events: numpy finds the quotes,
the keys and the event starts in the chunk's bytes, tells the keys apart, and reads the values of the
kept events from their offsets (numbers parsed in numpy, names sliced once and interned). `python_function`
events, most of a with_stack trace, and everything else not kept cost only those array passes. A chunk
that layout reading cannot take whole (an escaped quote, a key without its space, a name that is not a
string) is decoded with orjson, its kept events only; traces laid out otherwise (compact JSON from
other tools) fall back to a streaming `raw_decode`.

Only numpy and orjson are imported here; pandas when the table is built (`_Columns.frame`).
"""
from __future__ import annotations

import json
import re
from array import array
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# the reading itself (numpy-free) lives in reader.py; its names are re-exported here for the callers
from decodescope.trace.reader import (  # noqa: F401
    CHUNK_BYTES, COMM_CPU_OP, COMM_NAME, EVENT_END, EVENT_START, GPU_CATS, KEPT_CATS, LAUNCH_NAME, LAUNCH_RUNTIME, PAD,
    RANK_IN_NAME, TraceError, TraceMeta, _generic, _gunzip, _json_string, _kineto, _parse_trailer, _rank_from_name,
    _read_header, _Reader, _wanted, body_start, finish_meta, json_size, name_rule, new_meta, opened)

if TYPE_CHECKING:
    import pandas as pd

try:  # 2-3x faster decoding of the kept events; the stdlib decoder is the fallback
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads



# ---- the kept columns --------------------------------------------------------------------------------
class _Columns:
    """Typed columns, kept as numpy parts until the table is built; strings are interned into
    per-column dictionaries (code -1: missing)."""

    NUM = ("ts", "dur")
    INT = ("pid", "tid", "stream", "correlation", "in_nelems", "out_nelems", "group_size", "external_id")
    STR = ("name", "cat", "coll_name", "coll_dtype", "pg_name")
    DTYPE = {**{k: np.float64 for k in NUM}, **{k: np.int64 for k in INT}, **{k: np.int32 for k in STR}}

    def __init__(self):
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in self.DTYPE}
        self.dicts: dict[str, dict] = {k: {} for k in self.STR}
        self.raw: dict[str, dict[bytes, int]] = {k: {} for k in self.STR}  # undecoded text -> code
        self.rows = 0
        self.drained = 0  # rows handed out by drain()

    def code(self, col: str, value) -> int:
        if value is None:
            return -1
        d = self.dicts[col]
        c = d.get(value)
        if c is None:
            c = d[value] = len(d)
        return c

    def code_raw(self, col: str, texts: list[bytes]) -> np.ndarray:
        """Codes of JSON string contents as they are in the file (escapes undone only for new ones)."""
        raw = self.raw[col]
        get = raw.get
        codes = [get(t, -2) for t in texts]
        if -2 in codes:
            for i, t in enumerate(texts):
                if codes[i] == -2:
                    c = get(t)
                    if c is None:
                        c = raw[t] = self.code(col, _json_string(t))
                    codes[i] = c
        return np.array(codes, dtype=np.int32)

    def add(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Append n rows; a column not given is missing (-1) in them."""
        if not n:
            return
        for k, dt in self.DTYPE.items():
            a = arrays.get(k)
            if a is None:
                a = np.full(n, 0.0 if dt is np.float64 else -1, dtype=dt)
            self.parts[k].append(np.asarray(a, dtype=dt))
        self.rows += n

    def extend(self, evs: list[dict]) -> None:
        """Append decoded events (the orjson and generic paths)."""
        if not evs:
            return
        args = [ev.get("args") or {} for ev in evs]
        arrays = {}
        for col in self.NUM:
            arrays[col] = _floats([ev.get(col, 0.0) for ev in evs])
        arrays["pid"] = _ints([ev.get("pid", -1) for ev in evs])
        arrays["tid"] = _ints([ev.get("tid", -1) for ev in evs])
        for col, key in ARG_INT.items():
            arrays[col] = _ints([a.get(key, -1) for a in args])
        code = self.code
        arrays["name"] = np.array([code("name", ev.get("name")) for ev in evs], dtype=np.int32)
        arrays["cat"] = np.array([code("cat", ev.get("cat")) for ev in evs], dtype=np.int32)
        for col, key in ARG_STR.items():
            arrays[col] = np.array([code(col, a.get(key)) for a in args], dtype=np.int32)
        self.add(arrays, len(evs))

    def drain(self) -> dict[str, np.ndarray]:
        """The rows added since the last drain, one array a column, let go here (the string
        dictionaries stay: codes mean the same from one drain to the next)."""
        out = {}
        for k, parts in self.parts.items():
            out[k] = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, self.DTYPE[k]))
            parts.clear()
        self.drained += self.rows
        self.rows = 0
        return out

    def payload(self) -> dict:
        """What a worker process sends back: each column as one array (its parts let go as it is
        joined), the dictionaries as lists."""
        cols = {}
        for k, parts in self.parts.items():
            cols[k] = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, self.DTYPE[k]))
            parts.clear()
        return {"rows": self.rows, "cols": cols, "dicts": {k: list(d) for k, d in self.dicts.items()}}

    def merge(self, payload: dict) -> None:
        """Append a worker's columns, re-coding its strings into this table's dictionaries."""
        arrays = dict(payload["cols"])
        for k in self.STR:
            remap = np.array([self.code(k, v) for v in payload["dicts"][k]] + [-1], dtype=np.int32)
            arrays[k] = remap[arrays[k]]
        self.add(arrays, payload["rows"])

    def take(self, other: "_Columns") -> None:
        """Append another table's columns (handed over, not copied), re-coding its strings."""
        for k in self.STR:
            remap = np.array([self.code(k, v) for v in other.dicts[k]] + [-1], dtype=np.int32)
            other.parts[k] = [remap[a] for a in other.parts[k]]
        for k, parts in other.parts.items():
            self.parts[k].extend(parts)
            parts.clear()
        self.rows += other.rows
        other.rows = 0

    def frame(self, rank: "Optional[int | np.ndarray]" = None) -> "pd.DataFrame":
        """The table; each column's parts are joined and let go one column at a time, so building it
        costs one column of memory more than the table. With `rank`, a rank column is appended (an int
        for all rows, or an array)."""
        import pandas as pd

        data = {}
        for k, parts in self.parts.items():
            a = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, self.DTYPE[k]))
            parts.clear()
            if k in self.STR:
                cats = list(self.dicts[k])
                # no strings at all: the dtype pd.Categorical([None] * n) has (float64 categories), built
                # without the list
                data[k] = pd.Categorical.from_codes(a, categories=cats) if cats else \
                    pd.Categorical.from_codes(a, dtype=pd.CategoricalDtype(pd.Index([], dtype="float64")))
            else:
                data[k] = a
        df = pd.DataFrame(data, copy=False)
        df = df.rename(columns={"ts": "ts_us", "dur": "dur_us"})
        if rank is not None:
            df["rank"] = rank
        return df


ARG_INT = {"stream": "stream", "correlation": "correlation", "external_id": "External id",
           "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems", "group_size": "Group size"}
ARG_STR = {"coll_name": "Collective name", "coll_dtype": "dtype", "pg_name": "Process Group Name"}


def _floats(values: list) -> np.ndarray:
    """Numbers as float64; anything else one at a time (_as_float: a numeric string read, else 0.0)."""
    try:
        return np.frombuffer(array("d", values), dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_as_float(v) for v in values], dtype=np.float64)


def _ints(values: list) -> np.ndarray:
    """Integers as int64; anything else one at a time (_as_int: converted where it can be, else -1)."""
    try:
        return np.frombuffer(array("q", values), dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_as_int(v) for v in values], dtype=np.int64)


def _as_float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _as_int(v) -> int:
    if type(v) is int:
        return v if -(1 << 63) <= v < (1 << 63) else -1
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return -1


# ---- memory: small pages ------------------------------------------------------------------------------
@contextmanager
def small_pages() -> Iterator[None]:
    """numpy asks the kernel for 2 MiB pages on its big arrays (madvise). Where transparent huge pages
    are on for madvised memory with direct compaction (defrag 'madvise', a common default), each such
    page fault can stall for hundreds of microseconds while the kernel compacts memory: here, building
    and analysing a 4M-row table took 2.5 s + 3.6 s of system time with them, 0.9 s + 0.35 s without.
    So they are off while the table is made, and restored after."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # pragma: no cover  (numpy 1.x)
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            yield
            return
    before = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(before)


# ---- the Kineto layout, read with numpy ------------------------------------------------------------
NUM_WINDOW = 21  # bytes read for a number: 18 digits, a sign, a dot and what ends it
_DELIMS = np.zeros(256, bool)
_DELIMS[list(b",\n\r\t }]")] = True
_POW10 = 10.0 ** np.arange(19)
_TWO53 = 1 << 53
# the kept categories, in a fixed order: the layout reader's category ids
_CPU_OP, _RUNTIME, _DRIVER = 5, 6, 7
# the keys read: top level (before "args") and inside args
TOP_KEYS = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "args")
ARG_KEYS = tuple(ARG_INT.values()) + tuple(ARG_STR.values())
_KEYS = TOP_KEYS + ARG_KEYS
_KEY_ID = {k: i for i, k in enumerate(_KEYS)}


_TAIL_BYTES = 7  # a key's last bytes a fingerprint holds; longer keys are then compared whole
_TAIL_MASK = np.array([~((1 << (8 * (8 - min(n, _TAIL_BYTES)))) - 1) & ((1 << 64) - 1) for n in range(256)],
                      dtype=np.uint64)


def _fingerprint(A: np.ndarray, end: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Of each string ending before `end` (its closing quote) and `length` bytes long: its last seven
    bytes and its length, as one uint64 (the whole string up to seven bytes)."""
    tail = sliding_window_view(A, 8)[np.maximum(end - 8, 0)].view(np.uint64).ravel()
    n = np.minimum(length, 255).astype(np.uint64)
    return (tail & _TAIL_MASK[n]) | n


def _fingerprints(words) -> np.ndarray:
    text = b"".join(b" " * 8 + b'"' + w.encode() + b'"' for w in words)
    ends = np.cumsum([10 + len(w) for w in words]) - 1
    return _fingerprint(np.frombuffer(text, np.uint8), ends, np.array([len(w) for w in words]))


_KEY_FP = _fingerprints(_KEYS)
assert len(set(_KEY_FP.tolist())) == len(_KEYS), "two keys read share a fingerprint"
_FP_ORDER = np.argsort(_KEY_FP).astype(np.int8)
_FP_SORTED = _KEY_FP[_FP_ORDER]


_CAT_FP = _fingerprints(KEPT_CATS)
_CAT_FP_ORDER = np.argsort(_CAT_FP).astype(np.int8)
_CAT_FP_SORTED = _CAT_FP[_CAT_FP_ORDER]


class _NotLayout(Exception):
    """This chunk is not one the layout reader can take whole: decode it instead."""


def _parse_numbers(A: np.ndarray, starts: np.ndarray, width: int = NUM_WINDOW
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The JSON numbers starting at `starts`: (mantissa as int64, digits after the dot, negative, ok).
    ok is False where the text is not a plain decimal of at most 18 digits ending inside `width` bytes
    (an exponent, a string, null, a longer number): the caller reads those another way. One byte
    column of all the numbers at a time, until every number has ended."""
    n = len(starts)
    neg = A[starts] == 45
    at = starts + neg  # past the sign; moved one byte a column
    num = np.zeros(n, np.int64)
    dot_at = np.full(n, -1, np.int64)  # column of the dot
    dots = np.zeros(n, np.int8)
    end_at = np.zeros(n, np.int64)  # column of the byte that ends the number
    end_byte = np.zeros(n, np.uint8)
    alive = np.ones(n, bool)
    step, tmp, digit, dot, end = np.empty(n, bool), np.empty(n, np.int64), np.empty(n, bool), \
        np.empty(n, bool), np.empty(n, bool)
    for c in range(width - 1):
        col = A[at]
        d = col - np.uint8(48)
        np.less_equal(d, np.uint8(9), out=digit)
        np.logical_and(alive, digit, out=step)
        np.multiply(num, 10, out=tmp)
        tmp += d
        np.putmask(num, step, tmp)
        np.equal(col, 46, out=dot)
        np.logical_or(digit, dot, out=end)
        dot &= alive
        np.putmask(dot_at, dot, c)
        dots += dot
        np.logical_not(end, out=end)
        end &= alive
        np.putmask(end_at, end, c)
        np.putmask(end_byte, end, col)
        alive &= ~end
        if not alive.any():
            break
        at += 1
    frac = np.where(dot_at >= 0, end_at - dot_at - 1, 0)
    ndig = end_at - (dot_at >= 0)
    ok = (~alive & _DELIMS[end_byte] & (dots <= 1) & (ndig > 0) & (ndig <= 18) & (dot_at != 0)
          & ((dot_at < 0) | (frac > 0)))
    return num, frac, neg, ok


def _token(buf: bytes, start: int):
    """The JSON value at start (a number, string, literal) decoded one at a time: the rare values
    the vectorised reading leaves."""
    m = _TOKEN.match(buf, start)
    try:
        return _loads(m.group(0)) if m else None
    except ValueError:
        return None


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[^,\s}\]]+')


def _layout_chunk(buf: bytes, lo: int, hi: int, is_gpu: bool, cols: _Columns, name_ok: dict) -> int:
    """The events in buf[lo:hi] (a run of whole Kineto events) read into cols; returns the number of
    events seen. Raises _NotLayout where the chunk must be decoded instead (nothing added then)."""
    if buf.find(b"\\", lo, hi) >= 0 and buf.find(b'\\"', lo, hi) >= 0:
        raise _NotLayout  # an escaped quote: quotes no longer delimit strings alone
    A = np.frombuffer(buf, np.uint8)
    R = A[lo:hi]
    Q = np.flatnonzero(R == 34) + lo  # every quote
    B = np.flatnonzero(R == 123) + lo  # every "{"
    E = B[(A[B - 1] == 32) & (A[B - 2] == 32) & (A[B - 3] == 10)]  # events: "\n  {"
    del B, R  # (temporaries are let go as soon as they are used: memory is a few chunks' worth)
    n_ev = len(E)
    if not n_ev:
        return 0
    kq = np.flatnonzero(A[Q + 1] == 58)  # quotes closing a key: followed by ':'
    if not len(kq) or kq[0] == 0:
        raise _NotLayout
    K = Q[kq]
    Kopen = Q[kq - 1]
    fp = _fingerprint(A, K, K - Kopen - 1)
    pos = np.searchsorted(_FP_SORTED, fp)
    np.minimum(pos, len(_FP_SORTED) - 1, out=pos)
    hit = np.flatnonzero(_FP_SORTED[pos] == fp)
    kid = _FP_ORDER[pos[hit]]
    K, Kopen, kqh = K[hit], Kopen[hit], kq[hit]
    del kq, fp, pos, hit
    # the fingerprint decides keys of up to seven bytes; longer ones are compared whole
    for i in np.unique(kid):
        key = _KEYS[i].encode()
        if len(key) <= _TAIL_BYTES:
            continue
        sel = np.flatnonzero(kid == i)
        same = (sliding_window_view(A, len(key))[Kopen[sel] + 1] == np.frombuffer(key, np.uint8)).all(1)
        kid[sel[~same]] = -1
    keep = kid >= 0
    K, kid, kqh = K[keep], kid[keep], kqh[keep]
    del keep, Kopen
    if (A[K + 2] != 32).any():  # '"key": value' with its one space, as Kineto writes it
        raise _NotLayout
    # the event each key belongs to: the last event start before it
    ev = np.cumsum(np.bincount(np.searchsorted(K, E), minlength=len(K) + 1)[:len(K)]) - 1
    if (ev < 0).any():
        raise _NotLayout
    # "args" splits the event: keys before it are the event's own, keys after it are its args
    is_args = kid == _KEY_ID["args"]
    args_at = np.full(n_ev, np.iinfo(np.int64).max)
    ia = np.flatnonzero(is_args)
    ia = ia[np.r_[True, ev[ia][1:] != ev[ia][:-1]]] if len(ia) else ia
    args_at[ev[ia]] = K[ia]  # the first "args" of each event
    top = K < args_at[ev]
    n_top = len(TOP_KEYS)
    field_ok = np.where(kid < n_top, top, ~top) & ~is_args
    rows = {}
    valid = np.flatnonzero(field_ok)
    by_key = valid[np.argsort(kid[valid], kind="stable")]  # grouped by key, in file order within each
    bounds = np.searchsorted(kid[by_key], np.arange(len(_KEYS) + 1))
    for name, i in _KEY_ID.items():
        r = by_key[bounds[i]:bounds[i + 1]]
        if len(r) > 1:  # the first of each event
            r = r[np.r_[True, ev[r][1:] != ev[r][:-1]]]
        rows[name] = r
    V = K + 3  # where each value starts: after '": '
    # ph == "X"
    r = rows["ph"]
    vx = V[r]
    is_x = np.zeros(n_ev, bool)
    is_x[ev[r]] = (A[vx] == 34) & (A[vx + 1] == 88) & (A[vx + 2] == 34)
    # cat: one of the kept categories, or -1
    r = rows["cat"]
    cat = np.full(n_ev, -1, np.int16)
    r = r[is_x[ev[r]] & (A[V[r]] == 34)]
    if len(r):
        start = V[r] + 1
        stop = Q[np.minimum(kqh[r] + 2, len(Q) - 1)]
        fp = _fingerprint(A, stop, stop - start)
        pos = np.minimum(np.searchsorted(_CAT_FP_SORTED, fp), len(KEPT_CATS) - 1)
        m = np.flatnonzero(_CAT_FP_SORTED[pos] == fp)
        ci = _CAT_FP_ORDER[pos[m]]
        for c in np.unique(ci):  # the fingerprint narrows, the bytes decide
            cb = KEPT_CATS[c].encode()
            sel = m[ci == c]
            sel = sel[(sliding_window_view(A, len(cb))[start[sel]] == np.frombuffer(cb, np.uint8)).all(1)]
            cat[ev[r[sel]]] = c
    cand = np.flatnonzero(cat >= 0)
    if not len(cand):
        return n_ev
    # names of the candidates, sliced once; on a GPU trace CPU ops and runtime calls are kept by name
    where = np.full(n_ev, -1, np.int64)
    r = rows["name"]
    where[ev[r]] = r
    nr = where[cand]
    has_name = nr >= 0
    nr = nr[has_name]
    if (A[V[nr]] != 34).any():
        raise _NotLayout
    texts = [buf[a:b] for a, b in zip((V[nr] + 1).tolist(), Q[kqh[nr] + 2].tolist())]
    keep = np.ones(len(cand), bool)
    for ci in (_CPU_OP, _RUNTIME, _DRIVER):
        pattern = name_rule(KEPT_CATS[ci], is_gpu)
        sel = np.flatnonzero(cat[cand] == ci) if pattern is not None else ()
        if not len(sel):
            continue
        seen = name_ok.setdefault(ci, {})
        text_at = np.cumsum(has_name) - 1  # position in texts of each candidate with a name
        for j in sel:
            t = texts[text_at[j]] if has_name[j] else b""
            ok = seen.get(t)
            if ok is None:
                ok = seen[t] = bool(pattern.search(_json_string(t)))
            keep[j] = ok
    if not keep.all():
        texts = [t for t, k in zip(texts, keep[has_name].tolist()) if k]
        cand, has_name = cand[keep], has_name[keep]
    n = len(cand)
    if not n:
        return n_ev
    kept_at = np.full(n_ev, -1, np.int64)
    kept_at[cand] = np.arange(n)
    arg_rows = {}
    for col, key in ARG_STR.items():  # strings in args (collectives only); checked before anything is interned
        r = rows[key]
        r = r[kept_at[ev[r]] >= 0]
        if (A[V[r]] != 34).any():
            raise _NotLayout
        arg_rows[col] = r
    out: dict[str, np.ndarray] = {}
    name_codes = np.full(n, -1, np.int32)
    name_codes[has_name] = cols.code_raw("name", texts)
    out["name"] = name_codes
    cat_of = cat[cand]
    present, first = np.unique(cat_of, return_index=True)
    cat_codes = np.full(len(KEPT_CATS), -1, np.int32)
    for ci in present[np.argsort(first)]:  # interned in order of appearance, as the decoder would
        cat_codes[ci] = cols.code("cat", KEPT_CATS[ci])
    out["cat"] = cat_codes[cat_of]
    # numbers: every field of every kept event parsed at once
    num_fields = [("ts", "ts", True), ("dur", "dur", True), ("pid", "pid", False), ("tid", "tid", False)]
    num_fields += [(col, key, False) for col, key in ARG_INT.items()]
    at = [rows[key][kept_at[ev[rows[key]]] >= 0] for _, key, _ in num_fields]
    parsed = {}
    for is_float in (True, False):  # apart: the integers are shorter, their loop ends sooner
        group = [r for (_, _, f), r in zip(num_fields, at) if f == is_float]
        parsed[is_float] = _parse_numbers(A, V[np.concatenate(group)])
    offset = {True: 0, False: 0}
    for (col, key, is_float), r in zip(num_fields, at):
        num, frac, neg, ok = parsed[is_float]
        sl = slice(offset[is_float], offset[is_float] + len(r))
        offset[is_float] += len(r)
        dest = kept_at[ev[r]]
        if is_float:
            good = ok[sl] & (num[sl] <= _TWO53)  # exact in a double, then one rounding: as float() reads it
            v = num[sl] / _POW10[np.minimum(frac[sl], 18)]
            a = np.zeros(n, np.float64)
            conv = _as_float
        else:
            good = ok[sl] & (frac[sl] == 0)
            v = num[sl]
            a = np.full(n, -1, np.int64)
            conv = _as_int
        a[dest] = np.where(neg[sl], -v, v)
        for j in np.flatnonzero(~good):  # the rare values not plain decimals: one at a time
            a[dest[j]] = conv(_token(buf, int(V[r[j]])))
        out[col] = a
    for col, r in arg_rows.items():
        if len(r):
            a = np.full(n, -1, np.int32)
            a[kept_at[ev[r]]] = cols.code_raw(col, [buf[s + 1:e] for s, e in zip(V[r].tolist(), Q[kqh[r] + 2].tolist())])
            out[col] = a
    cols.add(out, n)
    return n_ev


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

    With workers > 1 the chunks are read in that many processes while this one decompresses and cuts
    the next ones (at most 2 x workers chunks in flight); worth it only for big files (load.py).
    `on_chunk(cols, is_gpu)` is called as each chunk's rows are added: a reader that reduces them as
    they come (stream.py) drains them there, and memory stays a few chunks whatever the file's size.
    `read_chunk(buf, lo, hi, is_gpu, cols, name_ok)` reads one run of whole Kineto events in this
    process (default _read_chunk; stream.py passes the C scanner's)."""
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
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    methods = mp.get_all_start_methods()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork" if "fork" in methods else None))
    for f in [pool.submit(int) for _ in range(workers)]:  # every worker started before we go on
        f.result()
    return pool
