"""The load generator against a real HTTP server on loopback that streams, fails and dies on purpose."""
import asyncio
import json
import os
import signal
import socket
import threading
import time
from typing import Optional
from pathlib import Path

import pandas as pd
import pytest
from aiohttp import web

from decodescope.serving.client import RequestRecord, RequestSpec, request_body
from decodescope.serving.rawclient import send_streaming_raw
from decodescope.serving.metrics import COALESCED_FRAC_LIMIT, knee, per_request
from decodescope.report.serving_view import coalesced_note
from decodescope.serving.client import run_async
from decodescope.serving.sweep import (SERVER_FAILURE_CLASSES, SweepConfig, arrival_offsets_s, build_prompts,
                                       load_finished_levels, run_level, run_sweep, sweep_prompts, warmup_count)
from tests.conftest import free_port

TOKENS = 8
ITL_S = 0.01
STALL_S = 0.8  # an engine stall: over serving.metrics.STALL_MIN_MS and 50 ITLs
HELD_ITL_S = 0.05  # the held server's pace: its burst's per-token gaps are held to 5% of it (the client's parsing)


def _chunk(text, usage=None):
    d = {"choices": [{"index": 0, "text": text}]}
    if usage:
        d = {"choices": [], "usage": usage}
    return f"data: {json.dumps(d)}\n\n".encode()


