"""Streaming requests against an OpenAI-compatible server, one record per request.

Times are CLOCK_MONOTONIC nanoseconds (`time.monotonic_ns`), comparable across processes on one host.
A request's record keeps every content chunk's arrival so TTFT, TPOT and ITL can be recomputed.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional, cast

import aiohttp
import numpy as np

WORDS = ("time decode step kernel reduce expert token cache batch layer memory bandwidth server stream "
         "latency graph launch sample logits prefill route shard rank link bridge switch").split()


@dataclass
class RequestRecord:
    level: int
    index: int
    warmup: bool
    send_ns: int
    first_chunk_ns: Optional[int] = None
    end_ns: Optional[int] = None
    chunk_ns: list[int] = field(default_factory=list)
    n_out_usage: Optional[int] = None
    n_out_chunks: int = 0
    n_in_usage: Optional[int] = None
    n_in_sent: Optional[int] = None
    error_class: Optional[str] = None
    error_text: Optional[str] = None
    connect_us: Optional[float] = None   # from starting the request to the connection being ready
    # The raw client only (serving.rawclient), not in the request parquet: content chunks whose time is the
    # kernel's receive stamp (the rest: the read time), and chunks that shared one read with a later chunk
    # of the same request (coalesced: they carry that later chunk's arrival)
    n_chunks_kernel_ts: int = 0
    n_chunks_coalesced: int = 0

    @property
    def ok(self) -> bool:
        return self.error_class is None

    def to_row(self) -> dict:
        row = asdict(self)
        row["ok"] = self.ok
        return row


@dataclass(frozen=True)
class RequestSpec:
    endpoint: str                 # "completions" | "chat"
    model: str
    prompt_token_ids: list[int]
    prompt_text: str
    max_tokens: int
    timeout_s: float
    # Completions send the prompt's token ids (exact length, no tokenizing in the server) unless "text":
    # the form `vllm bench serve` sends, whose tokenizing in the API server is part of the TTFT it reads
    completions_prompt: str = "token_ids"
    temperature: Optional[float] = None   # None: the server's default sampling

    def __post_init__(self):
        check_completions_prompt(self.completions_prompt)


COMPLETIONS_PROMPTS = ("token_ids", "text")


def check_completions_prompt(value: str) -> None:
    """A completions prompt's form, checked where a spec or a sweep is made, before any request goes."""
    if value not in COMPLETIONS_PROMPTS:
        raise ValueError(f"completions_prompt {value!r}: 'token_ids' or 'text'")


