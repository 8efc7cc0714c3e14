"""Typed records: one pydantic model per JSON file a phase writes, used by the writer and every reader.

Each file record carries `schema_version` (an int, the field's default here is the version this code
writes and reads). `read_record(path, Model)` refuses a file of another version, or one that does not
validate, with a `RecordError` that names the file, the version found and the one expected (and the
fields at fault); `write_record(path, record)` writes atomically (`decodescope.core.io.write_json_atomic`).
Bump a record's `schema_version` default whenever its fields change meaning or shape.

Rows of parquet tables are models too (without a version: a table keeps its columns); their columns
are declared once, next to the model, as `*_COLUMNS = columns_of(Model)`.

| file                         | record           | written by                          |
|------------------------------|------------------|-------------------------------------|
| manifest.json                | RunManifest      | runmanifest.Manifest                |
| data/host.json               | HostInventory    | hardware.inventory (00_host)        |
| data/collectives_fit.json    | CollectivesFit   | microbench.save_collectives (03)    |
| data/profile_summary.json    | ProfileSummary   | trace.profile.write_profile (04; records_profile) |
| data/verdict.json            | Verdict          | verdict.verdict (05_verdict)        |
| data/profile_capture.json    | ProfileCaptures  | trace.capture (04)                  |
| data/profile/host_ops.json   | HostOps          | trace.hostops.host_op_costs (04; records_profile) |
| data/profile/c<N>/critical_path.json | CriticalPathSummary | trace.critpath_record (04; records_critpath) |
| data/server.json             | ServerInfo       | runserver.write_server_info (records_server) |
| data/link.json               | LinkMeasure      | runserver.write_server_info (records_server) |
| data/gemm_raw.json           | ProbeOutput      | probes.gemm (02; records_probe)     |
| data/*_ranks/*_rank<r>.json  | ProbeOutput      | probes.collectives, probes.step (03; records_probe) |
| data/serving_levels.parquet  | ServingLevel row | serving.metrics.level_summary (01)  |
| data/telemetry/level_*.parquet | TelemetrySample row | serving.telemetry (01)          |
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field

from decodescope.schema.recordbase import Record, _Model, _OpenModel, columns_of
# re-exported (__all__): the phases, the report and the tests name every record as records'
from decodescope.schema.recordbase import RecordError, frame, read_record, write_record
from decodescope.schema.records_profile import (BreakdownRow, CallsWithWait, CollectiveWaitRow, ExpectedVsObservedRow,
                                                HostOpRow, HostOps, ScheduleRow, StepCategoryRow, StepMedians,
                                                TopUnknownRow)
from decodescope.schema.records_verdict import (FINDING_TOPICS, AttributionRow, Bottleneck, CurveRow, Finding,
                                                LevelReconcileRow, ProjectionRow, ReconcileRow, ReplayRow,
                                                ServingHeadline, VariantRow, Verdict)


# ---- peaks -----------------------------------------------------------------------------------------
class Peaks(Record):
    """Peak rates a measurement is set against: a GPU's datasheet (dense math), params overrides, or
    a CPU matmul measured on the host. None where unknown."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="the device the peaks are for")
    bf16_tflops: Optional[float] = Field(None, description="dense BF16/FP16 TFLOP/s")
    fp8_tflops: Optional[float] = Field(None, description="dense FP8 TFLOP/s")
    fp32_tflops: Optional[float] = Field(None, description="FP32 TFLOP/s (given, or measured on CPU hosts); no fp32 roofline without it")
    int4_tflops: Optional[float] = Field(None, description="INT4 TOP/s, from params overrides only")
    mem_gbps: Optional[float] = Field(None, description="memory bandwidth, GB/s")
    link_gbps: Optional[float] = Field(None, description="GPU-to-GPU bandwidth, one direction, GB/s")
    link: Optional[str] = Field(None, description="what link_gbps is")
    source: str = Field("vendor datasheet, dense", description="where these figures come from")

    def display(self) -> dict:
        """The peaks as one table row: no version, and the FP32/INT4 columns only where known."""
        unknown = {k for k in ("fp32_tflops", "int4_tflops") if getattr(self, k) is None}
        return self.model_dump(exclude={"schema_version"} | unknown)