async def completions(request: web.Request):
    body = await request.json()
    behaviour = request.app["behaviour"]
    if behaviour == "http500":
        return web.Response(status=500, text="engine dead")
    if behaviour == "http400":
        return web.Response(status=400, text="max_tokens too large")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    if behaviour == "cut":  # the API server killed after its header: its socket closes with no event, no [DONE]
        request.transport.close()
        return resp
    if behaviour == "empty":  # a stream that ends as streams end, with nothing in it
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if behaviour == "held":  # decodes at HELD_ITL_S a token but releases every token at the end, in one burst
        await asyncio.sleep(HELD_ITL_S * n)
        # one write: the burst reaches the client as one read, so the gaps between its tokens are the
        # client's own parsing, not this thread's turns for the GIL between n writes on a loaded host
        await resp.write(b"".join(_chunk(f" t{i}") for i in range(n))
                         + _chunk("", usage={"prompt_tokens": len(body["prompt"]), "completion_tokens": n})
                         + b"data: [DONE]\n\n")
        return resp
    for i in range(n):
        await asyncio.sleep(HELD_ITL_S if behaviour == "paced" else ITL_S)
        if behaviour == "stall_once" and i == 3:  # every stream stands still at once, the first time only
            app = request.app
            app.setdefault("stall_until", time.monotonic() + STALL_S)
            await asyncio.sleep(max(0.0, app["stall_until"] - time.monotonic()))
        if behaviour == "malformed" and i == 2:
            await resp.write(b"data: {not json\n\n")
            return resp
        if behaviour == "reset" and i == 2:
            request.transport.close()
            return resp
        if behaviour == "slow":
            await asyncio.sleep(5)
        await resp.write(_chunk(f" t{i}"))
    await resp.write(_chunk("", usage={"prompt_tokens": len(body["prompt"]), "completion_tokens": n}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def tokenize(request):
    body = await request.json()
    return web.json_response({"tokens": [ord(c) % 200 + 10 for c in body["prompt"]][:64]})


async def detokenize(request):
    body = await request.json()
    return web.json_response({"prompt": " ".join(map(str, body["tokens"]))})


class FakeServer:
    """A real aiohttp server in a thread; `behaviour` switches how it answers."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.app = web.Application()
        self.app["behaviour"] = "ok"
        self.app.router.add_post("/v1/completions", completions)
        self.app.router.add_post("/tokenize", tokenize)
        self.app.router.add_post("/detokenize", detokenize)
        # a handler still sleeping (a 'slow' or hung answer the client gave up on) is cancelled at once on
        # stop: aiohttp's default waits up to 60 s for it, ~4.6 s a test here
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.2)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.site = web.TCPSite(self.runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(self.site.start())
            ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.stop()


def _one(url, timeout_s=5.0):
    async def go():
        spec = RequestSpec("completions", "m", list(range(16)), "", TOKENS, timeout_s)
        return await send_streaming_raw(url, spec, RequestRecord(level=1, index=0, warmup=False, send_ns=0))
    return asyncio.run(go())


def test_a_completions_prompt_goes_as_token_ids_or_as_text_and_nothing_else():
    ids_spec = RequestSpec("completions", "m", [5, 6, 7], "five six seven", 4, 5.0)
    assert request_body(ids_spec) == ("/v1/completions", {
        "model": "m", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "prompt": [5, 6, 7]})
    text_spec = RequestSpec("completions", "m", [5, 6, 7], "five six seven", 4, 5.0, completions_prompt="text")
    assert request_body(text_spec)[1]["prompt"] == "five six seven"
    # refused where the spec or the sweep is made, before a request is built or sent
    with pytest.raises(ValueError, match="completions_prompt 'ids'.*'token_ids' or 'text'"):
        RequestSpec("completions", "m", [5], "five", 4, 5.0, completions_prompt="ids")
    with pytest.raises(ValueError, match="completions_prompt 'ids'.*'token_ids' or 'text'"):
        SweepConfig("http://x", "m", "completions", [1], 4, 4, 2, 0, 5.0, completions_prompt="ids")


def test_ok_stream_records_every_chunk_and_usage(server):
    r = _one(server.url)
    assert r.ok and r.n_out_usage == TOKENS and r.n_out_chunks == TOKENS and r.n_in_usage == 16
    df = per_request(pd.DataFrame([r.to_row()]))
    row = df.iloc[0]
    assert row["ttft_us"] >= ITL_S * 1e6 * 0.9
    assert row["tpot_us"] * (TOKENS - 1) + row["ttft_us"] == pytest.approx(row["e2e_us"])
    # chunks the client read together (its loop stalled >= ITL_S on a loaded host) share the later one's
    # stamp, a gap of 0, and are counted as coalesced; every other gap is the server's pace
    gaps = list(row["itl_us"])
    assert len(gaps) == TOKENS - 1 and gaps.count(0) == r.n_chunks_coalesced < TOKENS - 1
    assert min(g for g in gaps if g > 0) > 0.5 * ITL_S * 1e6


@pytest.mark.parametrize("behaviour,error_class", [("http500", "http_5xx"), ("http400", "http_4xx"),
                                                   ("malformed", "malformed_stream"), ("reset", "connection_reset")])
def test_failures_are_classified(server, behaviour, error_class):
    server.app["behaviour"] = behaviour
    r = _one(server.url)
    assert not r.ok and r.error_class == error_class, (r.error_class, r.error_text)
    assert r.error_text


@pytest.mark.parametrize("behaviour,error_class,text", [
    ("cut", "connection_reset", "stream cut after the response header"),
    ("empty", "malformed_stream", "stream ended ([DONE]) with no content chunk")])
def test_a_stream_cut_before_its_first_event_is_the_servers_failure_and_an_empty_one_is_not(server, behaviour,
                                                                                             error_class, text):
    """A killed API server closes its streams, some before their first event (3 of a level's requests on a
    loaded host): that is the server's failure, which a resumed sweep measures again; a stream that ends with
    its [DONE] and no content is the stream's."""
    server.app["behaviour"] = behaviour
    r = _one(server.url)
    assert (r.error_class, r.error_text) == (error_class, text)
    assert (error_class in SERVER_FAILURE_CLASSES) == (behaviour == "cut")


def test_timeout_is_classified(server):
    server.app["behaviour"] = "slow"
    t0 = time.monotonic()
    r = _one(server.url, timeout_s=0.5)
    assert r.error_class == "timeout" and time.monotonic() - t0 < 3


def test_server_down_is_classified():
    r = _one(f"http://127.0.0.1:{free_port()}")
    assert r.error_class == "server_down"


def test_a_sweep_sends_the_prompts_made_beforehand_and_makes_none(server, tmp_path):
    """run_sweep(prompts=...): the given prompts are the ones sent (5 ids each, where a sweep of its own makes
    16 under the server's tokenizer), so a caller can make them before the moment its requests must start."""
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[1], input_tokens=16,
                      output_tokens=TOKENS, requests_per_level=3, warmup_requests=0, timeout_s=5)
    made = sweep_prompts(cfg)
    assert len(made) == 3 and all(len(ids) == 16 for ids, _ in made)
    given = [([7, 8, 9, 10, 11], "five words of text") for _ in range(3)]
    req, _ = run_sweep(cfg, tmp_path, progress=False, prompts=given)
    assert len(req) == 3 and (req["n_in_usage"] == 5).all(), req["n_in_usage"].tolist()


def test_sweep_keeps_finished_levels_when_the_server_dies(server, tmp_path):
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[1, 2], input_tokens=16,
                      output_tokens=TOKENS, requests_per_level=4, warmup_requests=1, timeout_s=5)
    run_sweep(cfg, tmp_path, progress=False)
    server.stop()
    cfg2 = SweepConfig(**{**cfg.__dict__, "levels": [1, 2, 4]})
    req, levels = run_sweep(cfg2, tmp_path, progress=False)   # 1 and 2 are on disk: only 4 runs
    assert sorted(load_finished_levels(tmp_path)) == [(1, 1), (2, 1), (4, 1)]  # (level, repeat)
    lv = levels.set_index("level")
    assert lv.loc[1, "failed"] == 0 and lv.loc[2, "failed"] == 0
    assert lv.loc[4, "ok"] == 0 and lv.loc[4, "failed"] == 4
    assert "server_down" in lv.loc[4, "failure_reasons"]


def test_output_released_in_bursts_is_flagged(server, tmp_path):
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[2], input_tokens=16,
                      output_tokens=TOKENS, requests_per_level=4, warmup_requests=0, timeout_s=5)
    # streamed at the held server's pace: only a client stall of 50 ms would coalesce its chunks
    server.app["behaviour"] = "paced"
    _, streamed = run_sweep(cfg, tmp_path / "ok", progress=False)
    server.app["behaviour"] = "held"
    _, held = run_sweep(cfg, tmp_path / "held", progress=False)
    assert streamed["itl_coalesced_frac"].iloc[0] < COALESCED_FRAC_LIMIT
    assert held["itl_coalesced_frac"].iloc[0] > 0.5
    # what a held stream looks like: the whole decode time in TTFT, almost nothing per token: under 5% of
    # the pace the server decoded at, where a stream that is not held reads about 100%. The per-token time
    # left is the client's own parsing of the burst, which load stretches: 108 and 124 us on a loaded
    # 2-core host, 611 us on CI beside two vLLM servers.
    assert held["tpot_p50_us"].iloc[0] < 0.05 * HELD_ITL_S * 1e6
    assert held["ttft_p50_us"].iloc[0] > 0.9 * TOKENS * HELD_ITL_S * 1e6
    assert "warning" in coalesced_note(held) and "c=2" in coalesced_note(held)
    assert "warning" not in coalesced_note(streamed)


