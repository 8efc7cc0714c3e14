"""A lean streaming HTTP/1.1 client on asyncio's Protocol API, for hundreds of concurrent streams.

Per stream, each arriving piece of data is stamped once (CLOCK_MONOTONIC) and cut into SSE events;
only the usage record (once per request) and error events are JSON-decoded, content chunks are
recognised by their bytes. This keeps the client's own cost per chunk to a few microseconds, so at
high concurrency the times measured are the server's, not the client's queueing.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Optional
from urllib.parse import urlsplit

from decodescope.serving.client import RequestRecord, RequestSpec, request_body

# A token chunk is an event with a non-empty "choices" list, whatever its text: a token whose text is
# empty (a special token, or bytes of an incomplete UTF-8 character the server holds back) still
# arrived. This is how `vllm bench serve` counts, so TTFT/ITL/TPOT compare. The usage record has
# "choices": [].
CHOICES_MARKERS = (b'"choices":[{', b'"choices": [{')


class _StreamProtocol(asyncio.Protocol):
    def __init__(self, request: bytes, record: RequestRecord, done: asyncio.Future):
        self.request = request
        self.record = record
        self.done = done
        self.head = b""
        self.status: Optional[int] = None
        self.chunked = False
        self.raw = bytearray()        # body bytes not yet de-chunked
        self.events = bytearray()     # de-chunked SSE text not yet cut into events
        self.error_body = bytearray()
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport):
        self.transport = transport
        # TTFT counts from the moment the request is written: with hundreds of streams starting at
        # once, the time a connection waited for this event loop is the client's, not the server's
        self.record.connect_us = (time.monotonic_ns() - self.record.send_ns) / 1e3
        self.record.send_ns = time.monotonic_ns()
        transport.write(self.request)

    def data_received(self, data: bytes):
        now = time.monotonic_ns()
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
        for event in complete.split(b"\n\n"):
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
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

    def _fail(self, cls: str, text: str):
        if self.record.error_class is None:
            self.record.error_class, self.record.error_text = cls, text
        if self.transport:
            self.transport.close()

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
                rec.error_class, rec.error_text = "malformed_stream", "stream ended with no content chunk"
            elif rec.n_out_usage is None:
                rec.error_class, rec.error_text = "connection_reset", "stream ended before the usage record"
        if not self.done.done():
            self.done.set_result(None)


def build_request(base_url: str, spec: RequestSpec, api_key: Optional[str]) -> tuple[str, int, bytes]:
    u = urlsplit(base_url)
    path, body = request_body(spec)
    data = json.dumps(body, separators=(",", ":")).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {u.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{auth}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    return u.hostname, u.port or 80, head + data


async def send_streaming_raw(base_url: str, spec: RequestSpec, record: RequestRecord,
                             api_key: Optional[str] = None) -> RequestRecord:
    """One streaming request on its own connection; every failure lands in error_class/error_text."""
    loop = asyncio.get_running_loop()
    host, port, request = build_request(base_url, spec, api_key)
    record.n_in_sent = len(spec.prompt_token_ids)
    done = loop.create_future()
    record.send_ns = time.monotonic_ns()
    transport = None
    try:
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: _StreamProtocol(request, record, done), host, port),
            timeout=spec.timeout_s)
        remaining = spec.timeout_s - (time.monotonic_ns() - record.send_ns) / 1e9
        await asyncio.wait_for(asyncio.shield(done), timeout=max(remaining, 0.001))
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one
        if record.error_class is None:
            record.error_class, record.error_text = "timeout", f"no complete response within {spec.timeout_s} s"
        if transport is not None:
            transport.close()
    except OSError as e:  # refused, unreachable: nothing listens there
        if record.error_class is None:
            record.error_class, record.error_text = "server_down", f"{type(e).__name__}: {e}"[:500]
    if record.end_ns is None:
        record.end_ns = time.monotonic_ns()
    return record
