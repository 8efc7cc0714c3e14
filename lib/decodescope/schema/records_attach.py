"""Typed record of 04's guard for an attached server: data/profile/attach_guard.json.

decodescope.schema.records says how records are versioned, read and written.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model


class WindowCost(_Model):
    """One profiled window on the attached server, as measured: its engine steps, the largest rank
    trace it left, and what exporting it added to the server's resident memory."""

    label: str = Field(description="probe-1, slice-c<N> (a level's slice), or c<N> (a level's window)")
    requests: int = Field(description="requests the window ran")
    steps: float = Field(description="engine steps in the profiled span (vLLM's iteration counter)")
    trace_steps: Optional[int] = Field(None, description="engine steps annotated in its largest rank trace: "
                                       "what that trace's bytes were written for; None: not counted")
    tokens: float = Field(description="output tokens the server generated in the profiled span")
    span_s: float = Field(description="/start_profile answered to /stop_profile sent: the span profiled")
    trace_bytes: int = Field(description="the largest rank trace file it left, as written (gzip)")
    export_bytes: Optional[int] = Field(None, description="sum over the server's processes of peak less start "
                                        "resident memory over the window; None: the processes could not be read")
    window_s: float = Field(description="/start_profile sent to the last rank trace complete")


class WindowPlan(_Model):
    """A level's profiled window, estimated before it ran from the probes, and what the guard decided."""

    label: str
    planned_requests: int = Field(description="profile.requests at this level (at least one batch)")
    planned_tokens: float = Field(description="output tokens of that workload (requests x profile.output_tokens)")
    priced_by: Optional[str] = Field(None, description="the measured window it was priced from: its slice, or "
                                     "where that saw no engine step, the window with the most trace bytes a step")
    est_span_s: float = Field(description="its profiled span at the slice's output tokens per second")
    est_steps: Optional[float] = Field(None, description="the most engine steps it can take: each request "
                                       "alone, a prefill step, one a further token and one after its last")
    allowed_requests: int = Field(description="what the guard let run: planned_requests, fewer, or 0 (refused)")
    est_trace_bytes: int = Field(description="estimated largest rank trace of the allowed window")
    est_export_bytes: int = Field(description="estimated sum of the processes' export memory, allowed window")
    mem_available_bytes: Optional[int] = Field(None, description="the host's available memory before the window")
    disk_free_bytes: Optional[int] = Field(None, description="free space where the server writes its traces")
    decision: str = Field(description="'fits', 'shrunk' or 'refused', with the reason")


class AttachGuard(Record):
    """What 04 read of an attached server's profiler before profiling it: probe-1, each level's slice, each
    level's plan from its slice, and what each level's window then measured (levels), so the estimate can
    be set against the measurement (profiling.attachguard)."""

    server_pid: Optional[int] = Field(None, description="the API server's pid on its host; None: not visible")
    with_stack: Optional[bool] = Field(None, description="torch_profiler_with_stack as its command line says")
    trace_dir: str = Field(description="where the server writes its traces on its host")
    probes: list[WindowCost] = Field(default_factory=list)
    slices: list[WindowCost] = Field(default_factory=list)
    export_per_trace_byte: Optional[float] = Field(None, description="the ratio the plans used")
    plans: list[WindowPlan] = Field(default_factory=list)
    levels: list[WindowCost] = Field(default_factory=list)
