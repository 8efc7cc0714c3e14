"""Capture a torch.profiler trace of real decode steps through vLLM's profiler endpoints.

The server must have been started with a profiler directory: `--profiler-config`, or
VLLM_TORCH_PROFILER_DIR on older vLLM. The runner does this for launched servers. After warm-up come
/start_profile, a controlled decode workload and /stop_profile. Then we wait until every rank's file is
complete: its size stable and, for .gz, a gzip stream that decompresses to the end.

The same workload runs twice just before /start_profile, unprofiled. The engine's inter-token latency over
each run (from /metrics) is the step as the server ran it there and then. The verdict sets the step model
against it, beside 01's TPOT. The two unprofiled runs differ by the host's noise. The profiled run exceeds
them by the profiler's own cost per step. That cost is far more than the cost per recorded op, since the
trace writers and the profiled front end share the cores with the workers. The cost per op is measured too,
as profiler_event_cost_us: the fallback where /metrics has no inter-token latency.

A profile also leaves something behind. On the H200, after 04's first /stop_profile the Kimi-shaped engine
ran unprofiled 36% slower at concurrency 4 and 62% at 16 than 01 had measured it. Its engine core's CPU per
step grew alike, while 04's first level, measured before any profile, agreed with 01. So before the phase's
first /start_profile, every later level's workload runs once unprofiled too. That is the level's step as a
server never profiled runs it. The profiler's cost is taken against it, and what an earlier profile left
behind is kept as profiler_residue_us.

The window itself (start, stop, the wait for the traces) is profiling.window; what the profiler cost,
from these runs, is trace.profilercost; which levels a phase profiles is profiling.capturephase.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from decodescope.serving.client import run_async
from decodescope.serving.promtext import ENGINE_STEPS, HISTOGRAM_MEANS, Scraper, counter_delta, histogram_mean_between
from decodescope.serving.telemetry import SETTLE_S
from decodescope.serving.sweep import SweepConfig, build_prompts, run_level, warmup_count
from decodescope.exec.procs import cpu_per_step, cpu_schedstat
from decodescope.schema.records import ProfileCapture
from decodescope.schema.rundata import level_dir_name
from decodescope.trace.profilercost import (engine_itl_unprofiled_us, itl_window_noise, profiler_event_cost_us,
                                            profiler_residue_us, profiler_step_cost_us)
from decodescope.profiling.window import CaptureError, profiled_window


@dataclass
class CaptureResult:
    trace_dir: Path
    rank_files: list[Path]
    frontend_files: list[Path]
    tables: list[Path]
    requests_ok: int
    requests_failed: int
    start_profile_s: float
    workload_s: float
    stop_profile_s: float
    flush_wait_s: float
    expected_ranks: int = 0
    problems: list[str] = field(default_factory=list)
    concurrency: int = 0
    # the engine's mean time between a request's tokens (vLLM's inter-token latency histogram, stamped in
    # the engine core), over the same workload run twice without the profiler, then under it: the step
    # as the server ran it where and when 04 measured
    engine_itl_unprofiled_runs_us: list = field(default_factory=list)
    engine_itl_profiled_us: Optional[float] = None
    profiler_event_cost_us: Optional[float] = None
    # the same workload unprofiled before the phase's first /start_profile (levels after the first; the
    # first level's own unprofiled runs come before every profile)
    engine_itl_before_profiles_us: Optional[float] = None
    # the last unprofiled run: role -> CPU time and run-queue wait per step (procs.cpu_per_step); empty
    # when the server's processes are not on this machine. A worker's wait is the time the host's other
    # processes held its core mid-step.
    host_cpu_per_step: dict = field(default_factory=dict)

    @property
    def engine_itl_unprofiled_us(self) -> Optional[float]:
        return engine_itl_unprofiled_us(self.engine_itl_unprofiled_runs_us, self.engine_itl_before_profiles_us)

    def to_record(self) -> ProfileCapture:
        d = dict(self.__dict__)
        d["trace_dir"] = str(self.trace_dir)
        for k in ("rank_files", "frontend_files", "tables"):
            d[k] = [str(p) for p in d[k]]
        d["engine_itl_unprofiled_us"] = self.engine_itl_unprofiled_us
        d["window_noise"] = itl_window_noise(self.engine_itl_unprofiled_runs_us, self.engine_itl_profiled_us)
        d["profiler_step_cost_us"] = profiler_step_cost_us(self.engine_itl_unprofiled_us, self.engine_itl_profiled_us)
        d["profiler_residue_us"] = profiler_residue_us(self.engine_itl_unprofiled_runs_us,
                                                       self.engine_itl_before_profiles_us)
        return ProfileCapture.model_validate(d)

    def raise_if_incomplete(self) -> None:
        """After the traces that arrived were analysed: a capture that lost ranks fails the phase."""
        if self.problems:
            raise CaptureError("; ".join(self.problems))


@dataclass
class LevelWorkload:
    """04's decode workload at one concurrency: its config, prompts and request count."""

    cfg: SweepConfig
    prompts: list
    n_requests: int
    concurrency: int

    def warm_up(self, warmup_requests: int) -> None:
        """At least one full batch: a batch size's first step is not a decode step's cost."""
        if warmup_requests:
            run_async(run_level(self.cfg, self.concurrency, self.prompts,
                                n_requests=warmup_count(warmup_requests, self.concurrency), warmup=0))

    def run(self):
        return run_async(run_level(self.cfg, self.concurrency, self.prompts, n_requests=self.n_requests, warmup=0))


