"""A paced OpenAI-style streaming server whose own log is the ground truth for client fidelity.

One thread, one selector: requests are read as they arrive (their arrival stamped with
CLOCK_MONOTONIC), and one ticker writes the next chunk to every open stream every --itl-ms,
straight to the socket, stamping each write. A tick that is due is not held up by a burst of new
connections: those still waiting are accepted and read after it. The first chunk goes out at the first tick after the
request, so the true TTFT is at most one ITL. On SIGTERM/SIGINT the log is written as JSON:
[{"recv_ns", "writes_ns": [...], "n"}, ...]; on SIGUSR1 the streams finished so far go to LOG.<n> (n = 1, 2, ...)
and are forgotten, so a long soak does not grow the server. Also answers /tokenize and /detokenize for clients that
build prompts through the server.

python benchmarks/paced_server.py --port 8800 --itl-ms 20 --log truth.json
"""
import argparse
import json
import os
import selectors
import signal
import socket
import sys
import time

HEADER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
          b"Connection: close\r\n\r\n")


class Stream:
    __slots__ = ("sock", "left", "n", "recv_ns", "writes", "pending", "idx")

    def __init__(self, sock, n, recv_ns, idx):
        self.sock, self.left, self.n, self.recv_ns, self.idx = sock, n, n, recv_ns, idx
        self.writes = []
        self.pending = b""


def _chunk(i: int, last_of: "int | None") -> bytes:
    """Token i's event; for the last token of a stream of `last_of`, with the usage record and [DONE]."""
    chunk = (b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" t'
             + str(i).encode() + b'","logprobs":null,"finish_reason":null}]}\n\n')
    if last_of is not None:
        chunk += (b'data: {"id":"cmpl-1","object":"text_completion","choices":[],"usage":'
                  b'{"prompt_tokens":1,"completion_tokens":' + str(last_of).encode()
                  + b',"total_tokens":' + str(last_of + 1).encode() + b'}}\n\ndata: [DONE]\n\n')
    return chunk


def json_response(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: "
            + str(len(data)).encode() + b"\r\n\r\n" + data)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    itl_ns = int(args.itl_ms * 1e6)
    sel = selectors.DefaultSelector()
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", args.port))
    lsock.listen(4096)
    lsock.setblocking(False)
    sel.register(lsock, selectors.EVENT_READ, "accept")
    partial: dict = {}
    streams: list[Stream] = []
    done: list[Stream] = []
    stop = [False]

    def on_signal(*_):
        stop[0] = True
    rotate = [0]

    def on_usr1(*_):  # a long soak: write the finished streams so far to LOG.<n> and forget them
        rotate[0] += 1
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_usr1)
    rotated = 0
    print("ready", flush=True)
    next_tick = time.monotonic_ns() + itl_ns
    count = 0
    chunks: dict = {}   # the bytes of each token's event, built once
    while not stop[0]:
        if rotate[0] != rotated:
            rotated = rotate[0]
            _write_log(f"{args.log}.{rotated}", done)
            done = []
        timeout = max(0.0, (next_tick - time.monotonic_ns()) / 1e9)
        for key, _ in sel.select(timeout):
            if time.monotonic_ns() >= next_tick:
                break  # the tick first; requests still waiting are read after it (select is level-triggered)
            if key.data == "accept":
                try:
                    while time.monotonic_ns() < next_tick:
                        c, _ = lsock.accept()
                        c.setblocking(False)
                        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        sel.register(c, selectors.EVENT_READ, "read")
                        partial[c] = b""
                except BlockingIOError:
                    pass
                continue
            c = key.fileobj
            try:
                data = c.recv(65536)
            except (BlockingIOError, ConnectionResetError):
                data = b""
            now = time.monotonic_ns()
            if not data:
                sel.unregister(c)
                partial.pop(c, None)
                c.close()
                continue
            buf = partial[c] + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                partial[c] = buf
                continue
            head = buf[:end].decode(errors="replace")
            length = 0
            for line in head.split("\r\n")[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            if len(buf) < end + 4 + length:
                partial[c] = buf
                continue
            body = json.loads(buf[end + 4:end + 4 + length] or b"{}")
            path = head.split()[1]
            sel.unregister(c)
            partial.pop(c, None)
            if path.endswith("/tokenize"):
                c.sendall(json_response({"tokens": [100 + (ord(ch) % 500) for ch in body.get("prompt", "")][:4096]}))
                c.close()
            elif path.endswith("/detokenize"):
                c.sendall(json_response({"prompt": " ".join(str(t) for t in body.get("tokens", []))}))
                c.close()
            else:
                c.sendall(HEADER)
                streams.append(Stream(c, int(body.get("max_tokens", 16)), now, count))
                count += 1
        now = time.monotonic_ns()
        if now >= next_tick:
            next_tick += itl_ns
            if next_tick < now:  # fell behind: realign rather than burst
                next_tick = now + itl_ns
            alive = []
            for s in streams:
                s.left -= 1
                if s.left >= 0:
                    key = s.n - s.left if s.left else (s.n - s.left, s.n)
                    chunk = chunks.get(key)
                    if chunk is None:
                        chunk = chunks[key] = _chunk(s.n - s.left, s.n if s.left == 0 else None)
                    try:
                        s.sock.send(chunk)
                    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                        pass
                    s.writes.append(time.monotonic_ns())
                if s.left <= 0:
                    try:
                        s.sock.close()
                    except OSError:
                        pass
                    done.append(s)
                else:
                    alive.append(s)
            streams = alive
    _write_log(args.log, done + streams)
    return 0


def _write_log(path: str, streams: list) -> None:
    log = [{"recv_ns": s.recv_ns, "writes_ns": s.writes, "n": s.n} for s in streams]
    with open(path + ".tmp", "w") as f:
        json.dump(log, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
