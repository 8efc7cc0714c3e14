"""04 on an attached server: the probe windows, each level's plan, and what each window then cost.

profiling.attachguard holds the arithmetic: pure functions of the measured costs.
This module runs the probe windows through profiling.window.profiled_window.
It reads the server's memory on its host while they run (exec.attached.TreeWatch).
It keeps data/profile/attach_guard.json current after every step.
So a server that dies under a profile leaves what was measured.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

from decodescope.exec.attached import TreeWatch, read_server, server_port
from decodescope.schema.recordbase import write_record
from decodescope.schema.records_attach import AttachGuard, WindowCost, WindowPlan
from decodescope.schema.rundata import RunDir
from decodescope.serving.client import run_async
from decodescope.serving.promtext import ENGINE_STEPS, Scraper, counter_delta
from decodescope.serving.sweep import SweepConfig, build_prompts, run_level
from decodescope.profiling.attachguard import (export_ratio, plan_window, pricing_window, refusal_message, slice_seconds,
                                           stack_refusal)
from decodescope.profiling.window import CaptureError, file_into, profiled_window
from decodescope.trace.reader import TraceError, annotated_steps
from decodescope.engines import engine

log = logging.getLogger(__name__)
GUARD_RECORD = "profile/attach_guard.json"   # under data/
PROBES_DIR = "attach_probe"                  # traces/attach_probe/probe-<n>/
# once /stop_profile answered, vLLM has written its traces: a longer wait only delays the error that
# the server writes them somewhere other than host.trace_dir
ARRIVAL_TIMEOUT_S = 60.0
TOKENS = engine().metrics.generation_tokens     # output tokens the engine generated
WINDOW_PARTS = ("start_profile_s", "workload_s", "stop_profile_s", "flush_wait_s")   # /start_profile to traces whole
_FREE_DISK = "import os, sys\nst = os.statvfs(sys.argv[1])\nprint(st.f_bavail * st.f_frsize)\n"


def _largest_trace(rank_files) -> tuple[int, Optional[int]]:
    """The largest rank trace's bytes and the engine steps annotated in it; (0, None) where there is none.
    Steps are None where the file cannot be read (the plan then takes vLLM's step counter)."""
    sized = [(Path(p).stat().st_size, Path(p)) for p in rank_files]
    if not sized:
        return 0, None
    size, trace = max(sized, key=lambda x: x[0])   # the first of equal sizes, as before
    try:
        return size, annotated_steps(trace)
    except TraceError as e:
        log.warning("profile: the attach guard could not count the steps in %s: %s", trace, e)
        return size, None


def export_bytes(reading: dict) -> Optional[int]:
    """The server's processes' resident memory at its peak less at the start, summed; None unread."""
    start, peak = reading.get("rss_start_bytes") or {}, reading.get("rss_peak_bytes") or {}
    if not reading.get("pid") or not peak:
        return None
    return int(sum(max(0, peak[p] - start.get(p, peak[p])) for p in peak))


class AttachedProfiler:
    """The guard of one 04 run on an attached server (capture.capture_profile calls it per level)."""

    def __init__(self, server, params, run_dir: Path, host, reading: dict, folder: str):
        self.server, self.params, self.run_dir, self.host = server, params, Path(run_dir), host
        self.port, self.ranks = server_port(params), int(params.server.tensor_parallel)
        prof = reading.get("profiler") or {}
        self.record = AttachGuard(server_pid=reading.get("pid"), trace_dir=folder,
                                  with_stack=prof.get("torch_profiler_with_stack") if prof.get("configured") else None)
        self.arrival_timeout_s = ARRIVAL_TIMEOUT_S

    @property
    def path(self) -> Path:
        return RunDir(self.run_dir).file(GUARD_RECORD)

    def _save(self) -> None:
        write_record(self.path, self.record)

    def watch(self) -> TreeWatch:
        return TreeWatch(self.host, self.port, timeout_s=float(self.params.profile.flush_timeout_s) + 120.0)

    def _disk_free(self) -> Optional[int]:
        r = self.host.run([self.host.python, "-c", _FREE_DISK, self.record.trace_dir], timeout_s=60.0)
        return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None

    def _mem_available(self) -> Optional[int]:
        return read_server(self.host, self.port).get("mem_available_bytes")

    # ---- probe-1 and each level's slice ---------------------------------------------------------------
    def probe(self, trace_dir: Path) -> None:
        """probe-1: one request of one output token (run once unprofiled first, so the window holds no
        first-time work), profiled; its traces filed into traces/attach_probe/probe-1/."""
        self._save()   # what was read of the server, whatever follows
        refused = stack_refusal(self.record.with_stack, self.ranks, self._mem_available())
        if refused:
            raise CaptureError(refused)
        log.info("profile: the attached server's profiler, probed with one request of 1 output token")
        prof = self.params.profile
        cfg = SweepConfig(base_url=self.server.base_url, model=self.params.model.name, endpoint="completions",
                          levels=[1], input_tokens=prof.input_tokens, output_tokens=1, requests_per_level=1,
                          warmup_requests=0, timeout_s=self.params.workload.request_timeout_s,
                          seed=self.params.workload.seed + 3, api_key=self.params.server.api_key)
        prompts = run_async(build_prompts(cfg, 1))
        run_async(run_level(cfg, 1, prompts, n_requests=1, warmup=0))
        scraper = Scraper(self.server.base_url, self.params.server.api_key)
        before = scraper.scrape()[2]
        try:
            with self.watch() as watch:
                _, fields = profiled_window(self.server, self.params, trace_dir, self.ranks,
                                            lambda: run_async(run_level(cfg, 1, prompts, n_requests=1, warmup=0)),
                                            "the attach guard's probe window", arrival_timeout_s=self.arrival_timeout_s)
        except CaptureError as e:
            raise CaptureError(f"{e}. An attached server's traces are read from host.trace_dir "
                               f"({self.record.trace_dir}): it must be the torch_profiler_dir of the server's "
                               "--profiler-config") from None
        after = scraper.scrape()[2]
        steps, tokens = counter_delta(before, after, ENGINE_STEPS) or 1.0, counter_delta(before, after, TOKENS) or 1.0
        self.record.probes.append(self._cost("probe-1", 1, steps, tokens, fields["workload_s"], fields, watch,
                                             trace_dir))
        self._save()

    def _cost(self, label: str, requests: int, steps: float, tokens: float, span_s: float, fields: dict,
              watch: TreeWatch, trace_dir: Path) -> WindowCost:
        """A probe's or slice's cost; its files filed into traces/attach_probe/<label>/."""
        rank_names = {p.name for p in fields["rank_files"]}
        files = file_into(fields["rank_files"] + fields["frontend_files"], trace_dir / PROBES_DIR / label, self.params)
        trace_bytes, trace_steps = _largest_trace([p for p in files if p.name in rank_names])
        return WindowCost(label=label, requests=requests, steps=float(steps), tokens=float(tokens), span_s=span_s,
                          trace_bytes=trace_bytes, trace_steps=trace_steps,
                          export_bytes=export_bytes(watch.reading), window_s=sum(fields[k] for k in WINDOW_PARTS))

    def _slice(self, label: str, work, seconds: float, trace_dir: Path, wave_s: float) -> WindowCost:
        """The level's workload, profiled for `seconds` once its first wave of requests (wave_s) has run, and
        then left to finish unprofiled. Not its first seconds: the requests start together and their batches
        are full, while over the window they drift apart (at concurrency 4 here the window took 84 steps for
        48 batches' worth of tokens), and a trace grows by the step."""
        scraper = Scraper(self.server.base_url, self.params.server.api_key)
        done = threading.Event()
        marks: dict = {}

        def run_then_mark() -> None:
            try:
                work.run()
            finally:
                done.set()
        threading.Thread(target=run_then_mark, daemon=True).start()
        done.wait(wave_s)

        def sliced() -> tuple[list, None]:
            marks["start"] = (time.monotonic(), scraper.scrape()[2])
            done.wait(seconds)
            marks["stop"] = (time.monotonic(), scraper.scrape()[2])
            return [], None

        with self.watch() as watch:
            _, fields = profiled_window(self.server, self.params, trace_dir, self.ranks, sliced,
                                        f"the attach guard's slice of {label}", arrival_timeout_s=self.arrival_timeout_s)
        done.wait(float(self.params.workload.request_timeout_s))   # the rest runs unprofiled: the next window starts clean
        (t0, m0), (t1, m1) = marks["start"], marks["stop"]
        steps, tokens = counter_delta(m0, m1, ENGINE_STEPS) or 0.0, counter_delta(m0, m1, TOKENS) or 0.0
        return self._cost(f"slice-{label}", work.n_requests, steps, tokens, t1 - t0, fields, watch, trace_dir)

    # ---- each level -----------------------------------------------------------------------------------
    def allowed_requests(self, label: str, work, trace_dir: Path, wave_s: float) -> int:
        """The level's requests the host can afford to profile, from a slice of its own workload taken after
        its first wave (wave_s: one request's time, unprofiled); raises CaptureError when not one batch (or not
        even a slice) fits."""
        ratio = export_ratio(self.record.probes + self.record.slices + self.record.levels, self.ranks)
        tokens = float(work.n_requests * self.params.profile.output_tokens)
        mem = self._mem_available()
        seconds = slice_seconds(self.record.probes[-1], self.ranks, mem, ratio)
        if seconds <= 0:
            raise CaptureError(refusal_message(self.record, plan_window(
                label, self.record.probes[-1], work.n_requests, tokens, work.concurrency, self.ranks, ratio,
                mem, self._disk_free()), self.ranks))
        cut = self._slice(label, work, seconds, trace_dir, wave_s)
        self.record.slices.append(cut)
        measured = self.record.probes + self.record.slices + self.record.levels
        ratio = export_ratio(measured, self.ranks)
        basis = pricing_window(cut, measured)
        if basis is not cut:
            log.info("profile: %s: its slice saw no engine step (the workload ended before the profiler started); "
                     "priced from %s, the window measured with the most trace bytes a step", label, basis.label)
        plan = plan_window(label, basis, work.n_requests, tokens, work.concurrency, self.ranks, ratio,
                           self._mem_available(), self._disk_free())
        self.record.plans.append(plan)
        self.record.export_per_trace_byte = ratio
        self._save()
        if plan.allowed_requests == 0:
            raise CaptureError(refusal_message(self.record, plan, self.ranks))
        if plan.allowed_requests < work.n_requests:
            log.info("profile: %s: %d of %d requests profiled (%s)", label, plan.allowed_requests,
                     work.n_requests, plan.decision)
        return plan.allowed_requests

    def measured(self, label: str, requests: int, steps: Optional[float], result, watch: TreeWatch) -> None:
        """What the level's window cost, beside its plan."""
        trace_bytes, trace_steps = _largest_trace(result.rank_files)
        self.record.levels.append(WindowCost(
            label=label, requests=requests, steps=float(steps or 0.0),
            tokens=float(requests * self.params.profile.output_tokens),
            trace_bytes=trace_bytes, trace_steps=trace_steps,
            export_bytes=export_bytes(watch.reading), span_s=result.workload_s,
            window_s=sum(getattr(result, k) for k in WINDOW_PARTS)))
        self._save()

    def plan_host_ops(self, tokens: float) -> Optional[WindowPlan]:
        """The un-graphed step's window (one request of `tokens` output tokens), planned at probe-1's pace
        (one request too); None when it fits."""
        plan = plan_window("host_ops", self.record.probes[-1], 1, tokens, 1, self.ranks,
                           export_ratio(self.record.probes + self.record.slices + self.record.levels, self.ranks),
                           self._mem_available(), self._disk_free())
        self.record.plans.append(plan)
        self._save()
        return None if plan.allowed_requests else plan

    def summary(self) -> str:
        """What was measured, for an error that ends the phase (a server that died under a profile)."""
        parts = [f"{p.label}: {p.span_s:.2f} s profiled, {p.steps:.0f} steps, rank trace {p.trace_bytes / 2**20:.2f} MiB"
                 for p in self.record.probes + self.record.slices]
        parts += [f"{p.label} planned: {p.allowed_requests} requests, est. {p.est_steps or 0:.0f} steps and "
                  f"{p.est_span_s:.1f} s profiled, "
                  f"{p.est_trace_bytes / 2**20:.1f} MiB/rank, "
                  f"{p.est_export_bytes / 2**30:.2f} GiB export ({p.decision})" for p in self.record.plans]
        return f"measured before it (data/{GUARD_RECORD}): " + "; ".join(parts) if parts else ""


__all__ = ["AttachedProfiler", "GUARD_RECORD", "export_bytes"]