def auth_headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def tokenize(session: aiohttp.ClientSession, base_url: str, model: str, text: str,
                   headers: dict) -> list[int]:
    async with session.post(f"{base_url}/tokenize", json={"model": model, "prompt": text,
                                                          "add_special_tokens": False}, headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["tokens"]


async def detokenize(session, base_url, model, tokens, headers) -> str:
    async with session.post(f"{base_url}/detokenize", json={"model": model, "tokens": tokens},
                            headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["prompt"]


async def make_prompts(base_url: str, model: str, n: int, input_tokens: int, seed: int,
                       api_key: Optional[str] = None) -> list[tuple[list[int], str]]:
    """n prompts of exactly input_tokens tokens under the server's own tokenizer (its /tokenize),
    random but seeded. Completions send the token ids, so the length is exact by construction; the
    text (for chat) is their detokenization."""
    rng = random.Random(seed)
    headers = auth_headers(api_key)
    prompts = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            ids: list[int] = []
            while len(ids) < input_tokens:
                text = " ".join(rng.choice(WORDS) for _ in range(max(8, input_tokens)))
                ids += await tokenize(session, base_url, model, f"{i} {text}", headers)
            ids = ids[:input_tokens]
            prompts.append((ids, await detokenize(session, base_url, model, ids, headers)))
    return prompts


def request_body(spec: RequestSpec) -> tuple[str, dict]:
    # No temperature unless workload.temperature asks: the server's default sampling, as `vllm bench serve`
    # sends. Greedy decoding of random (dummy) weights can repeat one special token whose text is empty, and
    # the server then sends nothing until the end; a speculative variant sets it to steer acceptance.
    common = {"model": spec.model, "max_tokens": spec.max_tokens, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True}
    if spec.temperature is not None:
        common["temperature"] = spec.temperature
    if spec.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": spec.prompt_text}]}
    if spec.completions_prompt == "text":
        return "/v1/completions", {**common, "prompt": spec.prompt_text}
    return "/v1/completions", {**common, "prompt": spec.prompt_token_ids}


class InFlight:
    """The in-flight request count and its integral over time (request-seconds), advanced at every change.

    It gives the mean count L for the Little's-law check, exact whatever the event loop's stalls.
    A sampler reads the count only when the loop lets it run.
    On 2 cores the vLLM workers starve this process for up to a second.
    The read that ends a stall then stands for all of it, whatever the count was.
    At concurrency 1 that read often lands between one request's end and the next one's start.
    It then reads 0 for a stall spent with 1 in flight.
    In one CI run a sampler read L 0.76 against lambda x W 1.00."""

    def __init__(self, clock=time.monotonic):
        self.n = 0
        self.area_s = 0.0
        self._clock = clock
        self._since: Optional[float] = None
        self._start: Optional[float] = None
        self._first_in: Optional[float] = None  # the window's first request in
        self._last_out: Optional[float] = None  # and its last one out (as of its end)

    def _advance(self) -> None:
        now = self._clock()
        if self._since is not None:
            self.area_s += self.n * (now - self._since)
        self._since = now

    def start(self) -> None:
        """Begin the window the mean is taken over (the area before it is dropped)."""
        self._advance()
        self.area_s, self._start = 0.0, self._since
        self._first_in = self._last_out = None

    def add(self, k: int, at_s: Optional[float] = None) -> None:
        """Change the count by k now, or as of `at_s`, an earlier reading of the clock (a request that
        ended then, seen to have ended only now): the count's integral since then is corrected."""
        self._advance()
        self.n += k
        since = cast(float, self._since)  # _advance() has just set it to the clock's reading
        if k > 0 and self._first_in is None:
            self._first_in = since
        if k < 0:
            out = since if at_s is None else min(at_s, since)
            self._last_out = out if self._last_out is None else max(self._last_out, out)
        if at_s is not None:
            start = self._start if self._start is not None else at_s
            self.area_s += k * max(since - max(at_s, start), 0.0)

    def mean(self) -> float:
        """Mean count over the window: from the first request in to the last one out where every request has
        ended (lambda x W's own span: first start to last end), else since start() up to now. A stall of the
        loop before the window is read (after the last end, or before the first request got in) counts 0 in
        flight and no request's W: taken in, it read L 0.77 against lambda x W 1.00 at concurrency 1."""
        self._advance()
        since = cast(float, self._since)  # _advance() has just set it to the clock's reading
        if self.n == 0 and self._first_in is not None and self._last_out is not None:
            span_s = self._last_out - max(self._first_in, self._start if self._start is not None else self._first_in)
        else:
            span_s = since - self._start if self._start is not None else 0.0
        return self.area_s / span_s if span_s > 0 else float("nan")


class LoopHealth:
    """Event-loop lag (how late a 10 ms sleep wakes) and this process's CPU share during a level: a
    client that is itself saturated inflates TTFT and ITL. With `inflight`, the mean in-flight count
    over the same window (InFlight)."""

    def __init__(self, interval_s: float = 0.01, inflight: Optional[InFlight] = None):
        self.interval_s = interval_s
        self.lags_ms: list[float] = []
        self.inflight = inflight
        self._task: Optional[asyncio.Task] = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_ms.append((time.perf_counter() - t0 - self.interval_s) * 1e3)

    def __enter__(self):
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        if self.inflight is not None:
            self.inflight.start()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc):
        if self._task:
            self._task.cancel()
        self.wall_s = time.perf_counter() - self._wall0
        self.cpu_s = time.process_time() - self._cpu0
        self._inflight_mean = self.inflight.mean() if self.inflight is not None else float("nan")

    def summary(self) -> dict:
        lags = np.array(self.lags_ms) if self.lags_ms else np.array([0.0])
        # the column keeps its name (run directories written before hold it); it is now the exact mean
        return {"loop_lag_p50_ms": float(np.percentile(lags, 50)), "loop_lag_p99_ms": float(np.percentile(lags, 99)),
                "loop_lag_max_ms": float(lags.max()), "client_cpu_pct": 100.0 * self.cpu_s / max(self.wall_s, 1e-9),
                "inflight_sampled_mean": self._inflight_mean}


def _run(coro):
    """On uvloop when installed (a faster event loop: the client's own latency is what it measures),
    with the cyclic garbage collector paused so its pauses do not land in the measured latencies."""
    try:
        # uvloop: optional, a faster event loop where it is installed
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with runner:
            return runner.run(coro)
    finally:
        if was_enabled:
            gc.enable()


def run_async(coro):
    """Run a coroutine to completion, also from inside a running loop (a Jupyter kernel): then on a
    thread of its own, cancelled when the waiting thread is interrupted. Ctrl-C (and the runner's SIGTERM,
    sent on to the kernel as one) lands in the kernel's main thread, which waits here; left alone, the
    thread ran its level to the end and wrote it (2.3 s after a SIGTERM in one run), a level measured
    while the run was being stopped."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coro)

    held: dict = {}

    async def cancellable():
        held["loop"], held["task"] = asyncio.get_running_loop(), asyncio.current_task()
        if held.get("stop"):
            coro.close()
            raise asyncio.CancelledError
        return await coro

    with ThreadPoolExecutor(max_workers=1) as pool:
        done = pool.submit(_run, cancellable())
        try:
            return done.result()
        except KeyboardInterrupt:
            held["stop"] = True
            if "task" in held:
                # the coroutine may have ended and its loop closed as the interrupt came: the interrupt stands
                with contextlib.suppress(RuntimeError):
                    held["loop"].call_soon_threadsafe(held["task"].cancel)
            raise   # leaving the pool waits for the cancelled coroutine to unwind (its finally blocks)