# ---- host inventory (data/host.json) ---------------------------------------------------------------
class GpuInfo(_Model):
    index: int
    name: str
    memory_mib: Optional[float] = None
    max_sm_clock_mhz: Optional[float] = None
    max_mem_clock_mhz: Optional[float] = None
    driver: str
    pci_bus_id: str


class TopologyPair(_Model):
    """One ordered GPU pair of `nvidia-smi topo -m`."""

    gpu_a: int
    gpu_b: int
    code: str = Field(description="the matrix cell: NV<n>, PIX, PXB, PHB, NODE, SYS, X")
    link_class: str = Field(description="nvlink, pcie_switch, host_bridge, cross_socket, self or unknown")
    nvlinks: int = Field(description="NVLink links between the pair (0 if not NVLink)")


TOPOLOGY_PAIR_COLUMNS = columns_of(TopologyPair)


class CpuInfo(_Model):
    model: str
    logical_cores: Optional[int] = None
    physical_cores: Optional[int] = None
    numa_nodes: int
    memory_gib: float
    avx2: bool
    avx512f: bool
    amx: bool
    kernel: str
    hostname: str


class EngineAllReduce(_Model):
    """Which all-reduce path the host's vLLM takes at tensor parallelism > 1, found as vLLM finds it
    (decodescope.exec.engine_comm): on CPUs the kernel library it loads and whether that has the shared-memory
    all-reduce; on GPUs the device communicators it may pick."""

    vllm: Optional[str] = Field(None, description="vLLM's version; None where vLLM is not installed")
    platform: str = Field(description="cpu or gpu")
    cpu_extension: Optional[str] = Field(None, description="_C, _C_AVX512 or _C_AVX2: the kernel library vLLM CPU loads")
    path: str = Field(description="shm, gloo (vLLM CPU), gpu (vLLM's device communicators), none (no vLLM)")
    communicator: Optional[str] = Field(None, description="the micro-benchmark's name for it: vllm_shm, torch_gloo")
    gpu_communicators: list[str] = Field(default_factory=list, description="on GPUs: the communicators vLLM may pick")
    forced: Optional[str] = Field(None, description="'avx2' when DECODESCOPE_CPU_PATH forced vLLM CPU's AVX2 path")
    why: str = ""


class CpuMatmul(_Model):
    """A CPU matmul measurement: the stand-in roofline of a host without GPUs."""

    n: int
    dtype: str
    threads: int
    reps: int
    best_us: float
    gflops: float
    method: str


class HostInventory(Record):
    """data/host.json (00_host): GPUs, their links, versions, CPU, and the peaks later phases use."""

    has_gpu: bool
    gpus: list[GpuInfo] = Field(default_factory=list)
    topology_text: Optional[str] = Field(None, description="`nvidia-smi topo -m` as printed")
    topology_pairs: list[TopologyPair] = Field(default_factory=list)
    interconnect: Optional[str] = Field(None, description="nvlink, pcie, mixed or single; None without GPUs")
    versions: dict[str, Any] = Field(default_factory=dict, description="package, CUDA, NCCL, python versions")
    cpu: CpuInfo
    peaks: Optional[Peaks] = None
    cpu_matmul: Optional[list[CpuMatmul]] = Field(None, description="measured on hosts without GPUs")
    engine_allreduce: Optional[EngineAllReduce] = Field(
        None, description="which all-reduce path the host's vLLM takes (None in host.json written before 00 recorded it)")


