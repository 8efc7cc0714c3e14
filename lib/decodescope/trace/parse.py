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
from zlib import error as zlib_error
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

try:  # 2-3x faster decoding of the kept events; the stdlib decoder is the fallback
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads

CHUNK_BYTES = 4 << 20
EVENT_END = "\n  }"
EVENT_START = "\n  {"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
# CPU ops kept on a GPU trace: those that describe communication (their args carry message sizes);
# runtime calls kept: those that launch work. Each is written once and used twice: on decoded events
# (_wanted) and, as a lookahead, on the raw text (_keep_pattern).
COMM_NAME = (r"nccl|gloo|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
             r"broadcast|send|recv|barrier")
LAUNCH_NAME = r"Launch|GraphLaunch|Memcpy|Memset"
COMM_CPU_OP = re.compile(COMM_NAME, re.I)
LAUNCH_RUNTIME = re.compile(LAUNCH_NAME, re.I)
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

    def extend(self, evs: list[dict]) -> None:
        if not evs:
            return
        args = [ev.get("args") or {} for ev in evs]
        for col, key in (("ts", "ts"), ("dur", "dur")):
            values = [ev.get(key, 0.0) for ev in evs]
            try:
                self.num[col].extend(values)
            except TypeError:
                self.num[col].extend([_as_float(v) for v in values])
        ints = self.int
        _extend_ints(ints["pid"], [ev.get("pid", -1) for ev in evs])
        _extend_ints(ints["tid"], [ev.get("tid", -1) for ev in evs])
        for col, key in (("stream", "stream"), ("correlation", "correlation"), ("external_id", "External id"),
                         ("in_nelems", "In msg nelems"), ("out_nelems", "Out msg nelems"), ("group_size", "Group size")):
            _extend_ints(ints[col], [a.get(key, -1) for a in args])
        for col, values in (("name", [ev.get("name") for ev in evs]), ("cat", [ev.get("cat") for ev in evs]),
                            ("coll_name", [a.get("Collective name") for a in args]),
                            ("coll_dtype", [a.get("dtype") for a in args]),
                            ("pg_name", [a.get("Process Group Name") for a in args])):
            d = self.dicts[col]
            codes = []
            for v in values:
                if v is None:
                    codes.append(-1)
                    continue
                c = d.get(v)
                if c is None:
                    c = d[v] = len(d)
                codes.append(c)
            self.codes[col].extend(codes)

    def payload(self) -> dict:
        return {"num": {k: a.tobytes() for k, a in self.num.items()},
                "int": {k: a.tobytes() for k, a in self.int.items()},
                "codes": {k: a.tobytes() for k, a in self.codes.items()},
                "dicts": {k: list(d) for k, d in self.dicts.items()}}

    def merge(self, payload: dict) -> None:
        """Append a worker's columns, re-coding its strings into this table's dictionaries."""
        import numpy as np

        for k, b in payload["num"].items():
            self.num[k].frombytes(b)
        for k, b in payload["int"].items():
            self.int[k].frombytes(b)
        for k, b in payload["codes"].items():
            local = payload["dicts"][k]
            remap = np.array([self._code(k, v) for v in local] + [-1], dtype=np.int32)
            codes = np.frombuffer(b, dtype=np.int32)
            self.codes[k].frombytes(remap[codes].astype(np.int32).tobytes())

    def frame(self) -> pd.DataFrame:
        import numpy as np

        data = {}
        # np.frombuffer views the arrays' memory: no copy while the table is built
        for k, a in self.num.items():
            data[k] = np.frombuffer(a, dtype=np.float64) if len(a) else np.array([], dtype=np.float64)
        for k, a in self.int.items():
            data[k] = np.frombuffer(a, dtype=np.int64) if len(a) else np.array([], dtype=np.int64)
        for k, a in self.codes.items():
            cats = list(self.dicts[k])
            codes = np.frombuffer(a, dtype=np.int32) if len(a) else np.array([], dtype=np.int32)
            data[k] = pd.Categorical.from_codes(codes, categories=cats) if cats else \
                pd.Categorical([None] * len(codes))
        df = pd.DataFrame(data)
        df = df.rename(columns={"ts": "ts_us", "dur": "dur_us"})
        return df


