"""Capture a torch.profiler trace of real decode steps through vLLM's profiler endpoints.

The server must have been started with a profiler directory (`--profiler-config` or, on older vLLM,
VLLM_TORCH_PROFILER_DIR): the runner does this for launched servers. After warm-up, /start_profile,
a controlled decode workload, /stop_profile, we wait until every rank's file is complete (its size
stable and, for .gz, a gzip stream that decompresses to the end).

The same workload runs twice just before /start_profile, unprofiled. The engine's inter-token latency
over each run (from /metrics) is the step as the server ran it there and then, which the verdict sets
the step model against beside 01's TPOT; the two unprofiled runs differ by the host's noise, and the
profiled run exceeds them by the profiler's own cost per step (its trace writers and the profiled
front end share the cores with the workers, so it is far more than its cost per recorded op, which is
measured too as profiler_event_cost_us: the fallback where /metrics has no inter-token latency).

A profile also leaves something behind: on the H200, after 04's first /stop_profile the Kimi-shaped engine
ran unprofiled 36% slower at concurrency 4 and 62% at 16 than 01 had measured it (its engine core's CPU per
step grew alike), while 04's first level, measured before any profile, agreed with 01. So before the
phase's first /start_profile every later level's workload runs once unprofiled too: that level's step as a
server never profiled runs it, which the profiler's cost is taken against (what an earlier profile left
behind included, as profiler_residue_us).
"""
from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


from decodescope.exec.host import mirror_move
from decodescope.exec.server import ServerHTTPError, ServerUnreachable, log_tail
from decodescope.serving.client import run_async
from decodescope.serving.promtext import ENGINE_STEPS, HISTOGRAM_MEANS, Scraper, counter_delta, histogram_mean_between
from decodescope.serving.telemetry import SETTLE_S
from decodescope.serving.sweep import (SERVER_FAILURE_CLASSES, SweepConfig, build_prompts, records_frame, run_level,
                                       warmup_count)
from decodescope.trace.load import find_trace_files
from decodescope.core.io import gzip_complete, write_parquet_atomic
from decodescope.schema.params_schema import KNEE
from decodescope.exec.procs import cpu_per_step, cpu_schedstat
from decodescope.schema.records import ProfileCapture
from decodescope.schema.rundata import RunDir, level_dir_name
from decodescope.serving.metrics import knee


class CaptureError(RuntimeError):
    pass


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


def unprofiled_itl_us(runs_us: list) -> Optional[float]:
    """The mean of the unprofiled runs that measured it; None when none did."""
    got = [float(x) for x in runs_us if x]
    return sum(got) / len(got) if got else None


def itl_window_noise(runs_us: list, profiled_us: Optional[float] = None) -> Optional[float]:
    """|a - b| / their mean, of the two unprofiled runs: how much one workload's step moves a second
    later; at least the profiled run's shortfall below their mean, where it is faster than them (the
    profiler cannot speed a step up: a third window moved by that much)."""
    got = [float(x) for x in runs_us if x]
    if len(got) < 2:
        return None
    mean = sum(got[:2]) / 2
    spread = abs(got[0] - got[1]) / mean
    return max(spread, (mean - float(profiled_us)) / mean) if profiled_us else spread


def engine_itl_unprofiled_us(runs_us: list, before_profiles_us: Optional[float]) -> Optional[float]:
    """The level's unprofiled step: as measured before the phase's first profile where it was, else the
    mean of the unprofiled runs just before its own profile."""
    return float(before_profiles_us) if before_profiles_us else unprofiled_itl_us(runs_us)


def profiler_step_cost_us(unprofiled_us: Optional[float], profiled_us: Optional[float]) -> Optional[float]:
    """What the profiler added to each step: the profiled run's inter-token latency less the unprofiled step's."""
    return profiled_us - unprofiled_us if unprofiled_us and profiled_us else None


def profiler_residue_us(runs_us: list, before_profiles_us: Optional[float]) -> Optional[float]:
    """How much slower the level ran unprofiled just before its own profile than before the phase's first:
    what the earlier profiles left behind in the server (plus the host's drift over the phase)."""
    after = unprofiled_itl_us(runs_us)
    return after - float(before_profiles_us) if after and before_profiles_us else None