# ---- serving levels (a row of data/serving_levels.parquet) -----------------------------------------
class ServingLevel(_Model):
    """One concurrency level of the serving sweep (one repeat of it, when levels are repeated), as
    `vllm bench serve` defines its metrics. The repeat, the SLO's goodput and the client-health fields
    are columns only when they were measured."""

    level: int = Field(description="concurrency: requests in flight at most")
    repeat: Optional[int] = Field(
        None, description="which measurement of this level the row is (1, 2, ...) when workload.repeats > 1: "
                          "serving_levels_repeats.parquet has one row per (level, repeat), serving_requests."
                          "parquet a `repeat` column; absent when each level is measured once")
    repeats: Optional[int] = Field(None, description="in serving_levels.parquet with repeats: how many; every "
                                   "number is then the median over them (requests, ok, failed: the sums)")
    requests: int
    ok: int
    failed: int
    duration_s: float
    request_throughput_rps: float
    output_throughput_tok_s: float
    total_throughput_tok_s: float
    ttft_mean_us: float
    ttft_p50_us: float
    ttft_p90_us: float
    ttft_p99_us: float
    tpot_mean_us: float
    tpot_p50_us: float
    tpot_p90_us: float
    tpot_p99_us: float
    itl_mean_us: float
    itl_p50_us: float
    itl_p90_us: float
    itl_p99_us: float
    e2e_mean_us: float
    e2e_p50_us: float
    e2e_p90_us: float
    e2e_p99_us: float
    itl_coalesced_frac: float = Field(description="share of inter-chunk gaps under COALESCED_GAP_US")
    failure_reasons: str = Field(description="'class: count; ...' of the failed requests")
    littles_lw: float = Field(description="request throughput x mean E2E over the level's span")
    goodput_rps: Optional[float] = Field(None, description="requests within every SLO, per second")
    loop_lag_p50_ms: Optional[float] = None
    loop_lag_p99_ms: Optional[float] = None
    loop_lag_max_ms: Optional[float] = None
    client_cpu_pct: Optional[float] = None
    # the name is kept for run directories written before: the count is now integrated at every change
    inflight_sampled_mean: Optional[float] = Field(None, description="L: mean in-flight count over the level")
    littles_error_pct: Optional[float] = None
    client_suspect: Optional[bool] = Field(None, description="the client's loop lag or CPU may have distorted it")
    engine_silence_ms: Optional[float] = Field(None, description="longest time every streaming request was silent "
                                               "at once (serving.metrics.engine_silence_ms)")
    engine_stall_ms: Optional[float] = Field(None, description="engine_silence_ms when it counts as a stall of the "
                                             "engine (serving.metrics.is_engine_stall), not its decode speed")
    # Server and GPU telemetry over the level's measured requests (serving.telemetry); columns only when
    # telemetry ran, NaN where the server or the host did not report the figure.
    telemetry_scrapes: Optional[int] = Field(None, description="/metrics samples taken during the level")
    telemetry_scrape_failures: Optional[int] = Field(None, description="of which failed (recorded, not raised)")
    server_running_mean: Optional[float] = Field(None, description="vllm:num_requests_running, mean of samples")
    server_running_max: Optional[float] = None
    server_waiting_mean: Optional[float] = Field(None, description="vllm:num_requests_waiting, mean of samples")
    server_waiting_max: Optional[float] = None
    server_kv_usage_max_pct: Optional[float] = Field(None, description="vllm:kv_cache_usage_perc x 100, max")
    server_preemptions: Optional[float] = Field(None, description="vllm:num_preemptions_total over the level")
    server_ttft_mean_us: Optional[float] = Field(None, description="engine's TTFT histogram: delta sum / delta count")
    server_tpot_mean_us: Optional[float] = Field(None, description="engine's per-request TPOT histogram mean")
    server_itl_mean_us: Optional[float] = Field(None, description="engine's inter-token latency histogram mean")
    server_e2e_mean_us: Optional[float] = None
    server_queue_mean_us: Optional[float] = Field(None, description="time requests waited in the engine's queue")
    server_spec_acceptance_pct: Optional[float] = Field(None, description="accepted / draft tokens (spec decode)")
    server_spec_accept_len: Optional[float] = Field(None, description="1 + accepted tokens per draft")
    server_spec_accepted_per_pos: Optional[str] = Field(None, description="accepted at each draft position / "
                                                        "drafts, comma-separated in position order")
    server_api_cpu_pct: Optional[float] = Field(None, description="API server process CPU (process_cpu_seconds_total)")
    gpu_power_mean_w: Optional[float] = Field(None, description="NVML, per GPU, mean over GPUs and samples")
    gpu_power_max_w: Optional[float] = None
    gpu_sm_clock_mean_mhz: Optional[float] = None
    gpu_sm_clock_min_mhz: Optional[float] = None
    gpu_util_mean_pct: Optional[float] = None
    gpu_mem_used_max_mib: Optional[float] = None
    gpu_temp_max_c: Optional[float] = None
    gpu_throttle_reasons: Optional[str] = Field(None, description="NVML clock event reasons seen, by name")

    # with repeats (serving_levels.parquet): the 95% band of the median over the repeats (decodescope.core.stats)
    tpot_p50_us_low: Optional[float] = None
    tpot_p50_us_high: Optional[float] = None
    ttft_p50_us_low: Optional[float] = None
    ttft_p50_us_high: Optional[float] = None
    itl_p50_us_low: Optional[float] = None
    itl_p50_us_high: Optional[float] = None
    e2e_p50_us_low: Optional[float] = None
    e2e_p50_us_high: Optional[float] = None
    output_throughput_tok_s_low: Optional[float] = None
    output_throughput_tok_s_high: Optional[float] = None

    def to_row(self) -> dict:
        """The row for the table: the measured fields, in column order."""
        return self.model_dump(exclude_unset=True)


