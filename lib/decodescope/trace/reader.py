"""Reading a trace file without numpy.

This module holds the decompression thread and the reading of the header.
It cuts the traceEvents array into runs of whole events (the Kineto layout) or decoded batches (any other layout).
It reads the metadata from the header and trailer.
parse.py reads the runs into columns with numpy.
creduce.py reduces them in C, so the streamed breakdown starts without importing numpy at all."""
from __future__ import annotations

import codecs
import json
import queue
import re
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional
from decodescope.engines import engine

# Decompressed bytes per chunk.
# CPU time to read 50 MB of a vLLM CPU trace with 1, 2, 4, 8 MiB chunks: 0.46, 0.45, 0.54, 0.69 s.
# For 25 MB of the GPU step replay: 0.15, 0.15, 0.16, 0.19 s.
# A chunk and its index arrays stay in the caches up to ~2 MiB.
# Below 1 MiB the fixed cost per chunk (~0.4 ms) shows.
CHUNK_BYTES = 1 << 20
EVENT_END = "\n  }"
EVENT_START = "\n  {"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
# the categories of the events read into columns, in the order the C scanner (_kscan.c) numbers them
KEPT_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "user_annotation", "cpu_op",
             "cuda_runtime", "cuda_driver")
# what the breakdowns count as GPU work: the streamed one and the table's (analyze.GPU_WORK_CATS)
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# CPU ops kept on a GPU trace: those that describe communication (their args carry message sizes).
# Runtime calls kept: those that launch work, and those that wait for it (the critical path's sync edges).
# name_rule says which applies where.
# The patterns are written once and used in three places: on decoded events, in a lookahead on the raw
# text (parse._keep_pattern), and on the names the layout reader and the C scanner slice.
COMM_NAME = (r"nccl|gloo|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
             r"broadcast|send|recv|barrier")
LAUNCH_NAME = r"Launch|GraphLaunch|Memcpy|Memset|Synchronize"
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


def _json_string(raw: bytes) -> str:
    """The contents of a JSON string as the file holds them -> the string."""
    if b"\\" in raw:
        try:
            return json.loads(b'"' + raw + b'"')
        except ValueError:
            pass
    return raw.decode("utf-8", "replace")


def _rank_from_name(path: Path) -> Optional[int]:
    m = RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def name_rule(cat: str, is_gpu: bool) -> Optional[re.Pattern]:
    """The pattern an event of a kept category must match by its name to be kept, or None where every
    name is kept: CPU ops on a GPU trace only where they communicate, runtime and driver calls only
    where they launch work or wait for it (on any trace). The one statement of the rule: _wanted, _keep_pattern, the
    layout reader, the C scanner and the C reduction's count of kept events all follow it."""
    if cat == "cpu_op":
        return COMM_CPU_OP if is_gpu else None
    if cat in ("cuda_runtime", "cuda_driver"):
        return LAUNCH_RUNTIME
    return None


def _wanted(ev: dict, is_gpu: bool) -> bool:
    cat = ev.get("cat", "")
    if cat not in KEPT_CATS:
        return False
    rule = name_rule(cat, is_gpu)
    return rule is None or bool(rule.search(ev.get("name", "")))


# ---- reading: decompression in a thread ------------------------------------------------------------
def json_size(path: Path) -> int:
    """The file's decompressed size: a .gz file's own record of it (ISIZE, the size modulo 4 GiB), or a
    guess from the compressed size where that record has wrapped."""
    path = Path(path)
    size = path.stat().st_size
    if path.suffix != ".gz":
        return size
    try:
        with open(path, "rb") as f:
            f.seek(-4, 2)
            isize = int.from_bytes(f.read(4), "little")
    except OSError:
        return 8 * size
    while isize < size:  # wrapped past 4 GiB: at least the compressed size, traces compress ~8x
        isize += 1 << 32
    return isize


