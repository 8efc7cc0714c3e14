"""Typed records: one pydantic model per JSON file a phase writes, used by the writer and every reader.

Each file record carries `schema_version`, an int. The field's default is the version this code writes and
reads. `read_record(path, Model)` refuses a file of another version, or one that does not validate. Its
`RecordError` names the file, the version found, the one expected and the fields at fault.
`write_record(path, record)` writes atomically (`decodescope.core.io.write_json_atomic`). Bump a record's
`schema_version` default whenever its fields change meaning or shape.

Rows of parquet tables are models too, without a version: a table keeps its columns. Their columns are
declared once, next to the model, as `*_COLUMNS = columns_of(Model)`.

| file                         | record           | written by                          |
|------------------------------|------------------|-------------------------------------|
| manifest.json                | RunManifest      | runmanifest.Manifest (records_manifest) |
| data/host.json               | HostInventory    | hardware.inventory (00_host; records_host) |
| data/collectives_fit.json    | CollectivesFit   | microbench.save_collectives (03)    |
| data/profile_summary.json    | ProfileSummary   | trace.profile.write_profile (04; records_profile) |
| data/verdict.json            | Verdict          | verdict.verdict (05_verdict)        |
| data/profile_capture.json    | ProfileCaptures  | profiling.capture (04)                  |
| data/profile/host_ops.json   | HostOps          | trace.hostops.host_op_costs (04; records_profile) |
| data/profile/c<N>/critical_path.json | CriticalPathSummary | critpath.record (04; records_critpath) |
| data/skew_calibration.json   | SkewCalibration  | micro.skewcal.replay_and_calibrate_for_phase (03; records_critpath) |
| data/server.json             | ServerInfo       | runserver.write_server_info (records_server) |
| data/link.json               | LinkMeasure      | runserver.write_server_info (records_server) |
| data/gemm_raw.json           | ProbeOutput      | probes.gemm (02; records_probe)     |
| data/*_ranks/*_rank<r>.json  | ProbeOutput      | probes.collectives, probes.step (03; records_probe) |
| data/serving_levels.parquet  | ServingLevel row | serving.metrics.level_summary (01; records_serving) |
| data/telemetry/level_*.parquet | TelemetrySample row | serving.telemetry (01; records_serving) |
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model, columns_of
# re-exported (__all__): the phases, the report and the tests name these records as records'
from decodescope.schema.recordbase import RecordError, frame, read_record, write_record
from decodescope.schema.records_profile import (BreakdownRow, CallsWithWait, CollectiveWaitRow, ExpectedVsObservedRow,
                                                HostOpRow, HostOps, ScheduleRow, StepCategoryRow, StepMedians,
                                                TopUnknownRow)
from decodescope.schema.records_verdict import (FINDING_TOPICS, AttributionRow, Bottleneck, CurveRow, Finding,
                                                LevelReconcileRow, ProjectionRow, ReconcileRow, ReplayRow,
                                                ServingHeadline, VariantRow, Verdict)


# ---- collective latency fit (data/collectives_fit.json) ---------------------------------------------
class LatencyFit(_Model):
    """t(n) = alpha + n / beta for one collective through one communicator, least squares over the size
    sweep (rank 0). The projections use the back_to_back (or cuda_graph) fits: the way a step pays."""

    op: str
    inplace: bool
    communicator: str = Field("torch", description="torch_gloo, torch_nccl, vllm_shm, ...")
    timing: str = Field("isolated", description="back_to_back, cuda_graph or isolated (probes/collectives.py)")
    alpha_us: float = Field(description="per-call latency, us")
    beta_gbps: float = Field(description="bandwidth, GB/s (inf when the slope is not positive)")
    points: int = Field(description="sweep sizes fitted")


LATENCY_FIT_COLUMNS = columns_of(LatencyFit)


class CollectivesFit(Record):
    """data/collectives_fit.json (03_collectives)."""

    fits: list[LatencyFit] = Field(default_factory=list)


# ---- profile summary (data/profile_summary.json) ---------------------------------------------------
class ProfileSummary(Record):
    """data/profile_summary.json (04_profile, `decodescope analyze-trace`): the figures the verdict
    and the report read. Per-rank dicts are keyed by the rank (an int here, a string in the file, as
    JSON keys are); the list fields are the rows of the analysis tables (trace.analyze), typed
    (decodescope.schema.records_profile)."""

    device: str = Field(description="gpu or cpu")
    ranks: list[int]
    concurrency: Optional[int] = Field(None, description="the level the capture ran at (04_profile)")
    step_kind: str = Field(description="the kind of step the per-step figures describe (decode when found)")
    steps: dict[str, int] = Field(description="steps found per kind")
    allreduce_share_of_time: dict[int, float] = Field(description="rank -> all-reduce share of its op time")
    allreduce_calls_per_step: dict[int, float] = Field(description="rank -> all-reduces per step_kind step")
    allreduce_mean_us: dict[int, float] = Field(description="rank -> mean time of one all-reduce call")
    allreduce_communicators: dict[str, float] = Field(
        default_factory=dict, description="communicator (from op/kernel names) -> its share of all-reduce time")
    allreduce_transfer_us_per_step: Optional[float] = Field(
        None, description="the median all-reduce call at its least time over the ranks x calls per step: the "
                          "collectives' own time, without waiting for a late rank")
    allreduce_with_wait: Optional[CallsWithWait] = Field(None, description="gloo: the calls, op plus wait op, at their "
                                                         "least time over the ranks (trace.analyze.calls_with_wait)")
    per_step: StepMedians
    expected_vs_observed: list[ExpectedVsObservedRow] = Field(default_factory=list)
    per_step_categories: list[StepCategoryRow] = Field(default_factory=list)
    breakdown: list[BreakdownRow] = Field(default_factory=list)
    other_share: float = Field(description="share of time in no category")
    top_unknown: list[TopUnknownRow] = Field(default_factory=list)
    collective_wait: list[CollectiveWaitRow] = Field(default_factory=list)
    schedule: list[ScheduleRow] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


# ---- profile capture (data/profile/c<N>/profile_capture.json, data/profile_capture.json) -------------
class RoleCpu(_Model):
    """One role's processes of the server (api server, engine core, worker) over 04's last unprofiled
    run: per engine step, the mean over the role's processes (/proc schedstat)."""

    cpu_us: float = 0.0
    runq_wait_us: float = Field(0.0, description="runnable, no core free: the host's other processes held it")
    processes: int = 0