def test_open_loop_arrivals_have_the_requested_rate():
    offsets = arrival_offsets_s(2000, rate=50.0, burstiness=1.0, seed=1)
    assert offsets[0] == 0 and len(offsets) == 2000
    assert (offsets[-1] / 1999) == pytest.approx(1 / 50.0, rel=0.1)
    assert arrival_offsets_s(10, None, 1.0, 0) is None


def test_knee_is_where_throughput_stops_growing():
    levels = pd.DataFrame({"level": [1, 2, 4, 8, 16], "output_throughput_tok_s": [100, 190, 370, 390, 395]})
    assert knee(levels) == 4
    assert knee(levels.iloc[:3]) is None


def test_vllm_bench_per_request_rows_keep_their_own_start_times(tmp_path):
    from tests.vllm_bench import load_vllm_bench_requests

    doc = {"ttfts": [0.01, 0.0, 0.02], "latencies": [0.1, 0.0, 0.3], "itls": [[0.03] * 3, [], [0.09] * 3],
           "output_lens": [4, 0, 4], "start_times": [5.0, 6.0, 7.0]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    df = load_vllm_bench_requests(path)
    assert list(df["send_ns"]) == [5e9, 7e9]  # the failed request's start time left with it
    assert df["end_ns"].tolist() == pytest.approx([5.1e9, 7.3e9])
    assert df["tpot_us"].tolist() == pytest.approx([30_000.0, 93_333.33], rel=1e-6)


def test_tpot_is_vllm_bench_serves_definition_with_its_edge_cases():
    import numpy as np

    from decodescope.serving.metrics import tpot

    assert tpot(1000.0, 100.0, 4) == pytest.approx(300.0)     # (E2E - TTFT) / (n_out - 1)
    assert np.isnan(tpot(1000.0, 100.0, 1))                   # one token: no time per output token
    assert np.isnan(tpot(1000.0, 100.0, 0))                   # nothing came back
    assert np.isnan(tpot(float("nan"), 100.0, 5))             # a failed request's missing E2E
    s = tpot(pd.Series([1000.0, 1000.0, 500.0], index=[7, 8, 9]), pd.Series([100.0, 100.0, 100.0], index=[7, 8, 9]),
             pd.Series([2, 1, 5], index=[7, 8, 9]))
    assert list(s.index) == [7, 8, 9] and s[7] == 900.0 and np.isnan(s[8]) and s[9] == 100.0


def test_both_tpot_paths_agree_on_a_one_token_request(tmp_path):
    from tests.vllm_bench import load_vllm_bench_requests

    doc = {"ttfts": [0.01, 0.02], "latencies": [0.1, 0.02], "itls": [[0.03] * 3, []], "output_lens": [4, 1]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    theirs = load_vllm_bench_requests(path)["tpot_us"].tolist()
    records = pd.DataFrame({"n_out_usage": [4, 1], "n_out_chunks": [4, 1], "send_ns": [0, 0],
                            "first_chunk_ns": [10_000_000, 20_000_000], "end_ns": [100_000_000, 20_000_000],
                            "chunk_ns": [None, None], "ok": [True, True]})
    ours = per_request(records)["tpot_us"].tolist()
    assert theirs[0] == pytest.approx(30_000.0) == ours[0]
    assert pd.isna(theirs[1]) and pd.isna(ours[1])


def test_littles_note_names_the_levels_over_its_threshold():
    from decodescope.serving.metrics import LITTLES_LIMIT_PCT
    from decodescope.report.serving_view import littles_note

    good = pd.DataFrame({"level": [1, 4, 16], "littles_error_pct": [1.0, 5.0, 12.5]})
    assert f"within {LITTLES_LIMIT_PCT:.0f}% at every level" in littles_note(good)
    assert "worst 12.5%" in littles_note(good)
    bad = good.assign(littles_error_pct=[1.0, 35.0, float("nan")])
    note = littles_note(bad)
    assert "warning" in note and "c=4 (35%)" in note and "c=1" not in note and "every level" not in note
    assert "not checked" in littles_note(good.assign(littles_error_pct=float("nan")))
    assert littles_note(pd.DataFrame({"level": [1]})) == ""


def test_repeats_measure_each_level_again_and_give_a_band(server, tmp_path):
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[1, 2], input_tokens=16,
                      output_tokens=TOKENS, requests_per_level=3, warmup_requests=1, timeout_s=5, repeats=3,
                      telemetry_interval_s=0)
    req, levels = run_sweep(cfg, tmp_path, progress=False)
    assert sorted(load_finished_levels(tmp_path)) == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    reps = pd.read_parquet(tmp_path / "serving_levels_repeats.parquet")
    assert len(reps) == 6 and sorted(reps["repeat"].unique()) == [1, 2, 3]
    assert sorted(req["repeat"].unique()) == [1, 2, 3]
    lv = levels.set_index("level")
    assert (lv["repeats"] == 3).all() and (lv["requests"] == 9).all()      # all requests of the three repeats
    for level, g in reps.groupby("level"):
        assert lv.loc[level, "tpot_p50_us"] == pytest.approx(g["tpot_p50_us"].median())
        assert g["tpot_p50_us"].min() <= lv.loc[level, "tpot_p50_us_low"] <= lv.loc[level, "tpot_p50_us"]
        assert lv.loc[level, "tpot_p50_us"] <= lv.loc[level, "tpot_p50_us_high"] <= g["tpot_p50_us"].max()
    # a repeat lost (a crash) is measured again on rerun, and only it
    (tmp_path / "serving" / "level_00002_r3.parquet").unlink()
    from decodescope.serving.sweep import levels_to_measure
    assert levels_to_measure([1, 2], tmp_path, 3) == [(2, 3)]


# --- the raw client's kernel receive stamps, against a scripted server on a real socket -------------

SSE_HEADER = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
USAGE_DONE = _chunk("", usage={"prompt_tokens": 16, "completion_tokens": 2}) + b"data: [DONE]\n\n"


class ScriptedServer:
    """One connection: reads the request, waits until the client's event loop is blocked (client_blocked),
    then runs `script(conn, write, block_over)` in its thread. `write` sends and logs the clock
    (CLOCK_MONOTONIC ns) just before and just after the send in `writes`, a chunk's arrival lying between
    the two on loopback; the script calls `block_over()` once the chunks meant to arrive during the block
    are sent, and the client's block ends BLOCK_AFTER_S later. Events, not sleeps: on a loaded host either
    thread may be held off its core for tens of ms."""

    def __init__(self, script):
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(1)
        self.url = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.got_request = threading.Event()
        self.client_blocked = threading.Event()
        self.sent_in_block = threading.Event()
        self.writes: list[tuple[int, int]] = []
        self.script = script
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += conn.recv(65536)
        head, body = buf.split(b"\r\n\r\n", 1)
        length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
        while len(body) < length:
            body += conn.recv(65536)
        self.got_request.set()
        self.client_blocked.wait(10)

        def write(data):
            before = time.monotonic_ns()
            conn.sendall(data)
            self.writes.append((before, time.monotonic_ns()))
        self.script(conn, write, self.sent_in_block.set)
        conn.close()
        self.lsock.close()

    def arrived_at(self, stamp_ns: int, i: int) -> bool:
        """A stamp taken as write i arrived: within its send, give or take 0.5 ms for the clocks' conversion."""
        before, after = self.writes[i]
        return before - 500_000 <= stamp_ns <= after + 500_000


BLOCK_AFTER_S = 0.06   # the client's loop stays blocked this long after the server sent what arrives in the block


def _blocked_run(server: ScriptedServer):
    """The raw client's request, with its event loop blocked from before the server's first chunk until
    BLOCK_AFTER_S after the chunks meant for the block were sent. Returns the record and the time the block
    ended (no read can be earlier)."""
    async def go():
        spec = RequestSpec("completions", "m", list(range(16)), "", 2, 10.0)
        task = asyncio.ensure_future(send_streaming_raw(server.url, spec, RequestRecord(1, 0, False, 0)))
        while not server.got_request.is_set():
            await asyncio.sleep(0.001)
        server.client_blocked.set()       # from here the loop can read nothing
        assert server.sent_in_block.wait(10)
        time.sleep(BLOCK_AFTER_S)
        unblocked = time.monotonic_ns()
        return await task, unblocked
    from decodescope.serving.client import run_async
    rec, unblocked = run_async(go())
    server.thread.join(5)
    return rec, unblocked


def test_kernel_stamps_give_arrival_not_read_time():
    def script(conn, write, block_over):
        conn.sendall(SSE_HEADER)
        write(_chunk(" a"))           # arrives while the client's loop is blocked
        block_over()
        time.sleep(0.10)
        write(_chunk(" b"))           # arrives after the block (or during it, on a loaded host: stamped alike)
        conn.sendall(USAGE_DONE)
    srv = ScriptedServer(script)
    rec, unblocked = _blocked_run(srv)
    assert rec.ok and rec.n_out_chunks == 2, (rec.error_class, rec.error_text)
    assert rec.n_chunks_kernel_ts == 2 and rec.n_chunks_coalesced == 0
    first, second = rec.chunk_ns
    assert unblocked - first > 0.05e9                    # stamped >= 60 ms before the loop could read it
    assert srv.arrived_at(first, 0) and srv.arrived_at(second, 1), (first, second, srv.writes)
    assert second - first > 0.09e9                       # the server's 100 ms between the two
    assert rec.first_chunk_ns == first and rec.first_chunk_ns > rec.send_ns


def test_chunks_in_one_read_are_coalesced_and_counted():
    # TCP keeps one stamp per read (the last buffer's; the kernel also merges queued buffers), so two
    # chunks that both wait for a blocked loop carry the later one's arrival
    def script(conn, write, block_over):
        conn.sendall(SSE_HEADER)
        write(_chunk(" a"))
        time.sleep(0.03)
        write(_chunk(" b"))
        block_over()
        time.sleep(0.3)               # after the block: the usage record in a read of its own
        conn.sendall(USAGE_DONE)
    srv = ScriptedServer(script)
    rec, unblocked = _blocked_run(srv)
    assert rec.ok and rec.n_out_chunks == 2, (rec.error_class, rec.error_text)
    assert rec.n_chunks_coalesced == 1 and rec.n_chunks_kernel_ts == 2
    assert rec.chunk_ns[0] == rec.chunk_ns[1]
    assert srv.arrived_at(rec.chunk_ns[1], 1) and unblocked - rec.chunk_ns[1] > 0.05e9


def test_without_kernel_stamps_chunks_get_their_read_time(monkeypatch):
    import decodescope.serving.rawclient as rawclient

    monkeypatch.setattr(rawclient, "KERNEL_STAMPS", False)

    def script(conn, write, block_over):
        conn.sendall(SSE_HEADER)
        write(_chunk(" a"))
        block_over()
        time.sleep(0.10)
        write(_chunk(" b"))
        conn.sendall(USAGE_DONE)
    srv = ScriptedServer(script)
    rec, unblocked = _blocked_run(srv)
    assert rec.ok and rec.n_out_chunks == 2 and rec.n_chunks_kernel_ts == 0
    assert rec.chunk_ns[0] >= unblocked                  # the read time: after the block


def test_connection_starts_are_paced():
    import numpy as np

    from decodescope.serving.client import run_async
    from decodescope.serving.rawclient import START_BURST, START_RATE_PER_S, _gate

    n = START_BURST + 200

    async def go():
        loop = asyncio.get_running_loop()
        times = []

        async def start():
            await _gate(loop).enter(loop)
            times.append(time.monotonic())
        t0 = time.monotonic()
        await asyncio.gather(*(start() for _ in range(n)))
        return np.array(times) - t0
    t = run_async(go())
    assert len(t) == n
    assert t[-1] >= 0.9 * 200 / START_RATE_PER_S          # past the burst, at the rate
    # never more than a burst plus the rate's share, give or take one burst: a start is stamped when its task
    # next runs, so on a loaded host one release's starts can be stamped beside the next one's (an unpaced
    # client puts all 216 in one window)
    window = 0.01
    assert max(np.sum((t >= x) & (t < x + window)) for x in t) <= 2 * START_BURST + window * START_RATE_PER_S + 2


def test_no_descriptor_left_open(server):
    import os

    def fds():
        return len(os.listdir("/proc/self/fd"))
    _one(server.url)                                     # warm: the loop's own descriptors come and go
    before = fds()
    for behaviour, timeout_s in [("ok", 5.0), ("reset", 5.0), ("http500", 5.0), ("slow", 0.3), ("malformed", 5.0)]:
        server.app["behaviour"] = behaviour
        _one(server.url, timeout_s=timeout_s)
    _one(f"http://127.0.0.1:{free_port()}")            # nothing listens
    # the client's sockets are closed when its call returns; the fake server (a thread of this process)
    # closes its side of a request the client gave up on ("slow") when it next writes, so wait for that
    deadline = time.monotonic() + 3.0
    while fds() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fds() == before, sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                   if os.path.exists(f"/proc/self/fd/{fd}"))


