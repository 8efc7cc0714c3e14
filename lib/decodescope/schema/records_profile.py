"""Rows of data/profile_summary.json's tables (decodescope.schema.records.ProfileSummary): each list field is
a trace.analyze table written with DataFrame.to_dict("records"), so a model declares that table's columns in
its order (the file's keys keep it) and with the types the table holds. decodescope.schema.records says how
records are versioned, read and written."""
from __future__ import annotations

from typing import Optional, Union

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model


class ExpectedVsObservedRow(_Model):
    """profile_summary.json expected_vs_observed: one collective per rank (trace.analyze.expected_vs_observed)."""

    rank: int
    collective: str = Field(description="all_reduce or all_gather")
    expected_per_step: Optional[int] = Field(description="calls per step the architecture issues; None without "
                                             "a model config")
    observed_per_step: float = Field(description="calls per step in the trace, summed over the collective's categories")
    time_per_step_us: float
    matches: bool = Field(description="observed_per_step == expected_per_step")


class StepCategoryRow(_Model):
    """profile_summary.json per_step_categories: one category per rank over the steps of step_kind
    (trace.analyze.calls_per_step)."""

    rank: int
    category: str
    calls_per_step: float = Field(description="median over the steps")
    # an int while every step has a call of the category; a float once a step without one counts 0 (the
    # table's column turns float): the file keeps whichever the table held
    calls_min: Union[int, float]
    calls_max: Union[int, float]
    time_per_step_us: float = Field(description="median over the steps")
    steps: int = Field(description="steps the medians are over")


class BreakdownRow(_Model):
    """profile_summary.json breakdown: one category per rank, whole capture (trace.analyze.category_breakdown)."""

    rank: int
    category: str
    time_us: float
    calls: int
    share: float = Field(description="of the rank's time")
    mean_us: float = Field(description="per call (inf or NaN where no call is counted)")


class TopUnknownRow(_Model):
    """profile_summary.json top_unknown: one op name left in `other`, all ranks (trace.analyze.unknown_ops)."""

    name: str
    category: str
    time_us: float
    calls: int
    ranks: int = Field(description="ranks it ran on")
    mean_us: float
    share: float = Field(description="of the time in `other`")


class CollectiveWaitRow(_Model):
    """profile_summary.json collective_wait: one collective category per rank (trace.analyze.skew_summary)."""

    rank: int
    category: str
    instances: int = Field(description="calls matched on every rank")
    time_us: float
    transfer_us: float = Field(description="each instance's least time over the ranks, summed")
    wait_us: float = Field(description="time_us - transfer_us: waiting for the last rank")
    wait_share: float = Field(description="wait_us / time_us (NaN where time_us is 0)")


class ScheduleRow(_Model):
    """profile_summary.json schedule: one collective of a decode step (model.arch.collective_schedule)."""

    op: str = Field(description="all_reduce, all_gather or gather")
    where: str = Field(description="embedding, attention_out, mlp_out, moe_out or logits")
    count: int = Field(description="calls per decode step")
    msg_bytes: int = Field(description="per-rank input bytes of one call")
    dtype: str


class CallsWithWait(_Model):
    """The all-reduce calls of the profiled steps where the wait is an op of its own, each call its op
    plus its wait at its least time over the ranks: a typical call (median), the mean call (every call a
    preempted thread stretched, on both ranks, included) and how many a step makes."""

    median_us: float
    mean_us: float
    p90_us: float
    calls_per_step: float
    calls: int = Field(description="calls the figures come from")


class StepMedians(_Model):
    """Medians over the profiled steps of one kind; None when no step was found."""

    summed_us_median: Optional[float] = None
    busy_us_median: Optional[float] = None
    wall_us_median: Optional[float] = None
    idle_us_median: Optional[float] = None
    period_us_median: Optional[float] = Field(None, description="start of one step to the start of the next: "
                                              "the step plus the host/scheduler time between steps")
    period_us_trimmed_mean: Optional[float] = Field(None, description="the same period's mean without its slowest "
                                                    "and fastest 2% (trace.profile.PERIOD_TRIM): what a stream pays per "
                                                    "token (TPOT is a request's mean gap), the profiler's own start, "
                                                    "stop and flush steps left out")
    between_steps_us_median: Optional[float] = Field(None, description="end of one step to the start of the next")
    batch_median: Optional[float] = Field(None, description="sequences decoded per step (the trace's step names)")
    host_between_steps_us_median: Optional[float] = Field(None, description="on the host's thread: end of one step's "
                                                          "execute range to the start of the next (scheduling, output "
                                                          "processing), which async scheduling overlaps with the GPU")

    @property
    def period_us(self) -> Optional[float]:
        """The step's period as a stream pays it: the trimmed mean, else (older summaries) the median
        period, else the median wall time."""
        return self.period_us_trimmed_mean or self.period_us_median or self.wall_us_median


class HostOpRow(_Model):
    """data/profile/host_ops.json ops: one custom op (`vllm::*`, outermost on its thread) in the un-graphed step
    (trace.hostops.host_op_costs)."""

    name: str
    calls_per_step: int = Field(description="calls in the un-graphed step: one forward of the model")
    host_us_per_call: float = Field(description="median wall time less waits: the host's own cost, under the profiler")
    wait_us_per_call: float = Field(description="median time its synchronizing CUDA calls waited for the GPU")
    events_per_call: float = Field(description="median host events the profiler recorded inside it")
    launches_per_call: float = Field(description="median kernel (or graph) launches inside it")


class HostOps(Record):
    """data/profile/host_ops.json (04_profile): one request past the largest CUDA graph, profiled
    (profiling.capture.capture_host_ops), and the host's cost of each op graphs hide, from its prefill step."""

    schema_version: int = 1
    prompt_tokens: int = Field(0, description="the request's prompt (profile.host_ops_tokens, capped)")
    step_tokens: int = Field(0, description="tokens of the step the ops were priced in (the longest prefill step)")
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_events_per_step: Optional[float] = Field(None, description="host events recorded per decode step "
                                                    "(start to start): what the profiler's cost per step is spread over")
    ops: list[HostOpRow] = Field(default_factory=list)