def _extend_ints(arr: array, values: list) -> None:
    try:
        arr.extend(values)
    except (TypeError, OverflowError):  # a string pid ("Spans") or a float: convert one by one
        arr.extend([_as_int(v) for v in values])


def _as_float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _as_int(v) -> int:
    if type(v) is int:
        return v
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


def _wanted(ev: dict, is_gpu: bool) -> bool:
    cat = ev.get("cat", "")
    if cat in GPU_CATS or cat == "user_annotation":
        return True
    if cat == "cpu_op":
        return not is_gpu or bool(COMM_CPU_OP.search(ev.get("name", "")))
    if cat in ("cuda_runtime", "cuda_driver"):
        return bool(LAUNCH_RUNTIME.search(ev.get("name", "")))
    return False


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


def iter_event_batches(path: Path, meta: TraceMeta) -> Iterator["str | list[dict]"]:
    """A chunk's worth of events at a time: Kineto text bodies (str) to be decoded by decode_body,
    or, for traces laid out otherwise, lists of decoded events.

    Kineto's layout: one event per "\n  {" ... "\n  }", "ph" and "cat" first. A chunk is cut at its
    last complete event; a regex finds the heads of the kept events in C, and only those are decoded,
    in one call per chunk."""
    try:
        f = _open_text(path)
        sc = _Scanner(f)
        header, pos = _read_header(sc, path)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    meta.header = header  # type: ignore[attr-defined]
    try:
        while len(sc.buf) - pos < 64 and sc.more():
            pass
        rest = sc.buf[pos:].lstrip(" \t\r\n")
        if rest.startswith("]"):
            meta.trailer = rest[1:] + sc.f.read()  # type: ignore[attr-defined]
            return
        if rest.startswith("{\n"):
            for body in _kineto_bodies(sc, pos, path, meta):
                yield body
        else:
            yield from _generic_batches(sc, pos, path, meta)
    except (OSError, EOFError, gzip.BadGzipFile, zlib_error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is damaged or truncated") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: invalid JSON in an event ({e})") from None
    finally:
        meta.bytes_json = sc.bytes_read
        f.close()


def _keep_pattern(is_gpu: bool) -> re.Pattern:
    """The head of every Kineto event parse_trace keeps. The regex engine finds them in C, so Python
    touches only kept events: GPU work and annotations, runtime calls that launch something, and CPU
    ops (on a GPU trace only those that communicate)."""
    comm = r'|cpu_op",\s*"name": "(?=[^"]*(?i:' + COMM_NAME + "))" if is_gpu else '|cpu_op"'
    return re.compile(r'\n  \{\s*"ph": "X",\s*"cat": "(?:kernel"|gpu_memcpy"|gpu_memset"|gpu_user_annotation"'
                      r'|user_annotation"|cuda_(?:runtime|driver)",\s*"name": "(?=[^"]*(?i:' + LAUNCH_NAME + "))"
                      + comm + ")")


_KEEP = {True: _keep_pattern(True), False: _keep_pattern(False)}


def _kineto_bodies(sc: "_Scanner", pos: int, path: Path, meta: TraceMeta) -> Iterator[str]:
    """The chunk's complete events as text ("\n  {...\n  },..."); the rest waits for the next chunk."""
    sc.buf = sc.buf[pos:]
    while True:
        more = sc.more()
        buf = sc.buf
        cut = buf.rfind(EVENT_END)
        if not more:
            tail_start = cut + len(EVENT_END) if cut >= 0 else 0
            tail = buf[tail_start:].lstrip(" \t\r\n")
            if not tail.startswith("]"):
                raise TraceError(f"{path}: truncated: the traceEvents array never closes")
            meta.trailer = tail[1:]  # type: ignore[attr-defined]
        if cut < 0:
            if not more:
                return
            continue
        body = "\n  " + buf[:cut + len(EVENT_END)].lstrip(" \t\r\n,")
        sc.buf = buf[cut + len(EVENT_END):]
        meta.events_seen += body.count(EVENT_START)
        yield body
        if not more:
            return