def test_a_loop_closed_with_starts_waiting_frees_its_start_gate(monkeypatch):
    """Requests still waiting to start when their loop shuts down (asyncio.run cancels them) leave
    nothing that holds the loop: the gate is a weak dictionary's value keyed by its loop."""
    import gc
    import weakref

    from decodescope.serving import rawclient

    # no refill while the five enter: on a loaded host enough time passed for one token (CI: 4 waited)
    monkeypatch.setattr(rawclient, "START_RATE_PER_S", 1e-9)

    async def main():
        loop = asyncio.get_running_loop()
        gate = rawclient._gate(loop)
        gate.tokens = 0.0  # everything waits
        for _ in range(5):
            asyncio.ensure_future(gate.enter(loop))
        await asyncio.sleep(0)
        assert len(gate.waiters) == 5
        return weakref.ref(loop), weakref.ref(gate)

    loop_ref, gate_ref = asyncio.run(main())
    gc.collect()
    assert loop_ref() is None and gate_ref() is None


def test_littles_law_counts_w_from_the_requests_start_not_its_write():
    from decodescope.serving.metrics import littles_law
    s = 1_000_000_000
    # A waited 0.5 s at the gate/connect (start 0.5 s, written 1.0 s, ended 2.0 s); B started and was
    # written at 1.0 s, ended 2.0 s. In flight over [0.5, 2.0]: 1.5 s + 1.0 s = 2.5 request-s in 1.5 s.
    recs = pd.DataFrame({"send_ns": [1 * s, 1 * s], "end_ns": [2 * s, 2 * s], "connect_us": [500_000.0, 0.0]})
    assert littles_law(recs)["littles_lw"] == pytest.approx(2.5 / 1.5)
    # counted from the write instead, it would read 2.0
    assert littles_law(recs.drop(columns="connect_us"))["littles_lw"] == pytest.approx(2.0)


