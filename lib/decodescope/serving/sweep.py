"""The concurrency sweep: per level, warm-up requests then N measured ones at fixed concurrency.

Each level is written when it finishes (data/serving/level_<c>.parquet, atomically), and the combined
serving_requests.parquet / serving_levels.parquet are rewritten after every level, so a crash keeps the
finished levels and a rerun skips them.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import aiohttp
import pandas as pd

from decodescope.core.io import write_json_atomic, write_parquet_atomic
from decodescope.show.display import show_note
from decodescope.core.rundir import level_file
from decodescope.serving.client import (InFlight, LoopHealth, RequestRecord, RequestSpec, check_completions_prompt,
                                        make_prompts, run_async)
from decodescope.serving.rawclient import send_streaming_raw
from decodescope.serving.metrics import engine_silence_ms, level_stall_ms, level_summary, per_request
from decodescope.serving.telemetry import NoTelemetry, Telemetry
from decodescope.serving.telemetry_read import level_telemetry
from decodescope.core.stats import band
from decodescope.schema.rundata import SERVING_LEVELS, SERVING_REQUESTS

log = logging.getLogger(__name__)

REQUEST_COLUMNS = ["level", "index", "warmup", "ok", "error_class", "error_text", "send_ns", "first_chunk_ns",
                   "end_ns", "chunk_ns", "n_out_usage", "n_out_chunks", "n_in_usage", "n_in_sent", "connect_us"]


@dataclass(frozen=True)
class SweepConfig:
    base_url: str
    model: str
    endpoint: str
    levels: list[int]
    input_tokens: int
    output_tokens: int
    requests_per_level: int
    warmup_requests: int
    timeout_s: float
    seed: int = 0
    api_key: Optional[str] = None
    slo: Optional[dict] = None
    request_rate: Optional[float] = None
    burstiness: float = 1.0
    telemetry_interval_s: float = 1.0     # 0: no server/GPU telemetry (serving.telemetry)
    telemetry_gpu: bool = True            # NVML on this host too (when the server is on it)
    repeats: int = 1                      # each level measured this many times (the sweep, again and again)
    completions_prompt: str = "token_ids"  # or "text" (serving.client.RequestSpec)
    temperature: Optional[float] = None   # None: the server's default sampling

    def __post_init__(self):
        check_completions_prompt(self.completions_prompt)

    @classmethod
    def from_params(cls, params, base_url: str, model: Optional[str] = None) -> "SweepConfig":
        w = params.workload
        return cls(base_url=base_url, model=model or params.model.name, endpoint=w.endpoint,
                   levels=list(w.concurrency), input_tokens=w.input_tokens, output_tokens=w.output_tokens,
                   requests_per_level=w.requests_per_level, warmup_requests=w.warmup_requests,
                   timeout_s=w.request_timeout_s, seed=w.seed, api_key=params.server.api_key,
                   slo=w.slo.model_dump(), request_rate=w.request_rate, burstiness=w.burstiness,
                   telemetry_interval_s=w.telemetry_interval_s, telemetry_gpu=_server_on_this_host(params),
                   repeats=w.repeats, temperature=w.temperature)


def _server_on_this_host(params) -> bool:
    """Whether the server's GPUs are this host's (NVML is sampled here only then)."""
    host = getattr(params, "host", "local")
    return getattr(host, "url", host) == "local"


def warmup_count(warmup_requests: int, level: int) -> int:
    """Warm-up requests before a level is timed: at least one per slot of the level, so that every batch
    size the level reaches has run once. An engine that compiles kernels for a batch size it has not seen
    (vLLM's Triton fused MoE picks a config per size and JIT-compiles it) would otherwise do it inside the
    timed window: on the H200 a level of 64 so read TPOT 23.4 ms against an ITL p50 of 5.8 ms. 0 keeps none."""
    return max(warmup_requests, level) if warmup_requests > 0 else 0


async def run_level(cfg: SweepConfig, level: int, prompts: list[tuple[list[int], str]],
                    n_requests: Optional[int] = None, warmup: Optional[int] = None,
                    on_measured_start: Optional[Callable[[], None]] = None) -> tuple[list[RequestRecord], dict]:
    """Warm-up then measured requests, at most `level` in flight. Returns records and client health.
    `on_measured_start` runs (blocking, with nothing in flight) between the two: telemetry's mark."""
    n_requests = cfg.requests_per_level if n_requests is None else n_requests
    warmup = warmup_count(cfg.warmup_requests if warmup is None else warmup, level)
    records: list[RequestRecord] = []
    prompt_cycle = itertools.cycle(prompts)

    async def one(i: int, is_warmup: bool) -> RequestRecord:
        ids, text = next(prompt_cycle)
        spec = RequestSpec(cfg.endpoint, cfg.model, ids, text, cfg.output_tokens, cfg.timeout_s,
                           cfg.completions_prompt, cfg.temperature)
        rec = RequestRecord(level=level, index=i, warmup=is_warmup, send_ns=0)
        return await send_streaming_raw(cfg.base_url, spec, rec, cfg.api_key)

    if warmup:
        sem = asyncio.Semaphore(level)

        async def gated_warm(i):
            async with sem:
                return await one(i, True)
        records += await asyncio.gather(*(gated_warm(i) for i in range(warmup)))
    if on_measured_start is not None:
        on_measured_start()

    inflight = InFlight()
    sem = asyncio.Semaphore(level)
    arrivals = arrival_offsets_s(n_requests, cfg.request_rate, cfg.burstiness, cfg.seed + level)
    t_start = asyncio.get_running_loop().time()

    async def gated(i):
        if arrivals is not None:  # open loop: wait for this request's arrival time
            await asyncio.sleep(max(0.0, t_start + arrivals[i] - asyncio.get_running_loop().time()))
        async with sem:
            inflight.add(1)
            rec: Optional[RequestRecord] = None
            try:
                rec = await one(i, False)
                return rec
            finally:
                # Out of flight at its end (end_ns, where W ends), not when this task next runs.
                # On 2 busy cores the client stalled 138 ms between one request's end and the next one's
                # start at concurrency 2. That stall counted in L and in no request's W.
                # L read 2.00 against lambda x W 1.91 (1.64 in one CI run).
                # A stall is the client's, reported as its loop lag.
                inflight.add(-1, at_s=rec.end_ns / 1e9 if rec is not None and rec.end_ns else None)
    with LoopHealth(inflight=inflight) as health:
        records += await asyncio.gather(*(gated(i) for i in range(n_requests)))
    return records, health.summary()


def arrival_offsets_s(n: int, rate: Optional[float], burstiness: float, seed: int) -> Optional[list[float]]:
    """Open-loop arrival times: gamma inter-arrivals with mean 1/rate and shape `burstiness`
    (1 = Poisson, as `vllm bench serve --burstiness`); None in closed-loop mode."""
    if rate is None:
        return None
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def records_frame(records: list[RequestRecord]) -> pd.DataFrame:
    return pd.DataFrame([r.to_row() for r in records], columns=REQUEST_COLUMNS)


def level_path(data_dir: Path, level: int, repeat: int = 1) -> Path:
    """data/serving/level_<c>.parquet; a repeat after the first: level_<c>_r<n>.parquet."""
    return Path(data_dir) / "serving" / level_file(level, repeat)


# Failures that say the server (not the request) was at fault: a level that has them is measured again
# on resume, since its numbers describe a dying server.
SERVER_FAILURE_CLASSES = ("server_down", "connection_reset")


def load_finished_levels(data_dir: Path) -> dict[tuple[int, int], pd.DataFrame]:
    """(level, repeat) -> its requests, each frame with a `repeat` column (1 for the first)."""
    out = {}
    for p in sorted((data_dir / "serving").glob("level_*.parquet")):
        parts = p.stem.split("_")
        key = (int(parts[1]), int(parts[2][1:]) if len(parts) > 2 else 1)
        out[key] = pd.read_parquet(p).assign(repeat=key[1])
    return out


def failed_for_server_reasons(level_df: pd.DataFrame) -> bool:
    return bool(level_df["error_class"].isin(SERVER_FAILURE_CLASSES).any())


def levels_to_measure(levels: list[int], data_dir: Path, repeats: int = 1) -> list[tuple[int, int]]:
    """(level, repeat) not on disk, or on disk with requests the server failed; repeat by repeat (the
    whole sweep, then again), so slow drift spreads over every level instead of biasing one."""
    finished = load_finished_levels(data_dir)
    return [(lvl, r) for r in range(1, repeats + 1) for lvl in levels
            if (lvl, r) not in finished or failed_for_server_reasons(finished[(lvl, r)])]


# level columns whose spread across repeats is worth a band (decodescope.core.stats)
BAND_COLUMNS = ("tpot_p50_us", "ttft_p50_us", "itl_p50_us", "e2e_p50_us", "output_throughput_tok_s")


def merge_repeats(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per level from its repeats: the median of every number, the first of anything else,
    `repeats`, and a 95% band (bootstrap of the median, decodescope.core.stats) for BAND_COLUMNS."""
    out = []
    for level, g in rows.groupby("level", sort=True):
        row = {}
        for col in g.columns:
            if col in ("level", "repeat"):
                continue
            vals = g[col]
            row[col] = (float(vals.median()) if pd.api.types.is_numeric_dtype(vals) and not pd.api.types.is_bool_dtype(vals)
                        else (bool(vals.any()) if pd.api.types.is_bool_dtype(vals) else vals.iloc[0]))
        for col in BAND_COLUMNS:
            if col in g:
                b = band(g[col])
                row[f"{col}_low"], row[f"{col}_high"] = b.low, b.high
        for col in ("requests", "ok", "failed"):
            if col in g:
                row[col] = int(g[col].sum())  # every request measured at this level, all repeats
        out.append({"level": int(level), "repeats": int(g["repeat"].nunique()), **row})
    return pd.DataFrame(out)


def combine(data_dir: Path, slo: Optional[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rebuild serving_requests.parquet and serving_levels.parquet from the finished levels. With
    repeats, serving_levels_repeats.parquet holds one row per (level, repeat) and serving_levels one
    per level (merge_repeats)."""
    finished = load_finished_levels(data_dir)
    if not finished:
        return pd.DataFrame(columns=REQUEST_COLUMNS), pd.DataFrame()
    repeated = any(r > 1 for _, r in finished)
    raw = pd.concat([df for df in finished.values()], ignore_index=True)
    if not repeated:
        raw = raw.drop(columns=["repeat"])
    req = per_request(raw.drop(columns=[c for c in raw.columns if c.startswith("health_")]))
    rows = []
    for (level, rep), df in sorted(finished.items()):
        health = {c.removeprefix("health_"): df[c].iloc[0] for c in df.columns if c.startswith("health_")}
        rows.append(level_summary(req, level, slo, health, repeat=rep if repeated else None,
                                  telemetry=level_telemetry(data_dir, level, rep)))
    levels = pd.DataFrame(rows)
    write_parquet_atomic(data_dir / SERVING_REQUESTS, req)
    if repeated:
        write_parquet_atomic(data_dir / "serving_levels_repeats.parquet", levels)
        levels = merge_repeats(levels)
    write_parquet_atomic(data_dir / SERVING_LEVELS, levels)
    return req, levels


_CONSOLE: Optional[TextIO] = None


def console() -> TextIO:
    """Where a child process's stderr goes (the telemetry sampler's): the process's real stderr.

    In a notebook kernel that is the kernel's log (logs/kernel_<phase>.log, where the runner sends it).
    It is not a cell's output, so it stays out of the notebook and the report.
    ipykernel points file descriptor 2 (sys.__stderr__) at a pipe.
    It copies that pipe's text into the cell's output as well as to the real stderr.
    So inside a kernel this returns the kernel's copy of the real stderr descriptor."""
    global _CONSOLE
    fd = getattr(sys.stderr, "_original_stdstream_copy", None)
    if not isinstance(fd, int):
        return sys.__stderr__ or sys.stderr
    if _CONSOLE is None:
        try:
            _CONSOLE = os.fdopen(os.dup(fd), "w", buffering=1, errors="replace")
        except OSError:
            return sys.__stderr__ or sys.stderr
    return _CONSOLE


class SweepProgress:
    """One plain log line per finished level with its time, the time so far and an estimate of what is left
    (the mean time of a finished level times the levels to go)."""

    def __init__(self, levels: list, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 repeats: int = 1):
        # levels: concurrency levels, or (level, repeat) pairs when each level is repeated
        self.levels, self.enabled, self.clock = levels, enabled, clock
        self.repeats = repeats
        self.t0 = self.t_level = clock()
        self.done = 0

    def _print(self, line: str) -> None:
        if self.enabled:
            log.info(line)

    def start(self, level: int) -> None:
        self.t_level = self.clock()
        if self.done == 0:
            shown = sorted({x[0] if isinstance(x, tuple) else x for x in self.levels})
            self._print(f"serving sweep: {len(self.levels)} level(s) to measure: concurrency "
                        f"{', '.join(map(str, shown))}" + (f", {self.repeats} repeats each" if self.repeats > 1 else ""))

    def end(self, level) -> str:
        level, rep = level if isinstance(level, tuple) else (level, 1)
        now = self.clock()
        self.done += 1
        elapsed = now - self.t0
        left = len(self.levels) - self.done
        eta = f"about {elapsed / self.done * left:.0f} s left" if left else "done"
        which = f"concurrency {level}" + (f", repeat {rep} of {self.repeats}" if self.repeats > 1 else "")
        line = (f"serving sweep: level {self.done}/{len(self.levels)} ({which}) done in "
                f"{now - self.t_level:.1f} s, elapsed {elapsed:.1f} s, {eta}")
        self._print(line)
        return line


def sweep_prompts(cfg: SweepConfig) -> list[tuple[list[int], str]]:
    """The prompts a sweep of cfg sends (build_prompts: two calls to the server's tokenizer each)."""
    return run_async(build_prompts(cfg, max(cfg.requests_per_level + cfg.warmup_requests, 1)))


def run_sweep(cfg: SweepConfig, data_dir: Path, progress=True,
              check_server: Optional[Callable[[str], None]] = None,
              prompts: Optional[list[tuple[list[int], str]]] = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every level not already on disk (or on disk but failed because the server did). Each level is
    written as it finishes; then `check_server(during)` raises if the server died, so a sweep never
    goes on measuring a dead server. Progress lines are log records (decodescope.core.logsetup), never cell output.
    prompts: sweep_prompts(cfg) made beforehand, for a caller whose first request must follow a signal at once
    (its /tokenize calls wait behind whatever the server is serving); made here when None."""
    data_dir = Path(data_dir)
    todo = levels_to_measure(cfg.levels, data_dir, cfg.repeats)
    prompts = sweep_prompts(cfg) if prompts is None else prompts
    bar = SweepProgress(todo, enabled=bool(progress), repeats=cfg.repeats)
    with telemetry_for(cfg, data_dir) as tel:
        for level, rep in todo:
            bar.start(level)
            df = _measure_level(cfg, level, rep, prompts, tel)
            silence_ms = engine_silence_ms(df)
            df["health_engine_silence_ms"] = silence_ms
            stall_ms = level_stall_ms(df, silence_ms)
            # a column in every run (NaN without a stall): runs compare column for column
            df["health_engine_stall_ms"] = float("nan") if stall_ms is None else stall_ms
            if stall_ms is not None:
                _reader_note(f"concurrency {level}: every stream stood still at once for {stall_ms / 1e3:.1f} s "
                             "inside the timed window: an engine stall (a kernel compiled for a shape the warm-up "
                             "had not run, or a pause of the host), not its decode speed; the verdict sets the "
                             "level's TPOT with the stall taken out against the step (tpot_unstalled_p50_us)")
            write_parquet_atomic(level_path(data_dir, level, rep), df)
            combine(data_dir, cfg.slo)
            bar.end((level, rep))
            if check_server is not None:
                check_server(f"the serving sweep (concurrency {level})")
    write_json_atomic(data_dir / "serving_config.json", {**cfg.__dict__, "api_key": None})
    return combine(data_dir, cfg.slo)


def _measure_level(cfg: SweepConfig, level: int, rep: int, prompts, tel) -> pd.DataFrame:
    """One measurement of a level (warm-up, then the timed requests), its client health as columns."""
    with tel.level(level, rep):    # sampled from here to the last request (also on failure or Ctrl-C)
        records, health = run_async(run_level(cfg, level, prompts, on_measured_start=tel.mark))
    df = records_frame(records)
    for k, v in health.items():
        df[f"health_{k}"] = v
    return df


def telemetry_for(cfg: SweepConfig, data_dir: Path):
    """The sweep's telemetry sampler (serving.telemetry), or the stand-in that samples nothing when
    `telemetry_interval_s` is 0. Its problems are logged as warnings; the sweep never stops for them."""
    if not cfg.telemetry_interval_s:
        return NoTelemetry(data_dir)
    return Telemetry(cfg.base_url, data_dir, interval_s=cfg.telemetry_interval_s, api_key=cfg.api_key,
                     gpu=cfg.telemetry_gpu, log=log.warning, stderr=console())


def _reader_note(text: str) -> None:
    """A warning the report's reader needs: a note in the notebook when running in a kernel, and a
    logged warning either way."""
    log.warning(text)
    try:
        # IPython: a note for a notebook's reader, only where IPython runs
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        show_note(f"**Note:** {text}")


async def build_prompts(cfg: SweepConfig, n: int) -> list[tuple[list[int], str]]:
    """Prompts from the server's tokenizer; if the server cannot tokenize (down, or not vLLM), random
    ids from a small range are sent and the records' usage shows the real input length."""
    try:
        return await make_prompts(cfg.base_url, cfg.model, n, cfg.input_tokens, cfg.seed, cfg.api_key)
    except (aiohttp.ClientError, OSError, KeyError) as e:
        _reader_note(f"the prompts could not be built with the server's tokenizer (`{cfg.base_url}/tokenize`: "
                     f"`{type(e).__name__}: {str(e).replace('`', chr(39))}`), so random token ids were sent; the input lengths in "
                     "the tables are the server's own counts (its usage records), not the configured "
                     f"{cfg.input_tokens} tokens.")
        rng = random.Random(cfg.seed)
        return [([rng.randrange(100, 900) for _ in range(cfg.input_tokens)], "hello " * cfg.input_tokens)
                for _ in range(n)]
