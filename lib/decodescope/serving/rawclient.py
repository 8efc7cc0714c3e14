"""A lean streaming HTTP/1.1 client on asyncio, for hundreds of concurrent streams.

Each stream has its own non-blocking socket, read with `loop.add_reader` and `recvmsg`: every piece of
data carries the kernel's receive timestamp (SO_TIMESTAMPNS, the time it reached the socket), turned
into CLOCK_MONOTONIC, so a chunk's time is when it arrived, not when a busy event loop got to it. Where
the kernel gives no stamp, the read time is used (and counted). Several content events of one stream
in one read are "coalesced": they all carry that read's stamp (the earlier ones' own arrival is
unknown), and are counted too. Each piece of data is cut into SSE events; only the usage record (once
per request) and error events are JSON-decoded, content chunks are recognised by their bytes. This
keeps the client's own cost per chunk to a few microseconds, so at high concurrency the times measured
are the server's, not the client's queueing.
"""
from __future__ import annotations

import asyncio
import collections
import errno
import functools
import ipaddress
import json
import os
import select
import socket
import struct
import time
import weakref
from typing import Optional
from urllib.parse import urlsplit

from decodescope.serving.client import RequestRecord, RequestSpec, request_body

# A token chunk is an event with a non-empty "choices" list, whatever its text: a token whose text is
# empty (a special token, or bytes of an incomplete UTF-8 character the server holds back) still
# arrived. This is how `vllm bench serve` counts, so TTFT/ITL/TPOT compare. The usage record has
# "choices": [].
CHOICES_MARKERS = (b'"choices":[{', b'"choices": [{')

# Linux: SO_TIMESTAMPNS asks for a struct timespec (CLOCK_REALTIME) with every read, in a cmsg of the
# same type; for TCP it is the stamp of the last buffer the read consumed. Python's socket module
# lacks the constants.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SCM_TIMESTAMPNS = getattr(socket, "SCM_TIMESTAMPNS", SO_TIMESTAMPNS)
_TIMESPEC = struct.Struct("@qq")
_TIMESPEC_UNPACK = _TIMESPEC.unpack_from
_ANC_SIZE = socket.CMSG_SPACE(_TIMESPEC.size)
_SOL_SOCKET = socket.SOL_SOCKET
READ_SIZE = 65536
KERNEL_STAMPS = True   # False: every chunk is stamped when it is read (what the fallback does)