def _inflight_mean(drive) -> tuple[float, float]:
    """LoopHealth's mean in-flight count over `drive(add)`, a coroutine that moves the count through
    add(k, at_s=None) (InFlight.add); and the same mean from the clock read at each change and around the
    drive: what its sleeps took, which on a loaded host is more than they asked."""
    from decodescope.serving.client import InFlight, LoopHealth

    async def main():
        inflight = InFlight()
        changes: list[tuple[float, int]] = []   # (clock s, the count from then on)

        def add(k: int, at_s: Optional[float] = None) -> None:
            inflight.add(k, at_s)
            changes.append((time.monotonic() if at_s is None else at_s, inflight.n))

        with LoopHealth(inflight=inflight) as health:
            t0 = time.monotonic()
            await drive(add)
            t1 = time.monotonic()
        ordered = sorted(changes)
        ends = [t for t, _ in ordered[1:]] + [t1]
        area = sum(n * (end - t) for (t, n), end in zip(ordered, ends))
        return health.summary()["inflight_sampled_mean"], area / (t1 - t0)

    return asyncio.run(main())


def test_the_inflight_mean_counts_a_stall_at_the_count_it_was_spent_at():
    """The loop starved for 0.5 s with 5 in flight after 0.2 s with 1: (1 x 0.2 + 5 x 0.5) / 0.7 ~ 3.9
    (an unweighted mean of 10 ms samples would read ~1.2)."""
    async def drive(add):
        add(1)
        await asyncio.sleep(0.2)
        add(4)
        time.sleep(0.5)            # the loop is starved for 0.5 s with 5 in flight
        await asyncio.sleep(0.015)

    measured, clocked = _inflight_mean(drive)
    assert clocked == pytest.approx((0.2 + 5 * 0.515) / 0.715, rel=0.15)   # the sleeps as asked, give or take load
    assert measured == pytest.approx(clocked, rel=0.03)