def decode_body(body: str, is_gpu: bool) -> list[dict]:
    """The kept events of a Kineto text body, decoded in one call; the text prefilter already applied
    the same rules as _wanted, so these need no second filter."""
    find = body.find
    kept = [body[p:find(EVENT_END, p) + 4] for p in (m.start() for m in _KEEP[is_gpu].finditer(body))]
    return _loads("[" + ",".join(kept) + "]") if kept else []


def _body_payload(body: str, is_gpu: bool) -> tuple[dict, int]:
    """What a worker process sends back: typed columns as bytes, string dictionaries as lists."""
    cols = _Columns()
    kept = decode_body(body, is_gpu)
    cols.extend(kept)
    return cols.payload(), len(kept)


def _generic_batches(sc: "_Scanner", pos: int, path: Path, meta: TraceMeta) -> Iterator[list[dict]]:
    decoder = json.JSONDecoder()
    batch: list[dict] = []
    while True:
        while True:
            while pos < len(sc.buf) and sc.buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(sc.buf) or not sc.more():
                break
        if pos >= len(sc.buf):
            raise TraceError(f"{path}: truncated: the traceEvents array never closes")
        if sc.buf[pos] == "]":
            meta.trailer = sc.buf[pos + 1:] + sc.f.read()  # type: ignore[attr-defined]
            break
        while True:
            try:
                ev, new_pos = decoder.raw_decode(sc.buf, pos)
                break
            except json.JSONDecodeError:
                if not sc.more():
                    raise TraceError(f"{path}: truncated or invalid JSON near byte {sc.bytes_read}") from None
        pos = new_pos
        meta.events_seen += 1
        if ev.get("cat") != "python_function":
            batch.append(ev)
        if pos > CHUNK_BYTES:
            sc.buf, pos = sc.buf[pos:], 0
            yield batch
            batch = []
    if batch:
        yield batch


def parse_trace(path: str | Path, workers: int = 1) -> tuple[pd.DataFrame, TraceMeta]:
    """One rank's trace -> (events table, metadata). Raises TraceError naming the file.

    With workers > 1, chunks are decoded in that many processes while this one decompresses and cuts
    the next ones; at most 2 x workers chunks are in flight, so memory stays bounded."""
    path = Path(path)
    meta = TraceMeta(path=str(path), rank=None, rank_source="", world_size=None, backend=None,
                     is_gpu=False, trace_id=None, base_time_ns=None)
    cols = _Columns()
    is_gpu: Optional[bool] = None
    pool = None
    pending: list = []
    try:
        for batch in iter_event_batches(path, meta):
            if is_gpu is None:
                is_gpu = bool(getattr(meta, "header", {}).get("deviceProperties"))
            if isinstance(batch, str):
                if workers > 1:
                    if pool is None:
                        from concurrent.futures import ProcessPoolExecutor

                        pool = ProcessPoolExecutor(max_workers=workers)
                    pending.append(pool.submit(_body_payload, batch, is_gpu))
                    while len(pending) >= 2 * workers:
                        payload, n = pending.pop(0).result()
                        cols.merge(payload)
                        meta.events_kept += n
                    continue
                kept = decode_body(batch, is_gpu)
            else:  # decoded by the generic path, unfiltered
                kept = [ev for ev in batch if ev.get("ph") == "X" and _wanted(ev, is_gpu)]
            cols.extend(kept)
            meta.events_kept += len(kept)
        for fut in pending:
            payload, n = fut.result()
            cols.merge(payload)
            meta.events_kept += n
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
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