class _Stream:
    """One request's connection: reads with the kernel's receive stamp, parses status line, chunked
    encoding and SSE events, and classifies how it ended. `done` is set when the socket is closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, record: RequestRecord,
                 done: asyncio.Future):
        self.loop = loop
        self.sock = sock
        self.record = record
        self.done = done
        self.head = b""
        self.status: Optional[int] = None
        self.chunked = False
        self.raw = bytearray()        # body bytes not yet de-chunked
        self.events = bytearray()     # de-chunked SSE text not yet cut into events
        self.error_body = bytearray()
        self.kernel_stamp = False     # whether the last read's time is the kernel's receive stamp
        self.closed = False
        self.done_seen = False        # the stream's own end, `data: [DONE]`: an end without it was a cut

    def start(self) -> None:
        self.loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self):
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(READ_SIZE, _ANC_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(e)
            return
        now = None
        for level, kind, cdata in anc:
            if kind == SCM_TIMESTAMPNS and level == _SOL_SOCKET and len(cdata) >= 16:
                sec, nsec = _TIMESPEC_UNPACK(cdata)
                # CLOCK_REALTIME -> CLOCK_MONOTONIC, with the offset read now
                now = sec * 1_000_000_000 + nsec - (time.time_ns() - time.monotonic_ns())
        self.kernel_stamp = now is not None
        if now is None:
            now = time.monotonic_ns()
        if not data:  # the server closed: the end of the response
            self.close(None)
            return
        self.data_received(data, now)

    def data_received(self, data: bytes, now: int):
        # The common case, one whole content event in one read of a plain (not chunked) stream, without
        # cutting; anything else (usage, errors, several or partial events) goes the general way below.
        if (self.status == 200 and not self.chunked and not self.events and data.startswith(b"data: {")
                and data.endswith(b"}\n\n") and data.find(b"\n\n") == len(data) - 2
                and (CHOICES_MARKERS[0] in data or CHOICES_MARKERS[1] in data)
                and b'"usage"' not in data and not data.startswith(b'data: {"error"')):
            rec = self.record
            if rec.first_chunk_ns is None:
                rec.first_chunk_ns = now
            rec.chunk_ns.append(now)
            rec.n_out_chunks += 1
            if self.kernel_stamp:
                rec.n_chunks_kernel_ts += 1
            return
        if self.status is None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4:]
            lines = head.split(b"\r\n")
            try:
                self.status = int(lines[0].split()[1])
            except (IndexError, ValueError):
                self._fail("malformed_stream", f"bad HTTP status line {lines[0][:80]!r}")
                return
            hdrs = b"\r\n".join(lines[1:]).lower()
            self.chunked = b"transfer-encoding: chunked" in hdrs
        if self.status >= 400:
            self.error_body += data
            return
        if self.chunked:
            self.raw += data
            self._dechunk()
        else:
            self.events += data
        self._cut_events(now)

    def _dechunk(self):
        raw = self.raw
        while True:
            nl = raw.find(b"\r\n")
            if nl < 0:
                return
            try:
                size = int(bytes(raw[:nl]).split(b";")[0], 16)
            except ValueError:
                self._fail("malformed_stream", "bad chunk size in a chunked response")
                return
            if size == 0:
                del raw[:]
                return
            if len(raw) < nl + 2 + size + 2:
                return
            self.events += raw[nl + 2:nl + 2 + size]
            del raw[:nl + 2 + size + 2]

    def _cut_events(self, now: int):
        buf = self.events
        end = buf.rfind(b"\n\n")
        if end < 0:
            return
        complete = bytes(buf[:end])
        del buf[:end + 2]
        rec = self.record
        n_content = 0
        for event in complete.split(b"\n\n"):
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                self.done_seen = True
                continue
            if not (payload.startswith(b"{") and payload.endswith(b"}")):  # cheap check: no JSON decode
                self._fail("malformed_stream", f"undecodable event {payload[:80]!r}")
                return
            if payload.startswith(b'{"error"'):
                self._fail("stream_error", payload[:500].decode(errors="replace"))
                return
            if b'"usage"' in payload:
                try:
                    doc = json.loads(payload)
                except json.JSONDecodeError as e:
                    self._fail("malformed_stream", f"undecodable usage event: {e}")
                    return
                if doc.get("object") == "error":
                    self._fail("stream_error", payload[:500].decode(errors="replace"))
                    return
                usage = doc.get("usage") or {}
                rec.n_out_usage = usage.get("completion_tokens")
                rec.n_in_usage = usage.get("prompt_tokens")
            if CHOICES_MARKERS[0] in payload or CHOICES_MARKERS[1] in payload:
                if rec.first_chunk_ns is None:
                    rec.first_chunk_ns = now
                rec.chunk_ns.append(now)
                rec.n_out_chunks += 1
                n_content += 1
        if n_content:
            if self.kernel_stamp:
                rec.n_chunks_kernel_ts += n_content
            rec.n_chunks_coalesced += n_content - 1  # all but the last carry a later arrival than theirs

    def _fail(self, cls: str, text: str):
        if self.record.error_class is None:
            self.record.error_class, self.record.error_text = cls, text
        self.close(None)

    def close(self, exc: Optional[BaseException]):
        """Stop reading, close the socket, classify the end (once)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.remove_reader(self.sock.fileno())
        except (ValueError, OSError, RuntimeError):  # never added, or the loop is closing
            pass
        self.sock.close()
        self.connection_lost(exc)

    def connection_lost(self, exc):
        rec = self.record
        rec.end_ns = time.monotonic_ns()
        if rec.error_class is None:
            if self.status is None:
                rec.error_class, rec.error_text = "connection_reset", f"closed before a response ({exc})"
            elif self.status >= 400:
                rec.error_class = f"http_{self.status // 100}xx"
                rec.error_text = f"HTTP {self.status}: {self.error_body[:500].decode(errors='replace')}"
            elif exc is not None or (self.chunked and self.raw):
                rec.error_class, rec.error_text = "connection_reset", f"stream cut: {exc or 'incomplete chunk'}"
            elif rec.n_out_usage is None and rec.first_chunk_ns is None:
                # without its [DONE] the server's socket closed after the response header and before any
                # event: an API server killed mid-level ends its streams so (a resumed sweep measures such a
                # level again)
                rec.error_class, rec.error_text = (
                    ("malformed_stream", "stream ended ([DONE]) with no content chunk") if self.done_seen else
                    ("connection_reset", "stream cut after the response header"))
            elif rec.n_out_usage is None:
                rec.error_class, rec.error_text = "connection_reset", "stream ended before the usage record"
        if not self.done.done():
            self.done.set_result(None)