def test_a_request_ending_as_a_stall_ends_does_not_stand_for_the_stall():
    """Concurrency 1: 0.5 s starved with 1 in flight, then the request ends and the next starts 15 ms
    later. The mean stays ~1 (0.015 s at 0 in 0.7 s); a count read as the stall ends, weighted by the
    stall, read 0 for it (L 0.76 against lambda x W 1.00 at concurrency 1 in a CI run)."""
    async def drive(add):
        add(1)
        await asyncio.sleep(0.2)
        time.sleep(0.5)
        add(-1)
        await asyncio.sleep(0.015)  # the loop runs: the lag sampler wakes with 0 in flight
        add(1)
        await asyncio.sleep(0.05)

    measured, clocked = _inflight_mean(drive)
    assert clocked > 0.8
    assert measured == pytest.approx(clocked, abs=0.02)


def test_the_inflight_integral_on_a_clock_of_its_own():
    from decodescope.serving.client import InFlight

    t = {"s": 10.0}
    f = InFlight(clock=lambda: t["s"])
    f.add(3)
    t["s"] = 11.0   # 3 in flight before the window: dropped by start()
    f.start()
    t["s"] = 12.0
    f.add(-2)       # 3 x 1 s
    t["s"] = 15.0   # 1 x 3 s
    assert f.mean() == pytest.approx(6.0 / 4.0)


def test_a_request_leaves_the_count_at_its_end_not_when_its_task_next_runs():
    """W ends at the stream's close (end_ns); the count drops there too. At concurrency 2 on 2 busy cores the
    client stalled 138 ms between one request's end and the next one's start: in L, in no request's W (L 2.00
    against lambda x W 1.91, and 1.64 in a CI run). Own clock: A and B in flight from 10 s, A ended at 12 s,
    seen at 15 s; at 16 s, B still in flight, the mean over 10-16 s is (2 + 6) / 6, not (5 + 6) / 6."""
    from decodescope.serving.client import InFlight

    t = {"s": 10.0}
    f = InFlight(clock=lambda: t["s"])
    f.start()
    f.add(1)
    f.add(1)
    t["s"] = 15.0
    f.add(-1, at_s=12.0)
    t["s"] = 16.0
    assert f.mean() == pytest.approx(8.0 / 6.0)


def test_a_stall_before_the_first_request_or_after_the_last_is_outside_the_window():
    """Lambda x W spans the first request's start to the last one's end; so does L once every request has
    ended. Own clock: the window opened at 10 s, the request got in at 11 s, ended at 13 s (seen then), and
    the loop stalled until 20 s before L was read: L 1.0 (2 request-s in 2 s), not 2 / 10 (at concurrency 1 a
    stall there read L 0.77 against lambda x W 1.00 in a fresh-clone make test)."""
    from decodescope.serving.client import InFlight

    t = {"s": 10.0}
    f = InFlight(clock=lambda: t["s"])
    f.start()
    t["s"] = 11.0
    f.add(1)
    t["s"] = 13.0
    f.add(-1, at_s=13.0)
    t["s"] = 20.0
    assert f.mean() == pytest.approx(1.0)
    # an end before the window began counts from the window's start, never below 0 of area
    g = InFlight(clock=lambda: t["s"])
    g.add(1)
    t["s"] = 17.0
    g.start()
    t["s"] = 18.0
    g.add(-1, at_s=16.5)
    t["s"] = 20.0
    assert g.mean() == pytest.approx(0.0)

    async def drive(add):      # on the real clock, the loop starved 0.3 s after the request's end
        add(1)
        await asyncio.sleep(0.2)
        ended_s = time.monotonic()
        time.sleep(0.3)
        add(-1, at_s=ended_s)
        add(1)
        await asyncio.sleep(0.2)

    measured, clocked = _inflight_mean(drive)
    assert clocked == pytest.approx(0.4 / 0.7, abs=0.1)
    assert measured == pytest.approx(clocked, abs=0.02)


def test_an_interrupt_in_a_kernel_cancels_the_coroutine_on_its_thread(tmp_path):
    """In a Jupyter kernel (a running loop) run_async runs the coroutine on a thread; Ctrl-C, or the runner's
    SIGTERM sent on as one, lands in the waiting main thread. The coroutine is cancelled there and then: a
    level's write after its requests never happens (left alone, the thread finished the level and wrote it
    2.3 s after a SIGTERM)."""
    import threading

    from decodescope.serving.client import run_async

    written = tmp_path / "level.parquet"
    unwound = []

    async def level():
        try:
            await asyncio.sleep(5.0)        # the level's requests
            written.write_text("measured")  # its write, once they are done
        finally:
            unwound.append(time.monotonic())

    async def kernel_cell():                # a cell runs synchronously inside the kernel's loop
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as ipykernel has it while a cell runs
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()   # as the runner interrupts a kernel
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_async(level())
        return time.monotonic() - t0

    took_s = asyncio.run(kernel_cell())
    assert took_s < 2.0 and unwound and not written.exists()


