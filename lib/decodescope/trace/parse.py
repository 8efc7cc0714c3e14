"""Kineto / Chrome traces (.json or .json.gz) -> a columnar table, streamed.

The file is decompressed and scanned in chunks; each event object is cut out of the text and only the
events we need are decoded (`python_function` events, most of a with_stack trace, are skipped by
looking at their first bytes). Kept fields go into typed arrays, so memory is bounded by the kept
events, not by the trace's size. Torch's Kineto writer puts one key per line and closes each event
with "\\n  }"; traces formatted otherwise fall back to a streaming `raw_decode` over the same chunks.
"""
from __future__ import annotations

import gzip
import io
import json
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

CHUNK_BYTES = 8 << 20
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
# CPU ops kept on a GPU trace: those that describe communication (their args carry message sizes).
COMM_CPU_OP = re.compile(r"nccl|gloo|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|"
                         r"all_?to_?all|broadcast|send|recv|barrier", re.I)
LAUNCH_RUNTIME = re.compile(r"Launch|GraphLaunch|Memcpy|Memset", re.I)
COLLECTIVE_ARGS = {"Collective name": "coll_name", "In msg nelems": "in_nelems", "Out msg nelems": "out_nelems",
                   "dtype": "coll_dtype", "Group size": "group_size", "Process Group Name": "pg_name"}
RANK_IN_NAME = re.compile(r"(?:^|[_.\-])rank[_\-]?(\d+)(?=[_.\-])")


class TraceError(ValueError):
    """A trace file that cannot be parsed; the message names the file."""


@dataclass
class TraceMeta:
    path: str
    rank: Optional[int]
    rank_source: str
    world_size: Optional[int]
    backend: Optional[str]
    is_gpu: bool
    trace_id: Optional[str]
    base_time_ns: Optional[int]
    events_seen: int = 0
    events_kept: int = 0
    python_skipped: int = 0
    bytes_json: int = 0
    warnings: list[str] = field(default_factory=list)


class _Columns:
    """Typed, append-only columns; strings are interned into per-column dictionaries."""

    NUM = ("ts", "dur")
    INT = ("pid", "tid", "stream", "correlation", "in_nelems", "out_nelems", "group_size", "external_id")
    STR = ("name", "cat", "coll_name", "coll_dtype", "pg_name")

    def __init__(self):
        self.num = {k: array("d") for k in self.NUM}
        self.int = {k: array("q") for k in self.INT}
        self.codes = {k: array("i") for k in self.STR}
        self.dicts: dict[str, dict[str, int]] = {k: {} for k in self.STR}

    def _code(self, col: str, value) -> int:
        if value is None:
            return -1
        d = self.dicts[col]
        s = str(value)
        c = d.get(s)
        if c is None:
            c = d[s] = len(d)
        return c

    def add(self, ev: dict) -> None:
        args = ev.get("args") or {}
        self.num["ts"].append(float(ev.get("ts", 0.0)))
        self.num["dur"].append(float(ev.get("dur", 0.0)))
        ints = self.int
        ints["pid"].append(_as_int(ev.get("pid")))
        ints["tid"].append(_as_int(ev.get("tid")))
        ints["stream"].append(_as_int(args.get("stream", -1)))
        ints["correlation"].append(_as_int(args.get("correlation", -1)))
        ints["external_id"].append(_as_int(args.get("External id", -1)))
        ints["in_nelems"].append(_as_int(args.get("In msg nelems", -1)))
        ints["out_nelems"].append(_as_int(args.get("Out msg nelems", -1)))
        ints["group_size"].append(_as_int(args.get("Group size", -1)))
        codes = self.codes
        codes["name"].append(self._code("name", ev.get("name")))
        codes["cat"].append(self._code("cat", ev.get("cat")))
        codes["coll_name"].append(self._code("coll_name", args.get("Collective name")))
        codes["coll_dtype"].append(self._code("coll_dtype", args.get("dtype")))
        codes["pg_name"].append(self._code("pg_name", args.get("Process Group Name")))

    def frame(self) -> pd.DataFrame:
        data = {}
        for k, a in self.num.items():
            data[k] = pd.Series(memoryview(a), dtype="float64") if len(a) else pd.Series([], dtype="float64")
        for k, a in self.int.items():
            data[k] = pd.Series(memoryview(a), dtype="int64") if len(a) else pd.Series([], dtype="int64")
        for k, a in self.codes.items():
            cats = list(self.dicts[k])
            codes = pd.Series(memoryview(a), dtype="int32") if len(a) else pd.Series([], dtype="int32")
            data[k] = pd.Categorical.from_codes(codes, categories=cats) if cats else \
                pd.Categorical([None] * len(codes))
        df = pd.DataFrame(data)
        df = df.rename(columns={"ts": "ts_us", "dur": "dur_us"})
        return df


def _as_int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


def _rank_from_name(path: Path) -> Optional[int]:
    m = RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _keep(ev_head: str) -> bool:
    return '"python_function"' not in ev_head