def wait_for_traces(trace_dir: Path, before: set[Path], expected_ranks: int, timeout_s: float,
                    poll_s: float = 2.0, partial_ok: bool = False, check=None,
                    check_every_s: float = 10.0) -> tuple[list[Path], list[Path]]:
    """New rank traces (at least expected_ranks), each complete; on timeout raises CaptureError, or
    with partial_ok returns the complete ones that arrived. `check()` runs every check_every_s and
    raises when the traces can no longer come (the server, or the link to its host, is gone), so a
    dead server does not cost the whole flush timeout."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + check_every_s
    sizes: dict[Path, int] = {}
    while True:
        if check is not None and time.monotonic() >= next_check:
            check()
            next_check = time.monotonic() + check_every_s
        ranks, front = find_trace_files(trace_dir)
        new = [p for p in ranks if p not in before]
        new_front = [p for p in front if p not in before]
        stable = []
        for p in new:
            size = p.stat().st_size
            if size > 0 and sizes.get(p) == size and (p.suffix != ".gz" or gzip_complete(p)):
                stable.append(p)
            sizes[p] = size
        if len(new) >= expected_ranks and len(stable) == len(new):
            return sorted(new), sorted(new_front)
        if time.monotonic() > deadline:
            if partial_ok:
                return sorted(stable), sorted(new_front)
            raise CaptureError(f"after {timeout_s:.0f} s (profile.flush_timeout_s) {trace_dir} holds "
                               f"{len(stable)} complete of {expected_ranks} expected rank traces "
                               f"(new files: {[p.name for p in new]})")
        time.sleep(poll_s)


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


def _start_profile(server) -> None:
    try:
        server.start_profile()
    except ServerHTTPError as e:
        if e.status == 409:  # vLLM: a profile is running already; stopping another's would lose its trace
            raise CaptureError(f"POST {server.base_url}/start_profile answered HTTP 409: the server's profiler is "
                               "running already (another client, or a run that ended without stopping it). A "
                               "profile left running grows the workers' memory until it is stopped: stop it with "
                               f"POST {server.base_url}/stop_profile, then run again") from None
        raise CaptureError(f"POST {server.base_url}/start_profile answered HTTP {e.status}: the server has no "
                           "profiler configured. Start it with --profiler-config "
                           "'{\"profiler\":\"torch\",\"torch_profiler_dir\":\"/abs/dir\"}' (or "
                           "VLLM_TORCH_PROFILER_DIR on older vLLM)") from None
    except ServerUnreachable:
        server.raise_if_dead("the profile (/start_profile)")
        raise


def _stop_after_failure(server) -> None:
    """A workload that failed (or was interrupted) inside a window: the profile is stopped all the same, as a
    profile left running grows the workers' memory without bound. Its own failure is not the error to report."""
    try:
        server.stop_profile(timeout_s=float(STOP_AFTER_FAILURE_S))
    except Exception:
        pass


# the stop after a failed workload: long enough for a small window's export, short beside Ctrl-C's patience
STOP_AFTER_FAILURE_S = 120


def profiled_window(server, params, trace_dir: Path, expected_ranks: int, workload: Callable[[], tuple[list, Any]],
                    what: str, records_path: Optional[Path] = None,
                    arrival_timeout_s: Optional[float] = None) -> tuple[Any, dict]:
    """/start_profile, `workload()` (-> its request records and anything else), /stop_profile, then wait for
    every rank's trace: (the workload's anything else, the CaptureResult fields of the window). The records
    are written to records_path before the stop, so a server that fails there leaves them. A stop that never
    completes is a problem, not an error: the ranks that arrived within a short wait are kept.
    arrival_timeout_s: the wait for the traces once /stop_profile answered (default profile.flush_timeout_s)."""
    prof = params.profile
    before = set(p for group in find_trace_files(trace_dir) for p in group)
    problems: list[str] = []
    t0 = time.monotonic()
    _start_profile(server)
    t1 = time.monotonic()
    try:
        records, extra = workload()
    except BaseException:
        _stop_after_failure(server)
        raise
    t2 = time.monotonic()
    df = records_frame(records)
    if records_path is not None:
        write_parquet_atomic(records_path, df)
    if df["error_class"].isin(SERVER_FAILURE_CLASSES).any():
        server.raise_if_dead(what)
    try:
        server.stop_profile(timeout_s=prof.flush_timeout_s)
    except ServerHTTPError as e:
        server.raise_if_dead("the profile (/stop_profile)")
        raise stop_profile_error(server, e.status, time.monotonic() - t2) from None
    except ServerUnreachable as e:
        server.raise_if_dead("the profile (/stop_profile)")
        problems.append(f"{e} (profile.flush_timeout_s); the rank traces that arrived were analysed")
    t3 = time.monotonic()
    # after a /stop_profile that never completed, wait only briefly for files still being written
    wait_s = min(prof.flush_timeout_s, 30.0) if problems else (arrival_timeout_s or prof.flush_timeout_s)
    ranks, front = wait_for_traces(trace_dir, before, expected_ranks, wait_s, partial_ok=bool(problems),
                                   # after a /stop_profile that failed the server may be stuck but alive:
                                   # then the short wait above is the limit, not its health
                                   check=None if problems else
                                   (lambda: server.raise_if_dead("the wait for the profiler's traces")))
    if len(ranks) < expected_ranks:
        problems.append(f"{len(ranks)} of {expected_ranks} rank traces arrived complete in {trace_dir}")
    fields = dict(trace_dir=trace_dir, rank_files=ranks, frontend_files=front,
                  tables=sorted(trace_dir.glob("*profiler_out*")), requests_ok=int(df["ok"].sum()),
                  requests_failed=int((~df["ok"]).sum()), start_profile_s=t1 - t0, workload_s=t2 - t1,
                  stop_profile_s=t3 - t2, flush_wait_s=time.monotonic() - t3, expected_ranks=expected_ranks,
                  problems=problems)
    return extra, fields