def test_a_request_connects_on_a_descriptor_past_selects_limit(server):
    """At 1,024 streams the client's sockets get descriptors above FD_SETSIZE (1,024)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1500
    if soft < want:
        assert hard == resource.RLIM_INFINITY or hard >= want, f"RLIMIT_NOFILE hard limit {hard} < {want}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    base = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(base) for _ in range(1100)]
    try:
        assert max(held) > 1024
        r = _one(server.url)
        assert r.ok, (r.error_class, r.error_text)
    finally:
        for fd in held + [base]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_handshake_that_takes_long_is_awaited_on_the_loop():
    """A server whose accept queue is full drops the SYN; the kernel resends it after ~1 s. The client
    waits for that on its event loop (past its 5 ms in-place wait) and then streams as usual."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    addr = lsock.getsockname()
    fillers = []
    for _ in range(3):  # fill the accept queue
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(addr)
        fillers.append(f)
    time.sleep(0.05)

    def serve():
        time.sleep(0.3)
        while True:
            conn, _ = lsock.accept()
            conn.settimeout(5)
            buf = conn.recv(65536)
            if not buf:          # a filler: never sends
                conn.close()
                continue
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            conn.sendall(SSE_HEADER + _chunk("a") + _chunk("b") + USAGE_DONE)
            conn.close()
            return

    for f in fillers:
        f.shutdown(socket.SHUT_WR)   # an accepted filler reads EOF at once
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = _one(f"http://127.0.0.1:{addr[1]}", timeout_s=10)
    t.join(5)
    for f in fillers:
        f.close()
    lsock.close()
    assert r.ok, (r.error_class, r.error_text)
    assert r.connect_us > 5_000, r.connect_us   # past the in-place wait: the loop path ran


def test_every_level_is_warmed_by_a_full_wave_before_it_is_timed(server):
    """An engine JIT-compiling kernels for a batch size it has not seen (vLLM's Triton fused MoE on the H200)
    must do it before the timed window: the warm-up fills every slot of the level at once."""
    assert warmup_count(2, 1) == 2 and warmup_count(2, 8) == 8 and warmup_count(0, 8) == 0
    # streams of 64 tokens (0.64 s): the six start well within one even when the client is held off its core
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[6], input_tokens=16,
                      output_tokens=64, requests_per_level=2, warmup_requests=1, timeout_s=10)
    prompts = run_async(build_prompts(cfg, 8))
    records, _ = run_async(run_level(cfg, 6, prompts))
    warm = [r for r in records if r.warmup]
    assert len(warm) == 6 and sum(not r.warmup for r in records) == 2
    # all six in flight together: the last one was sent before the first one ended
    assert all(r.ok for r in warm) and max(r.send_ns for r in warm) < min(r.end_ns for r in warm)


def test_a_level_whose_engine_stalled_says_so_in_its_row(server, tmp_path):
    """Every stream silent at once for 0.8 s inside the timed window (on the H200: a kernel compiled for a
    shape the warm-up had not run, 1.9 s at concurrency 64) is the engine's stall, not its decode speed: the
    level's row holds it (engine_stall_ms; the verdict names it where the model misses); a level that ran
    through holds its longest silence only."""
    server.app["behaviour"] = "stall_once"
    cfg = SweepConfig(base_url=server.url, model="m", endpoint="completions", levels=[4, 2], input_tokens=16,
                      output_tokens=TOKENS, requests_per_level=4, warmup_requests=0, timeout_s=10)
    _, levels = run_sweep(cfg, tmp_path, progress=False)
    stalled, clean = levels.set_index("level").loc[4], levels.set_index("level").loc[2]
    assert stalled["engine_stall_ms"] == pytest.approx(stalled["engine_silence_ms"])
    assert 0.9 * STALL_S * 1e3 <= stalled["engine_stall_ms"] < 3 * STALL_S * 1e3 and stalled["ok"] == 4
    assert pd.isna(clean["engine_stall_ms"]) and clean["engine_silence_ms"] < 0.5 * STALL_S * 1e3
    # the step the verdict reads: the stall out of the streams it held, each of which it lengthened by
    # STALL_S / (TOKENS - 1) a token; the level that ran through reads its TPOT as it was
    assert stalled["tpot_unstalled_p50_us"] < stalled["tpot_p50_us"] - 0.5 * STALL_S * 1e6 / (TOKENS - 1)
    assert clean["tpot_unstalled_p50_us"] == clean["tpot_p50_us"]