class _Scanner:
    """Cuts the traceEvents array into event texts, chunk by chunk."""

    def __init__(self, f: io.TextIOBase):
        self.f = f
        self.buf = ""
        self.eof = False
        self.bytes_read = 0

    def more(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(CHUNK_BYTES)
        if not chunk:
            self.eof = True
            return False
        self.bytes_read += len(chunk)
        self.buf += chunk
        return True


def _read_header(sc: _Scanner, path: Path) -> tuple[dict, int]:
    """Everything before the traceEvents array, as JSON; returns (header, index after '[')."""
    while True:
        i = sc.buf.find('"traceEvents"')
        if i >= 0:
            j = sc.buf.find("[", i)
            if j >= 0:
                break
        if not sc.more():
            raise TraceError(f"{path}: not a Chrome/Kineto trace (no traceEvents array)")
    head_text = sc.buf[:i].rstrip().rstrip(",")
    header = {}
    if head_text.lstrip().startswith("{"):
        try:
            header = json.loads(head_text + "}")
        except json.JSONDecodeError:
            header = {}
    return header, j + 1


def iter_events(path: Path, meta: TraceMeta) -> Iterator[dict]:
    """Decoded events that pass the cheap python_function filter."""
    try:
        f = _open_text(path)
        sc = _Scanner(f)
        header, pos = _read_header(sc, path)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    meta.header = header  # type: ignore[attr-defined]
    decoder = json.JSONDecoder()
    try:
        while True:
            # skip separators
            while True:
                while pos < len(sc.buf) and sc.buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(sc.buf) or not sc.more():
                    break
            if pos >= len(sc.buf):
                meta.warnings.append(f"{path}: file ends inside traceEvents (truncated?)")
                raise TraceError(f"{path}: truncated: the traceEvents array never closes")
            if sc.buf[pos] == "]":
                meta.trailer = sc.buf[pos + 1:] + sc.f.read()  # type: ignore[attr-defined]
                break
            end = sc.buf.find("\n  }", pos)
            kineto = sc.buf.startswith("{\n", pos)
            if kineto:
                while end < 0:
                    if not sc.more():
                        raise TraceError(f"{path}: truncated inside an event")
                    end = sc.buf.find("\n  }", pos)
                text = sc.buf[pos:end + 4]
                pos = end + 4
                meta.events_seen += 1
                if not _keep(text[:96]):
                    meta.python_skipped += 1
                else:
                    yield json.loads(text)
            else:
                while True:
                    try:
                        ev, new_pos = decoder.raw_decode(sc.buf, pos)
                        break
                    except json.JSONDecodeError:
                        if not sc.more():
                            raise TraceError(f"{path}: truncated or invalid JSON near byte {sc.bytes_read}") from None
                pos = new_pos
                meta.events_seen += 1
                if ev.get("cat") == "python_function":
                    meta.python_skipped += 1
                else:
                    yield ev
            if pos > CHUNK_BYTES:
                sc.buf = sc.buf[pos:]
                pos = 0
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is damaged or truncated") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: invalid JSON in an event ({e})") from None
    finally:
        meta.bytes_json = sc.bytes_read
        f.close()


def parse_trace(path: str | Path) -> tuple[pd.DataFrame, TraceMeta]:
    """One rank's trace -> (events table, metadata). Raises TraceError naming the file."""
    path = Path(path)
    meta = TraceMeta(path=str(path), rank=None, rank_source="", world_size=None, backend=None,
                     is_gpu=False, trace_id=None, base_time_ns=None)
    cols = _Columns()
    is_gpu: Optional[bool] = None
    for ev in iter_events(path, meta):
        if is_gpu is None:
            header = getattr(meta, "header", {})
            is_gpu = bool(header.get("deviceProperties"))
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in GPU_CATS or cat == "user_annotation":
            pass
        elif cat == "cpu_op":
            if is_gpu and not COMM_CPU_OP.search(ev.get("name", "")):
                continue
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            if not LAUNCH_RUNTIME.search(ev.get("name", "")):
                continue
        else:
            continue
        cols.add(ev)
        meta.events_kept += 1
    header = getattr(meta, "header", {})
    trailer = _parse_trailer(getattr(meta, "trailer", ""))
    info = header.get("distributedInfo") or trailer.get("distributedInfo") or {}
    meta.is_gpu = bool(header.get("deviceProperties") or trailer.get("deviceProperties")) or \
        bool(cols.dicts["cat"].get("kernel") is not None)
    meta.trace_id = header.get("trace_id") or trailer.get("trace_id")
    meta.base_time_ns = header.get("baseTimeNanoseconds") or trailer.get("baseTimeNanoseconds")
    meta.backend = info.get("backend")
    meta.world_size = info.get("world_size")
    if info.get("rank") is not None:
        meta.rank, meta.rank_source = int(info["rank"]), "distributedInfo"
    else:
        meta.rank, meta.rank_source = _rank_from_name(path), "file name"
    if not header and not trailer and meta.events_seen == 0:
        raise TraceError(f"{path}: no events: not a Kineto trace")
    df = cols.frame()
    df["rank"] = meta.rank if meta.rank is not None else -1
    return df, meta


def _parse_trailer(text: str) -> dict:
    text = (text or "").strip().lstrip(",").strip()
    if not text or text == "}":
        return {}
    try:
        return json.loads("{" + text)
    except json.JSONDecodeError:
        return {}