def capture_profile(server, params, trace_dir: Path, expected_ranks: Optional[int] = None,
                    records_path: Optional[Path] = None, concurrency: Optional[int] = None,
                    itl_before_profiles_us: Optional[float] = None, guard=None) -> CaptureResult:
    """Warm up, profile a decode workload at one concurrency, stop, and wait for the traces.
    itl_before_profiles_us: this level's inter-token latency before the phase's first profile
    (itl_before_profiles), the unprofiled step the profiler's cost is taken against. guard: an attached
    server's (trace.attachprofile.AttachedProfiler), which plans the window from a profiled slice of the same
    workload (all of it, fewer requests, or a refusal) and measures what it cost."""
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


def profiler_event_cost_us(n_ops: int = 20000, repeats: int = 3) -> Optional[float]:
    """What torch.profiler (CPU activity, no stacks or shapes: how the server is started) adds to one
    recorded op: a tiny op timed n_ops times with and without it, the least difference of `repeats`."""
    try:
        # torch: the cpu/gpu extras only; the analysis side imports this module without it
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    a = torch.ones(8)

    def per_op_us() -> float:
        t0 = time.perf_counter()
        for _ in range(n_ops):
            torch.add(a, a)
        return (time.perf_counter() - t0) / n_ops * 1e6

    diffs = []
    for _ in range(repeats):
        plain = per_op_us()
        with profile(activities=[ProfilerActivity.CPU]):
            profiled = per_op_us()
        diffs.append(profiled - plain)
    return max(0.0, min(diffs))


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


def stop_profile_error(server, http_code: int, waited_s: float) -> CaptureError:
    """/stop_profile failed: the workers died or failed writing their traces; the server log says why."""
    log_path = getattr(server, "log_path", None)
    where = (f"last lines of {log_path}:\n{log_tail(log_path)}" if log_path and Path(log_path).is_file()
             else "see the server's own log")
    return CaptureError(f"POST {server.base_url}/stop_profile answered HTTP {http_code} after {waited_s:.0f} s: "
                        "the server failed while writing its traces (a worker killed for memory is the usual "
                        "cause: keep profile.requests small and profile.with_stack false); " + where)


def profile_levels(params, run: RunDir) -> tuple[list[int], list[str]]:
    """profile.concurrency resolved against 01's levels (the run's serving_levels.parquet): ('knee' ->
    01's knee, or its highest level when throughput still grows), duplicates dropped, in the order given;
    and notes on what changed."""
    out: list[int] = []
    notes: list[str] = []
    for c in params.profile.concurrency:
        if c == KNEE:
            lv = run.serving_levels()
            if lv is None:
                notes.append("profile.concurrency 'knee' left out: 01_serving did not run")
                continue
            lv = lv[lv["output_throughput_tok_s"].notna()] if "output_throughput_tok_s" in lv else lv.iloc[0:0]
            if lv.empty:
                notes.append("profile.concurrency 'knee' left out: 01 measured no throughput")
                continue
            k = knee(lv)
            c = int(k) if k is not None else int(lv["level"].max())
            why = "throughput grows < 10% past it" if k is not None else "throughput still grows; its highest level"
            above = sorted(int(x) for x in lv["level"] if int(x) > c)
            if c in out and above:
                # the knee is a level already profiled: the next level up still shows the step's growth
                c, why = above[0], f"the knee ({c}) is profiled already; the next level up"
            notes.append(f"'knee' is concurrency {c} (01: {why})")
        if c not in out:
            out.append(int(c))
    if not out:
        raise CaptureError("profile.concurrency resolves to no level: " + "; ".join(notes)
                           + ". Give an integer level, e.g. [1, knee]")
    return out, notes


def file_into(files: list[Path], dest: Path, params=None) -> list[Path]:
    """Move a capture's files into `dest` (an earlier capture there is replaced); on an ssh host the same
    move there first, or copying traces/ back would bring them back."""
    if params is not None:
        mirror_move(params, files, dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return [Path(shutil.move(str(p), dest / Path(p).name)) for p in files]