SERVING_LEVEL_COLUMNS = columns_of(ServingLevel)


class TelemetrySample(_Model):
    """A row of data/telemetry/level_<c>.parquet (serving.telemetry): one sample of one metric."""

    level: int = Field(description="concurrency level the sample was taken during")
    scrape: int = Field(description="the sample's number within the level (one per interval)")
    t_s: float = Field(description="CLOCK_MONOTONIC seconds, the clock of the request records' *_ns")
    source: str = Field(description="server (/metrics), gpu (NVML) or telemetry (the sampler's own rows)")
    metric: str = Field(description="sample name as exposed (vllm:num_requests_running, ..._sum) or GPU field")
    labels: str = Field(description="the sample's labels as JSON with sorted keys")
    value: float


TELEMETRY_COLUMNS = columns_of(TelemetrySample)


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


# ---- run manifest (manifest.json) ------------------------------------------------------------------
class _ManifestPart(_OpenModel):
    """A part of manifest.json, which the runner sets field by field: each value is checked as it is set."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=True)


class PhaseEntry(_ManifestPart):
    status: str = Field("pending", description="pending, running, ok, failed or skipped")
    start: Optional[str] = None
    end: Optional[str] = None
    error: Optional[str] = None
    duration_s: Optional[float] = None
    notebook: Optional[str] = Field(None, description="the executed notebook, relative to the run directory")
    stray_processes_stopped: Optional[int] = None


class ManifestHost(_ManifestPart):
    kind: Optional[str] = Field(None, description="params `host`")
    model: Optional[str] = Field(None, description="CPU model")
    logical_cores: Optional[int] = None
    memory_gib: Optional[float] = None
    hostname: Optional[str] = None


class ServerState(_ManifestPart):
    status: Optional[str] = None
    error: Optional[str] = None
    base_url: Optional[str] = None
    start_s: Optional[float] = None
    pids: Optional[list[int]] = None
    profiler_dir: Optional[str] = None
    launch: Any = None
    stopped: Optional[str] = None


class ServerLaunch(_ManifestPart):
    started: Optional[str] = None
    start_s: Optional[float] = None
    pids: Optional[list[int]] = None
    pgid: Optional[int] = None
    run_token: Optional[str] = None
    shm_files: Optional[list[str]] = None


class Teardown(_ManifestPart):
    at: Optional[str] = None
    signalled: Optional[int] = None
    shm_removed: Optional[int] = None
    left: Any = None


class VariantEntry(_ManifestPart):
    """One variant of params.experiments as the runner measured it (variants/<name>/)."""

    status: str = Field("pending", description="pending, running, ok or failed")
    start: Optional[str] = None
    end: Optional[str] = None
    duration_s: Optional[float] = None
    error: Optional[str] = Field(None, description="why it failed: the server's log tail, or each phase's error")
    params: dict[str, Any] = Field(default_factory=dict, description="the variant as params.experiments gives it")
    stray_processes_stopped: Optional[int] = None


class ParamsChange(_ManifestPart):
    """A --resume with other params: when, the keys ('key: before -> after'), the earlier params.yaml kept as."""
    resumed: str
    changed: list[str]
    before: str


class RunManifest(Record):
    """manifest.json: the run's params (secrets redacted), versions, host and each phase's status.
    The runner sets fields as the run goes (each checked as it is set); the file holds exactly the fields
    set (none filled in)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    run_id: str
    params_name: str
    params_path: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)
    git_commit: Optional[str] = None
    versions: dict[str, Any] = Field(default_factory=dict)
    host: Optional[ManifestHost] = None
    created: str
    status: str = Field(description="running, ok, failed or interrupted")
    phases: dict[str, PhaseEntry] = Field(default_factory=dict)
    resumed: list[str] = Field(default_factory=list, description="when the run was resumed")
    params_changes: list[ParamsChange] = Field(default_factory=list, description="other params on a --resume")
    server: Optional[ServerState] = None
    servers: list[ServerLaunch] = Field(default_factory=list, description="every server this run started")
    teardowns: list[Teardown] = Field(default_factory=list)
    variants: dict[str, VariantEntry] = Field(default_factory=dict, description="params.experiments, measured")
    overrides: dict[str, Any] = Field(default_factory=dict, description="params keys the command line replaced "
                                      "(e.g. workload.repeats from --repeats); --resume applies them again")
    stray_processes_stopped: Optional[int] = None
    error: Optional[str] = None
    finished: Optional[str] = None
    report: Optional[str] = Field(None, description="report.html, relative to the run directory")

    def to_json_dict(self) -> dict:
        return {"schema_version": self.schema_version, **self.model_dump(by_alias=True, exclude_unset=True)}


__all__ = ["AttributionRow", "Bottleneck", "BreakdownRow", "CallsWithWait", "CollectivesFit", "CollectiveWaitRow",
           "CpuInfo", "CpuMatmul", "CurveRow", "EngineAllReduce", "ExpectedVsObservedRow", "Finding",
           "FINDING_TOPICS", "frame", "GpuInfo", "HostInventory", "HostOpRow", "HostOps", "LATENCY_FIT_COLUMNS",
           "LatencyFit", "LevelReconcileRow", "ManifestHost", "ParamsChange", "Peaks", "PhaseEntry", "ProfileCapture",
           "ProfileCaptures", "ProfileSummary", "ProjectionRow", "read_record", "ReconcileRow", "RecordError",
           "ReplayRow", "RoleCpu", "RunManifest", "ScheduleRow", "ServerLaunch", "ServerState",
           "SERVING_LEVEL_COLUMNS", "ServingHeadline", "ServingLevel", "StepCategoryRow", "StepMedians", "Teardown",
           "TELEMETRY_COLUMNS", "TelemetrySample", "TOPOLOGY_PAIR_COLUMNS", "TopologyPair", "TopUnknownRow",
           "VariantEntry", "VariantRow", "Verdict", "write_record"]