def build_request(base_url: str, spec: RequestSpec, api_key: Optional[str]) -> tuple[Optional[str], int, bytes]:
    u = urlsplit(base_url)
    path, body = request_body(spec)
    data = json.dumps(body, separators=(",", ":")).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {u.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{auth}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    return u.hostname, u.port or 80, head + data


@functools.lru_cache(maxsize=256)
def _numeric_family(host: Optional[str]) -> Optional[int]:
    if host is None:  # a URL without a host: ip_address(None) raised ValueError here, so None all the same
        return None
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


async def _addresses(loop: asyncio.AbstractEventLoop, host: Optional[str], port: int) -> list[tuple]:
    """(family, sockaddr) to try in turn; a numeric address without a resolver call."""
    family = _numeric_family(host)
    if family is not None:
        return [(family, (host, port))]
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    if not infos:
        raise OSError(f"getaddrinfo({host!r}) returned nothing")
    return [(fam, addr) for fam, _type, _proto, _canon, addr in infos]


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until a connecting socket's handshake ends (either way: SO_ERROR says which)."""
    fut = loop.create_future()
    # the callback's value is dropped by the loop; `or` only skips set_result on a done future
    loop.add_writer(sock.fileno(), lambda: fut.done() or fut.set_result(None))  # type: ignore[func-returns-value]
    try:
        await fut
    finally:
        loop.remove_writer(sock.fileno())


async def _connect(loop: asyncio.AbstractEventLoop, host: Optional[str], port: int) -> socket.socket:
    """A connected non-blocking TCP socket that stamps what it receives (SO_TIMESTAMPNS)."""
    last: Optional[OSError] = None
    for family, addr in await _addresses(loop, host, port):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if KERNEL_STAMPS:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                except OSError:  # no receive stamps here: every chunk falls back to its read time
                    pass
            err = sock.connect_ex(addr)
            if err == 0:
                return sock
            if err != errno.EINPROGRESS:
                raise OSError(err, os.strerror(err))
            # loopback and near hosts finish the handshake in microseconds: wait here briefly first (poll,
            # not select: at 1,024 streams the descriptors pass select's FD_SETSIZE)
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            if not poller.poll(5):
                await _writable(loop, sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            return sock
        except OSError as e:
            sock.close()
            last = e
        except BaseException:  # cancelled or timed out while connecting
            sock.close()
            raise
    assert last is not None  # _addresses() gave at least one address, and each failed one set it
    raise last


# Connection starts are paced: a burst of START_BURST at once, then START_RATE_PER_S.
# Without pacing, hundreds of streams can end in the same server step.
# At a level's start all requests go out together, and with equal lengths they stay in step.
# Their successors then all start at once, taking tens of ms of this loop's time.
# Each start costs ~50-100 us, connect and close included.
# No socket is read meanwhile, so chunks of other streams pile up and coalesce.
# Paced, a level's first requests spread over a few hundred ms and the streams fall out of step.
# The rate is above what a level of 1,024 streams of 32 tokens at 20 ms needs (about 1,500 starts/s).
# It is near what this client can start while also reading that many streams.
# At 1,024 streams, 16 + 2,500/s measured no coalesced chunk in 7 of 8 rounds.
# In the same test 32 + 4,000/s had them in 6.
# The wait is before the request is written, so it is in connect_us, not in TTFT.
START_BURST = 16
START_RATE_PER_S = 2500.0


class _StartGate:
    """A token bucket of connection starts, one per event loop. It never holds its loop (it is the value
    of a weak dictionary keyed by the loop; the loop's timer holds the gate, not the other way round), so
    a loop closed with starts still waiting is freed with its gate."""

    def __init__(self):
        self.tokens = float(START_BURST)
        self.t = time.monotonic()
        self.waiters: collections.deque = collections.deque()
        self.armed = False

    def _refill(self):
        now = time.monotonic()
        self.tokens = min(float(START_BURST), self.tokens + (now - self.t) * START_RATE_PER_S)
        self.t = now

    async def enter(self, loop: asyncio.AbstractEventLoop):
        if not self.waiters:
            self._refill()
            if self.tokens >= 1:
                self.tokens -= 1
                return
        fut = loop.create_future()
        self.waiters.append(fut)
        if not self.armed:
            self._arm(loop)
        try:
            await fut
        except BaseException:  # cancelled (a timeout, Ctrl-C, the loop shutting down): no longer waiting
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass
            raise

    def _arm(self, loop):
        self.armed = True
        loop.call_later(max((1 - self.tokens) / START_RATE_PER_S, 0.0005), self._release)

    def _release(self):
        self.armed = False
        loop = asyncio.get_running_loop()  # a timer's callback runs in its loop
        self._refill()
        while self.waiters and self.tokens >= 1:
            fut = self.waiters.popleft()
            if not fut.done():          # not cancelled meanwhile (a timeout)
                fut.set_result(None)
                self.tokens -= 1
        if self.waiters:
            self._arm(loop)


_GATES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _StartGate]" = weakref.WeakKeyDictionary()


def _gate(loop: asyncio.AbstractEventLoop) -> _StartGate:
    g = _GATES.get(loop)
    if g is None:
        g = _GATES[loop] = _StartGate()
    return g


_timeout = getattr(asyncio, "timeout", None)   # Python 3.11+: a deadline without a task of its own


async def _request(loop: asyncio.AbstractEventLoop, host: Optional[str], port: int, request: bytes,
                   record: RequestRecord, done: asyncio.Future, held: list) -> None:
    sock = await _connect(loop, host, port)
    stream = _Stream(loop, sock, record, done)
    held.append(stream)
    # TTFT counts from the moment the request is written: with hundreds of streams starting at once, the
    # time a connection waited for this event loop is the client's, not the server's
    now = time.monotonic_ns()
    record.connect_us = (now - record.send_ns) / 1e3
    record.send_ns = now
    try:
        n = sock.send(request)
        if n < len(request):
            await loop.sock_sendall(sock, memoryview(request)[n:])
    except (BlockingIOError, InterruptedError):
        await loop.sock_sendall(sock, request)
    except OSError as e:  # the server closed before the request was written
        stream.close(e)
        return
    stream.start()
    await done


async def send_streaming_raw(base_url: str, spec: RequestSpec, record: RequestRecord,
                             api_key: Optional[str] = None) -> RequestRecord:
    """One streaming request on its own connection; every failure lands in error_class/error_text."""
    loop = asyncio.get_running_loop()
    record.send_ns = time.monotonic_ns()
    await _gate(loop).enter(loop)
    host, port, request = build_request(base_url, spec, api_key)
    record.n_in_sent = len(spec.prompt_token_ids)
    done = loop.create_future()
    held: list[_Stream] = []
    try:
        if _timeout is not None:
            async with _timeout(spec.timeout_s):
                await _request(loop, host, port, request, record, done, held)
        else:
            await asyncio.wait_for(_request(loop, host, port, request, record, done, held), timeout=spec.timeout_s)
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one
        if record.error_class is None:
            record.error_class, record.error_text = "timeout", f"no complete response within {spec.timeout_s} s"
    except OSError as e:  # refused, unreachable: nothing listens there
        if record.error_class is None:
            record.error_class, record.error_text = "server_down", f"{type(e).__name__}: {e}"[:500]
    finally:
        if held:
            held[0].close(None)   # a no-op when it ended by itself; after a timeout it keeps the timeout class
    if record.end_ns is None:
        record.end_ns = time.monotonic_ns()
    return record