class ProfileCapture(Record):
    """data/profile/c<N>/profile_capture.json (04_profile): one profiled level's capture: the files it
    left, its timings, and the engine's inter-token latency over the same workload run twice without
    the profiler, then under it. An empty record stands for a level 04 did not capture."""

    trace_dir: str = ""
    rank_files: list[str] = Field(default_factory=list)
    frontend_files: list[str] = Field(default_factory=list)
    tables: list[str] = Field(default_factory=list)
    requests_ok: int = 0
    requests_failed: int = 0
    start_profile_s: float = 0.0
    workload_s: float = 0.0
    stop_profile_s: float = 0.0
    flush_wait_s: float = 0.0
    expected_ranks: int = 0
    problems: list[str] = Field(default_factory=list)
    concurrency: int = 0
    engine_itl_unprofiled_runs_us: list[Optional[float]] = Field(default_factory=list)
    engine_itl_profiled_us: Optional[float] = None
    profiler_event_cost_us: Optional[float] = Field(None, description="the profiler's cost per recorded op")
    host_cpu_per_step: dict[str, RoleCpu] = Field(default_factory=dict, description="role -> its CPU per step; "
                                                  "empty when the server's processes are not on this machine")
    engine_itl_before_profiles_us: Optional[float] = Field(None, description="the same workload unprofiled before "
                                                           "the phase's first /start_profile (levels after the first)")
    engine_itl_unprofiled_us: Optional[float] = Field(None, description="the unprofiled step: before the first "
                                                      "profile where measured, else the mean of the unprofiled runs")
    window_noise: Optional[float] = Field(None, description="|a - b| / mean of the two unprofiled runs, at least "
                                          "the profiled run's shortfall below them")
    profiler_step_cost_us: Optional[float] = Field(None, description="profiled less unprofiled inter-token latency")
    profiler_residue_us: Optional[float] = Field(None, description="the unprofiled runs just before this level's "
                                                 "profile less engine_itl_before_profiles_us: what earlier "
                                                 "profiles left behind")

    def role(self, name: str) -> RoleCpu:
        return self.host_cpu_per_step.get(name) or RoleCpu()

    @staticmethod
    def of(captures: Optional[dict[int, "ProfileCapture"]], level: int) -> "ProfileCapture":
        """The level's capture among 04's (concurrency -> record), or an empty one where 04 did not run it."""
        return (captures or {}).get(level) or ProfileCapture()


class ProfileCaptures(Record):
    """data/profile_capture.json (04_profile): the levels 04 chose, why, and each level's capture."""

    levels: list[int]
    notes: list[str] = Field(default_factory=list)
    captures: list[ProfileCapture] = Field(default_factory=list)


__all__ = ["AttributionRow", "Bottleneck", "BreakdownRow", "CallsWithWait", "CollectivesFit", "CollectiveWaitRow",
           "CurveRow", "ExpectedVsObservedRow", "Finding", "FINDING_TOPICS", "frame", "HostOpRow", "HostOps",
           "LATENCY_FIT_COLUMNS", "LatencyFit", "LevelReconcileRow", "ProfileCapture", "ProfileCaptures",
           "ProfileSummary", "ProjectionRow", "read_record", "ReconcileRow", "RecordError", "ReplayRow", "RoleCpu",
           "ScheduleRow", "ServingHeadline", "StepCategoryRow", "StepMedians", "TopUnknownRow", "VariantRow", "Verdict",
           "write_record"]
