"""The columns a trace parse keeps, interned as it reads (the layout reader, the decoder and the C scanner
all fill one `_Columns`), and the table they become."""
from __future__ import annotations

import json
from array import array
from typing import Any, Callable, Optional, Union

import numpy as np
import pandas as pd

from decodescope.trace.reader import _json_string

_loads: Callable[[Union[bytes, str]], Any]
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