def level_workload(server, params, concurrency: int) -> LevelWorkload:
    prof = params.profile
    n_requests = max(prof.requests, concurrency)  # a level gets at least one full batch
    cfg = SweepConfig(base_url=server.base_url, model=params.model.name, endpoint="completions",
                      levels=[concurrency], input_tokens=prof.input_tokens, output_tokens=prof.output_tokens,
                      requests_per_level=n_requests, warmup_requests=prof.warmup_requests,
                      timeout_s=params.workload.request_timeout_s, seed=params.workload.seed + 1,
                      api_key=params.server.api_key)
    return LevelWorkload(cfg, run_async(build_prompts(cfg, n_requests + prof.warmup_requests)), n_requests,
                         concurrency)


def itl_before_profiles(server, params, levels: list[int]) -> dict[int, Optional[float]]:
    """Every level after the first, its workload run once unprofiled (after its warm-up) before the phase's
    first /start_profile: the engine's inter-token latency there, None where /metrics had none."""
    scraper = Scraper(server.base_url, params.server.api_key)
    out: dict[int, Optional[float]] = {}
    for c in levels[1:]:
        work = level_workload(server, params, c)
        work.warm_up(params.profile.warmup_requests)
        out[c] = _engine_window(scraper, work.run)[1].itl_us
    return out


def capture_profile(server, params, trace_dir: Path, expected_ranks: Optional[int] = None,
                    records_path: Optional[Path] = None, concurrency: Optional[int] = None,
                    itl_before_profiles_us: Optional[float] = None, guard=None) -> CaptureResult:
    """Warm up, profile a decode workload at one concurrency, stop, and wait for the traces.

    itl_before_profiles_us: this level's inter-token latency before the phase's first profile
    (itl_before_profiles). It is the unprofiled step the profiler's cost is taken against.
    guard: an attached server's profiling.attach.AttachedProfiler. It plans the window from a profiled
    slice of the same workload: all of it, fewer requests, or a refusal. It then measures what it cost."""
    prof = params.profile
    concurrency = concurrency or next(c for c in prof.concurrency if isinstance(c, int))
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    work = level_workload(server, params, concurrency)
    work.warm_up(prof.warmup_requests)
    scraper = Scraper(server.base_url, params.server.api_key)
    # the server's processes, where /proc can see them: their CPU time and run-queue wait per step
    local = getattr(server, "remote", None) is None and hasattr(server, "process_tree")
    pids = server.process_tree() if local else []
    # the last one's /proc figures are what is kept (host_cpu_per_step): the first is not read for them
    unprofiled = [_engine_window(scraper, work.run, pids if last else ())[1] for last in (False, True)]

    if guard is not None:
        # the slice starts after one request's time, unprofiled (its ITL x its tokens)
        wave_s = (unprofiled[-1].itl_us or 0.0) * 1e-6 * prof.output_tokens
        work.n_requests = guard.allowed_requests(level_dir_name(concurrency), work, trace_dir, wave_s)

    def profiled_run() -> tuple[list, EngineWindow]:
        (records, _), window = _engine_window(scraper, work.run)
        return records, window

    with guard.watch() if guard is not None else contextlib.nullcontext() as watch:
        profiled, fields = profiled_window(server, params, trace_dir, expected_ranks or params.server.tensor_parallel,
                                           profiled_run, "the profiled workload", records_path,
                                           guard.arrival_timeout_s if guard is not None else None)
    result = CaptureResult(**fields, concurrency=concurrency,
                           engine_itl_unprofiled_runs_us=[w.itl_us for w in unprofiled],
                           engine_itl_profiled_us=profiled.itl_us, host_cpu_per_step=unprofiled[-1].cpu,
                           profiler_event_cost_us=profiler_event_cost_us(),
                           engine_itl_before_profiles_us=itl_before_profiles_us)
    if guard is not None:
        guard.measured(level_dir_name(concurrency), work.n_requests, profiled.steps, result, watch)
    return result