def test_engine_silence_counts_only_gaps_some_stream_spans():
    """Two requests one after the other (concurrency 1): the time between them is no stream's silence;
    a gap inside a stream is."""
    from decodescope.serving.metrics import engine_silence_ms, is_engine_stall

    ms = 1_000_000
    rows = [{"warmup": False, "ok": True, "first_chunk_ns": 0, "end_ns": 30 * ms, "chunk_ns": [0, 10 * ms, 30 * ms]},
            {"warmup": False, "ok": True, "first_chunk_ns": 900 * ms, "end_ns": 910 * ms,
             "chunk_ns": [900 * ms, 910 * ms]},
            {"warmup": True, "ok": True, "first_chunk_ns": 0, "end_ns": 2000 * ms, "chunk_ns": [0, 2000 * ms]}]
    assert engine_silence_ms(pd.DataFrame(rows)) == pytest.approx(20.0)
    assert is_engine_stall(600.0, 10_000.0) and not is_engine_stall(400.0, 1_000.0)
    assert not is_engine_stall(600.0, 20_000.0)  # 30 ITLs: a slow engine, not a stall


def test_the_h200_level_that_stalled_is_told_from_one_that_did_not():
    """Real vLLM GPU streams (Qwen3-MoE on one H200, concurrency 64, tests/fixtures/vllm_gpu_h200_stall/): in
    one run 50 streams stood still 1.9 s at once while 14 more were admitted (TPOT p50 20.9 ms); in the
    next the same level ran through (6.4 ms), its longest all-stream silence some tens of ms."""
    from decodescope.serving.metrics import engine_silence_ms, level_stall_ms

    here = Path(__file__).parent / "fixtures" / "vllm_gpu_h200_stall"
    stalled = pd.read_parquet(here / "level64_stalled_requests.parquet")
    clean = pd.read_parquet(here / "level64_requests.parquet")
    assert level_stall_ms(stalled) == pytest.approx(1895.1, abs=0.1)
    assert level_stall_ms(clean) is None and engine_silence_ms(clean) < 100.0


def test_a_stalled_gap_counts_as_one_median_gap_in_the_streams_that_held_it():
    """Worked by hand: stream b (chunks every 10 ms to 40 ms) ends, then the engine is silent from 40 to 530 ms.
    Stream a (chunks 0, 10, 20, 30, 530, 540 ms) held the silence in its gap of 500 ms, which counts as the
    level's median gap (10 ms): its TPOT is (540 - 500 + 10) / 5 = 10 ms, not 108 ms. b keeps its own."""
    from decodescope.serving.metrics import engine_silence, per_request, unstalled_tpot_us

    ms = 1_000_000
    a = [0, 10 * ms, 20 * ms, 30 * ms, 530 * ms, 540 * ms]
    b = [0, 10 * ms, 20 * ms, 30 * ms, 40 * ms]
    rows = [{"warmup": False, "ok": True, "send_ns": 0, "first_chunk_ns": c[0], "end_ns": c[-1], "chunk_ns": c,
             "n_out_usage": len(c), "n_out_chunks": len(c)} for c in (a, b)]
    req = per_request(pd.DataFrame(rows))
    silence = engine_silence(req)
    assert silence == (pytest.approx(490.0), 40 * ms, 530 * ms)
    assert list(req["tpot_us"]) == pytest.approx([108_000.0, 10_000.0])
    assert list(unstalled_tpot_us(req, silence)) == pytest.approx([10_000.0, 10_000.0])


def test_the_h200_level_that_stalled_reads_the_next_runs_step_once_the_stall_is_out():
    """The H200 level of 64 that stood still 1.9 s (tests/fixtures/vllm_gpu_h200_stall/) read TPOT p50 20.9 ms;
    with the stall counted as one median gap in the 50 streams it held it reads 6.0 ms, within 10% of the
    next run's same level, which ran through (6.39 ms) and which this figure never read."""
    from decodescope.serving.metrics import engine_silence, per_request, unstalled_tpot_us

    here = Path(__file__).parent / "fixtures" / "vllm_gpu_h200_stall"
    stalled = pd.read_parquet(here / "level64_stalled_requests.parquet")
    clean = per_request(pd.read_parquet(here / "level64_requests.parquet"))
    ok = per_request(stalled)
    ok = ok[(~ok["warmup"]) & ok["ok"]]
    unstalled = unstalled_tpot_us(ok, engine_silence(stalled))
    next_run_us = float(clean.loc[(~clean["warmup"]) & clean["ok"], "tpot_us"].median())
    assert ok["tpot_us"].median() > 3 * next_run_us
    assert abs(unstalled.median() / next_run_us - 1) <= 0.10
    assert int((unstalled < ok["tpot_us"]).sum()) == 50


def test_a_level_with_one_stalled_repeat_reads_the_median_of_all_its_repeats_with_the_stall_out():
    """Three repeats of a level, the second stalled: the merged row's TPOT as the verdict reads it is the median
    over all three, the stalled one counted with its stall out (2,100 us), not the stalled repeat's alone."""
    from types import SimpleNamespace

    from decodescope.serving.sweep import merge_repeats
    from decodescope.verdict.fixes import level_tpot

    rows = pd.DataFrame({"level": [4, 4, 4], "repeat": [1, 2, 3], "tpot_p50_us": [2_000.0, 9_000.0, 2_200.0],
                         "engine_stall_ms": [float("nan"), 800.0, float("nan")],
                         "tpot_unstalled_p50_us": [2_000.0, 2_100.0, 2_200.0], "itl_coalesced_frac": [0.0] * 3})
    merged = merge_repeats(rows).iloc[0]
    assert merged["tpot_unstalled_p50_us"] == 2_100.0 and merged["engine_stall_ms"] == 800.0
    tpot, why = level_tpot(SimpleNamespace(**merged.to_dict()))
    assert tpot == 2_100.0 and "0.80 s stall taken out" in why