def _gunzip(f, chunk_bytes: int) -> Iterator[bytes]:
    """A gzip stream (several members too) as decompressed chunks of about chunk_bytes."""
    d = zlib.decompressobj(31)
    fed = False  # has the current member had any input
    parts: list[bytes] = []
    n = 0
    while True:
        data = f.read(1 << 18)
        if not data:
            break
        while data:
            if not fed and not data.strip(b"\0"):  # zero padding after the last member
                break
            fed = True
            out = d.decompress(data, chunk_bytes)
            data = d.unconsumed_tail
            if out:
                parts.append(out)
                n += len(out)
                if n >= chunk_bytes:
                    yield b"".join(parts) if len(parts) > 1 else parts[0]
                    parts, n = [], 0
            if d.eof:  # a member ends: what follows it (all in unused_data) starts the next one
                data = d.unused_data
                d = zlib.decompressobj(31)
                fed = False
    if fed and not d.eof:
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")
    if parts:
        yield b"".join(parts)


class _Reader:
    """The file's decompressed bytes, chunk by chunk, produced by a thread a couple of chunks ahead."""

    def __init__(self, path: Path, chunk_bytes: Optional[int] = None):
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.stop = threading.Event()
        self.bytes_read = 0
        self.thread = threading.Thread(target=self._run, name=f"trace-reader:{self.path.name}", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if self.path.suffix == ".gz":
                    chunks = _gunzip(f, self.chunk_bytes)
                else:
                    chunks = iter(lambda: f.read(self.chunk_bytes), b"")
                for chunk in chunks:
                    if not self._put(chunk):
                        return
            self._put(None)
        except BaseException as e:  # handed to the parser, which raises it as a TraceError
            self._put(e)

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            self.bytes_read += len(item)
            yield item

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():
            try:
                self.q.get(timeout=0.05)
            except queue.Empty:
                pass
        self.thread.join()


PAD = b" " * 64  # after a chunk's text, so that every window read stays inside the buffer


# ---- one file --------------------------------------------------------------------------------------
def _read_header(chunks: Iterator[bytes], path: Path) -> tuple[dict, bytes]:
    """Everything before the traceEvents array, as JSON, and the bytes after its '['."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        i = buf.find(b'"traceEvents"')
        if i >= 0:
            j = buf.find(b"[", i)
            if j >= 0:
                break
    else:
        raise TraceError(f"{path}: not a Chrome/Kineto trace (no traceEvents array)")
    head_text = buf[:i].decode("utf-8", "replace").rstrip().rstrip(",")
    header = {}
    if head_text.lstrip().startswith("{"):
        try:
            header = json.loads(head_text + "}")
        except json.JSONDecodeError:
            header = {}
    return header, buf[j + 1:]


def _kineto(rest: bytes, chunks: Iterator[bytes], path: Path, meta: TraceMeta) -> Iterator[tuple[bytes, int, int]]:
    """(buffer, lo, hi): runs of whole events, cut at the last complete event of each chunk; the part
    event waits for the next chunk. Sets meta.trailer (the text after the array)."""
    tail = b"\n  " + rest.lstrip(b" \t\r\n,")
    it = iter(chunks)
    done = False
    while not done:
        chunk = next(it, None)
        if chunk is None:
            done = True
            chunk = b""
        buf = b"".join((tail, chunk, PAD))
        hi = len(buf) - len(PAD)
        close = buf.find(b"\n  ]", 0, hi)  # Kineto closes the array at the events' indent
        last = buf.rfind(EVENT_END.encode(), 0, close) if close >= 0 else -1
        if last >= 0 and not buf[last + 4:close].strip():  # the array closes here: the rest is the trailer
            end = last + 4
            trailer = buf[close + 4:hi] + b"".join(it)
            meta.trailer = trailer.decode("utf-8", "replace")  # type: ignore[attr-defined]
            done = True
        else:
            cut = buf.rfind(EVENT_END.encode(), 0, hi)
            if done:
                if not buf[cut + 4 if cut >= 0 else 0:hi].strip(b" \t\r\n,").startswith(b"]"):
                    raise TraceError(f"{path}: truncated: the traceEvents array never closes")
                meta.trailer = buf[buf.index(b"]", cut + 4 if cut >= 0 else 0) + 1:hi].decode("utf-8", "replace")  # type: ignore[attr-defined]
            if cut < 0:
                tail = buf[:hi]
                continue
            end = cut + 4
        lo = buf.find(EVENT_START.encode(), 0, end)
        if lo < 0:
            if done:
                return
            tail = buf[end:hi]
            continue
        if buf[:lo].strip(b" \t\r\n,"):
            raise TraceError(f"{path}: invalid JSON between two events")
        yield buf, lo, end
        tail = buf[end:hi]


def _generic(rest: bytes, chunks: Iterator[bytes], path: Path, meta: TraceMeta) -> Iterator[list[dict]]:
    """Traces laid out otherwise: a streaming raw_decode, batch by batch."""
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    buf = utf8.decode(rest)
    it = iter(chunks)

    def more() -> bool:
        nonlocal buf
        chunk = next(it, None)
        if chunk is None:
            return False
        buf += utf8.decode(chunk)
        return True

    decoder = json.JSONDecoder()
    batch: list[dict] = []
    pos = 0
    while True:
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or not more():
                break
        if pos >= len(buf):
            raise TraceError(f"{path}: truncated: the traceEvents array never closes")
        if buf[pos] == "]":
            meta.trailer = buf[pos + 1:] + "".join(utf8.decode(c) for c in it)  # type: ignore[attr-defined]
            break
        while True:
            try:
                ev, new_pos = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                if not more():
                    raise TraceError(f"{path}: truncated or invalid JSON near character {pos}") from None
        pos = new_pos
        meta.events_seen += 1
        if isinstance(ev, dict) and ev.get("cat") != "python_function":
            batch.append(ev)
        if pos > CHUNK_BYTES:
            buf, pos = buf[pos:], 0
            yield batch
            batch = []
    if batch:
        yield batch


def _parse_trailer(text: str) -> dict:
    text = (text or "").strip().lstrip(",").strip()
    if not text or text == "}":
        return {}
    try:
        return json.loads("{" + text)
    except json.JSONDecodeError:
        return {}



def body_start(chunks: Iterator[bytes], path: Path, meta: TraceMeta) -> tuple[bool, bytes, str]:
    """Past the header: (is_gpu by the header, the bytes after the array's '[', layout), layout
    "kineto" (runs for _kineto), "generic" (for _generic) or "empty" (meta.trailer already set).
    Sets meta.header; raises TraceError naming the file (a read that fails raises what `opened` names)."""
    header, rest = _read_header(chunks, path)
    meta.header = header  # type: ignore[attr-defined]
    is_gpu = bool(header.get("deviceProperties"))
    while len(rest.lstrip()) < 2:
        more = next(chunks, None)
        if more is None:
            break
        rest += more
    head = rest.lstrip(b" \t\r\n")
    if head.startswith(b"]"):
        meta.trailer = (head[1:] + b"".join(chunks)).decode("utf-8", "replace")  # type: ignore[attr-defined]
        return is_gpu, rest, "empty"
    return is_gpu, rest, "kineto" if head.startswith(b"{\n") else "generic"


def finish_meta(meta: TraceMeta, saw_kernel: bool) -> None:
    """The rank, world size, backend, ids and device from the header and trailer (the file name for a
    rank they do not give); raises TraceError when the file held neither and no event."""
    header = getattr(meta, "header", {})
    trailer = _parse_trailer(getattr(meta, "trailer", ""))
    info = header.get("distributedInfo") or trailer.get("distributedInfo") or {}
    meta.is_gpu = bool(header.get("deviceProperties") or trailer.get("deviceProperties")) or saw_kernel
    meta.trace_id = header.get("trace_id") or trailer.get("trace_id")
    meta.base_time_ns = header.get("baseTimeNanoseconds") or trailer.get("baseTimeNanoseconds")
    meta.backend = info.get("backend")
    meta.world_size = info.get("world_size")
    if info.get("rank") is not None:
        meta.rank, meta.rank_source = int(info["rank"]), "distributedInfo"
    else:
        meta.rank, meta.rank_source = _rank_from_name(Path(meta.path)), "file name"
    if not header and not trailer and meta.events_seen == 0:
        raise TraceError(f"{meta.path}: no events: not a Kineto trace")


def new_meta(path: Path) -> TraceMeta:
    return TraceMeta(path=str(path), rank=None, rank_source="", world_size=None, backend=None,
                     is_gpu=False, trace_id=None, base_time_ns=None)


@contextmanager
def opened(path: Path) -> Iterator[tuple[TraceMeta, Iterator[bytes]]]:
    """(a new meta, the file's decompressed chunks) with the reader thread running; a read that fails
    (damaged, truncated, invalid JSON) raises TraceError naming the file; meta.bytes_json set at exit."""
    meta = new_meta(path)
    try:
        reader = _Reader(path)
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    try:
        yield meta, iter(reader)
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is damaged or truncated") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: invalid JSON in an event ({e})") from None
    finally:
        reader.close()
        meta.bytes_json = reader.bytes_read


# vLLM's record_function around each engine step, as the CPU side writes it (a GPU trace repeats the name
# under "gpu_user_annotation", which this leaves out); the name is trace.analyze.STEP_NAME's
_STEP_ANNOTATION = engine().step_annotation_json
_STEP_ANNOTATION_MAX_BYTES = 160   # no match is longer: a chunk's tail this long is read again with the next


# a CPU op of the given names as Kineto writes its head; the names are matched literally
_CPU_OP_HEAD = (rb'"cat":\s*"cpu_op",\s*"name":\s*"(%s)",\s*"pid":\s*(-?\d+),\s*"tid":\s*(-?\d+),\s*'
                rb'"ts":\s*([-+.\deE]+),\s*"dur":\s*([-+.\deE]+)')
_CPU_OP_HEAD_MAX_BYTES = 400   # longer than any head of the names asked for: a chunk's tail this long is read again


def named_cpu_ops(path: Path, names: tuple[str, ...]) -> list[tuple[str, float, float, int]]:
    """(name, ts_us, dur_us, tid) of every CPU op of a rank trace named one of `names`, in one streamed pass.

    The column readers keep no such op on a GPU trace (name_rule), so a reader that needs a few names reads them here.
    Memory is a chunk, whatever the file's size; a read that fails raises TraceError naming the file."""
    head = re.compile(_CPU_OP_HEAD % b"|".join(re.escape(n.encode()) for n in names))
    return [_cpu_op_row(m) for m in _streamed_matches(path, head, _CPU_OP_HEAD_MAX_BYTES)]


def _cpu_op_row(m: "re.Match[bytes]") -> tuple[str, float, float, int]:
    return m.group(1).decode(), float(m.group(4)), float(m.group(5)), int(m.group(3))


def annotated_steps(path: Path) -> int:
    """The engine steps in a rank trace, counted from their annotations in one streamed pass (memory: a
    chunk, whatever the file's size); a read that fails raises TraceError naming the file."""
    return sum(1 for _ in _streamed_matches(path, _STEP_ANNOTATION, _STEP_ANNOTATION_MAX_BYTES))


def _streamed_matches(path: Path, pattern: "re.Pattern[bytes]", max_bytes: int) -> Iterator["re.Match[bytes]"]:
    """Each match of `pattern` in a trace's decompressed text, once, read a chunk at a time; no match is longer
    than max_bytes, so a chunk's tail that long is read again with the next chunk."""
    tail = b""
    with opened(Path(path)) as (_, chunks):
        for chunk in chunks:
            text = tail + chunk
            cut = max(len(text) - max_bytes, 0)
            # a match that starts in the kept tail is taken with the next chunk, never twice
            yield from (m for m in pattern.finditer(text) if m.start() < cut)
            tail = text[cut:]
        yield from pattern.finditer(tail)