HOST_OPS = "host_ops"   # traces/host_ops/: the un-graphed step's capture (its record: trace.hostops.HOST_OPS_RECORD)
HOST_OPS_OUTPUT_TOKENS = 8   # a few decode steps after the prefill: their events per step price the profiler
HOST_OPS_TOKENS = 1024       # profile.host_ops_tokens when not given: past vLLM's largest captured graph (512)


def host_ops_prompt_tokens(params) -> int:
    """The un-graphed capture's prompt: profile.host_ops_tokens, within the server's max-model-len with
    room for the capture's few output tokens."""
    limit = params.server.engine_args.get("max-model-len") or params.server.engine_args.get("max_model_len")
    asked = params.profile.host_ops_tokens
    want = HOST_OPS_TOKENS if asked is None else int(asked)
    return min(want, int(limit) - HOST_OPS_OUTPUT_TOKENS - 8) if limit else want


def capture_host_ops(server, params, trace_dir: Path) -> Optional[CaptureResult]:
    """One request whose prompt is longer than the largest CUDA graph the engine captures, profiled: its
    prefill step runs outside the graphs (compiled, not replayed), so every op the graphs hide in a decode
    step (attention, the MoE layer, their Python) runs on the host there, and the trace prices each (the
    verdict's eager and piecewise-graph projections). None when profile.host_ops_tokens is 0."""
    tokens = host_ops_prompt_tokens(params)
    if tokens <= 0:
        return None
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    cfg = SweepConfig(base_url=server.base_url, model=params.model.name, endpoint="completions", levels=[1],
                      input_tokens=tokens, output_tokens=HOST_OPS_OUTPUT_TOKENS, requests_per_level=1,
                      warmup_requests=0, timeout_s=params.workload.request_timeout_s,
                      seed=params.workload.seed + 2, api_key=params.server.api_key)
    # a fresh prompt for the warm-up and for the profiled request: a cached prefix would skip the prefill
    prompts = run_async(build_prompts(cfg, 2))
    run_async(run_level(cfg, 1, prompts[:1], n_requests=1, warmup=0))
    _, fields = profiled_window(server, params, trace_dir, params.server.tensor_parallel,
                                lambda: run_async(run_level(cfg, 1, prompts[1:], n_requests=1, warmup=0)),
                                "the un-graphed step's profiled request")
    return CaptureResult(**fields, concurrency=1)



@dataclass
class EngineWindow:
    """The engine over one run of a workload, from /metrics (and /proc when its processes are on this
    machine) before and after it: its mean inter-token latency, its steps (iterations), and per process
    role (worker, engine core, api server) CPU time and run-queue wait per step."""

    itl_us: Optional[float] = None
    steps: Optional[float] = None
    cpu: dict = field(default_factory=dict)


def _engine_window(scraper, workload, pids=()):
    """(what `workload()` returned, its EngineWindow); a failed scrape leaves the /metrics figures None."""
    before, cpu0 = scraper.scrape()[2], cpu_schedstat(pids)
    result = workload()
    time.sleep(SETTLE_S)  # the engine records the last iteration's stats after its output went out
    after, cpu1 = scraper.scrape()[2], cpu_schedstat(pids)
    mean_s = histogram_mean_between(before, after, HISTOGRAM_MEANS["server_itl_mean_us"])
    steps = counter_delta(before, after, ENGINE_STEPS)
    return result, EngineWindow(itl_us=None if mean_s is None else mean_s * 1e6, steps=steps,
                                cpu=cpu_per_step(cpu0, cpu1, steps) if steps else {})
