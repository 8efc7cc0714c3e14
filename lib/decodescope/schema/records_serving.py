"""Rows of 01_serving's tables: data/serving_levels.parquet (one concurrency level of the sweep) and
data/telemetry/level_<c>.parquet (one sample of one metric), each table's columns declared once beside its
model. decodescope.schema.records says how records are versioned, read and written."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from decodescope.schema.recordbase import _Model, columns_of


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
    tpot_unstalled_p50_us: Optional[float] = Field(None, description="the TPOT p50 with an engine stall's gap "
                                                   "counted as one median gap in the streams it held "
                                                   "(serving.metrics.unstalled_tpot_us); tpot_p50_us without one")
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
