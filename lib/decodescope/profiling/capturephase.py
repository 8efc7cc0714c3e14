"""04_profile's capture, phase glue: every level profiled through the run's server, each level's files in
its own trace directory, and for an attached server the guard (profiling.attach) around it all.

profiling.capture holds a level's capture, and profiling.window the profiled window itself. This module
decides which windows a phase takes: profile_levels picks the levels from 01's results. It decides where
their files go, and writes the phase's record (data/profile_capture.json).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

from decodescope.engines.vllm_log import last_engine_modes
from decodescope.core.rundir import LOGS
from decodescope.exec.attached import check_attached, trace_dir_on_host
from decodescope.exec.host import host_for, node_traces
from decodescope.exec.runserver import phase_server
from decodescope.exec.server import ServerDied
from decodescope.schema.recordbase import write_record
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.records import ProfileCaptures
from decodescope.schema.params_schema import KNEE
from decodescope.schema.rundata import RunDir, level_dir_name
from decodescope.serving.metrics import knee
from decodescope.profiling.attach import AttachedProfiler
from decodescope.profiling.capture import (HOST_OPS, HOST_OPS_OUTPUT_TOKENS, CaptureResult, capture_host_ops,
                                       capture_profile, host_ops_prompt_tokens, itl_before_profiles)
from decodescope.trace.hostops import host_ops_wanted
from decodescope.profiling.window import CaptureError, file_into

PHASE = "04_profile"
log = logging.getLogger(__name__)


def _file_level(result: CaptureResult, trace_dir: Path, params=None, name: Optional[str] = None) -> CaptureResult:
    """Move one capture's files into traces/c<N>/ (or traces/<name>/), so each level is its own trace directory."""
    dest = trace_dir / (name or level_dir_name(result.concurrency))
    tables = [p for p in result.tables if p.parent == trace_dir]
    moved = file_into([*result.rank_files, *result.frontend_files, *tables], dest, params)
    n_rank, n_front = len(result.rank_files), len(result.frontend_files)
    result.rank_files, result.frontend_files = moved[:n_rank], moved[n_rank:n_rank + n_front]
    result.tables = moved[n_rank + n_front:]
    result.trace_dir = dest
    return result


@contextlib.contextmanager
def _attached_guard(ctx: PhaseContext, server, trace_dir: Path):
    """For an attached server: its profiler read (exec.attached.check_attached), its traces copied in from
    where it writes them, the probe windows run; yields the guard (None for a launched server). A server
    that dies under a profile is reported with what the guard measured before."""
    params = ctx.params
    if params.server.mode != "attach":
        yield None
        return
    host = host_for(params)
    reading = check_attached(params, host, [PHASE])
    folder = trace_dir_on_host(params, reading)
    assert folder is not None  # check_attached refuses a run that cannot know it
    with node_traces(params, trace_dir, folder):
        guard = AttachedProfiler(server, params, ctx.run_dir, host, reading, folder)
        try:
            guard.probe(trace_dir)
            yield guard
        except ServerDied as e:
            raise ServerDied(f"{e}; {guard.summary()}. Nothing was sent to the server's processes: decodescope "
                             "never signals a server it attached to") from None


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


def capture_for_phase(ctx: PhaseContext) -> tuple[list[CaptureResult], list[str], Optional[CaptureResult]]:
    """Profile every level of profile.concurrency through the run's server, launched with traces/ as
    its profiler directory (or a server started here for this notebook alone, with the same
    directory); each level's files end in traces/c<N>/ and its records in data/profile/c<N>/. A level
    whose capture loses ranks is kept (its problems say so); one with no trace at all stops the phase. Then
    the un-graphed step (capture_host_ops) into traces/host_ops/, returned third (None when not asked).
    An attached server is profiled only in windows its host can afford (profiling.attachguard)."""
    trace_dir = ctx.run_dir / "traces"
    levels, notes = profile_levels(ctx.params, RunDir(ctx.run_dir))
    results = []

    with phase_server(ctx.params, ctx.run_dir, profiler_dir=trace_dir) as server:
        if len(levels) > 1:
            log.info("profile: concurrency %s unprofiled, before the first profile", ", ".join(map(str, levels[1:])))
        before = itl_before_profiles(server, ctx.params, levels)
        with _attached_guard(ctx, server, trace_dir) as guard:
            for i, c in enumerate(levels):
                log.info("profile: concurrency %s (%d of %d)", c, i + 1, len(levels))
                level_data = RunDir(ctx.run_dir).level_dir(c)
                level_data.mkdir(parents=True, exist_ok=True)
                result = capture_profile(server, ctx.params, trace_dir, concurrency=c,
                                         records_path=level_data / "profile_requests.parquet",
                                         itl_before_profiles_us=before.get(c), guard=guard)
                result = _file_level(result, trace_dir, ctx.params)
                write_record(level_data / "profile_capture.json", result.to_record())
                if not result.rank_files:
                    result.raise_if_incomplete()
                results.append(result)
            if guard is not None:
                notes += [f"attached server, {p.label}: {p.allowed_requests} of {p.planned_requests} requests "
                          f"profiled ({p.decision})" for p in guard.record.plans if p.decision != "fits"]
            host = _host_ops(ctx, server, trace_dir, guard, notes)
    write_record(ctx.data("profile_capture.json"), ProfileCaptures(levels=levels, notes=notes,
                                                                    captures=[r.to_record() for r in results]))
    return results, notes, host


def _host_ops(ctx: PhaseContext, server, trace_dir: Path, guard: Optional[AttachedProfiler], notes: list[str]) -> Optional[CaptureResult]:
    """The un-graphed step's capture where the engine's modes ask for it (and an attached host affords it)."""
    modes = last_engine_modes(ctx.run_dir / LOGS / "server.log")
    wanted, why_not = host_ops_wanted(ctx.params.profile.host_ops_tokens is not None, modes)
    if wanted and guard is not None and host_ops_prompt_tokens(ctx.params) > 0:
        refused = guard.plan_host_ops(float(HOST_OPS_OUTPUT_TOKENS))
        if refused is not None:
            wanted, why_not = False, f"the un-graphed step's capture left out: {refused.decision}"
            notes.append(why_not)
    log.info(f"profile: one request of {host_ops_prompt_tokens(ctx.params)} prompt tokens, past the largest CUDA "
             "graph: the host's cost of the ops graphs hide" if wanted else f"profile: {why_not}")
    host = capture_host_ops(server, ctx.params, trace_dir) if wanted else None
    return _file_level(host, trace_dir, ctx.params, HOST_OPS) if host is not None else None
