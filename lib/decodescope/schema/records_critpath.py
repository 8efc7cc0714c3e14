"""data/profile/c<N>/critical_path.json (04): the wall-clock decode step attributed by its critical path
across lanes and ranks (decodescope.critpath.summary), beside the summed shares; the collectives'
waits named by the rank and work waited for; and what a fix of each category could buy at most.
decodescope.schema.records says how records are versioned, read and written."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model

CRITICAL_PATH_RECORD = "critical_path.json"


class CritPathShareRow(_Model):
    """One category: its share of the wall step on the critical path beside its summed share of op time
    (critpath.summary.attribution)."""

    category: str = Field(description="the op's category, or a gap on the path: host, launch, idle")
    path_share_median: float = Field(description="of the wall step, median over the steps")
    path_share_p10: float
    path_share_p90: float
    path_us_median: float = Field(description="its time on the path per step, median")
    summed_share_median: float = Field(description="its summed op time (all ranks) over all op time, median")


class CritPathWaitRow(_Model):
    """One collective category and the rank it waited for (critpath.summary.collective_waits)."""

    category: str
    late_rank: int = Field(description="the rank that entered last: the one waited for")
    late_work: str = Field(description="the category that rank ran just before it entered")
    wait_us_per_step: float = Field(description="summed over the waiting ranks, median over the steps")
    instances: int


class CritPathBoundRow(_Model):
    """One category's fix at its most (critpath.summary.fix_bounds): the step replayed on the
    trace's own dependencies with that category's pieces `speedup` times faster (inf: free)."""

    category: str = Field(description="what the fix frees: a category; '<collective> transfer' (its instances' "
                          "transfer, waits included); '<class> (all)'; 'host'; 'arrival skew'")
    kind: str = Field("category", description="category | transfer | class | host | skew")
    wall_us_median: float = Field(description="the replayed steps' measured wall time, median")
    bound_wall_us_median: float = Field(description="their wall time with the category sped up, median")
    gain_share_median: float = Field(description="1 - bound / wall per step, median: the most the fix buys")
    steps: int = Field(description="steps replayed")
    speedup: float = Field(description="inf: the category free")


class CritPathSplitRow(_Model):
    """One collective category: its instances split into arrival skew and transfer
    (critpath.split.split_summary), per step, medians over the steps."""

    category: str = Field(description="the instance's category (its entering ops'; a wait counts as its collective)")
    instances_per_step: float
    skew_us_per_step: float = Field(description="summed over the step's instances: last entry - first entry")
    transfer_us_per_step: float = Field(description="summed over the step's instances: end - last entry")
    waited_us_per_step: float = Field(description="the ranks' summed time blocked before the last entry")
    skew_on_path_us_per_step: float = Field(description="the skew of instances whose transfer is on the path")
    transfer_on_path_us_per_step: float = Field(description="the transfer segments on the path")
    share_skew_bound: float = Field(description="share of instances whose skew is >= 2x their transfer")
    share_transfer_bound: float = Field(description="share of instances whose transfer is >= 2x their skew")
    share_mixed: float
    share_inconclusive: float = Field(description="skew + transfer under 2 us")


class CriticalPathSummary(Record):
    """data/profile/c<N>/critical_path.json: one profiled level's critical paths, summarised."""

    concurrency: Optional[int] = Field(None, description="the profiled level")
    device: str
    ranks: list[int]
    step_kind: str = Field(description="the steps summarised: decode where found, else all")
    steps: int
    wall_us_median: Optional[float] = Field(None, description="the steps' wall time, first rank's start to the "
                                            "last rank's end; None without steps")
    shares: list[CritPathShareRow] = Field(default_factory=list)
    collective_waits: list[CritPathWaitRow] = Field(default_factory=list)
    fix_bounds: list[CritPathBoundRow] = Field(default_factory=list)
    collective_split: list[CritPathSplitRow] = Field(default_factory=list)


class CritPathFixRow(_Model):
    """data/verdict.json critical_path: a fix's bound on the critical path beside the step model's
    projection of a fix of the same categories (decodescope.verdict.pathanswer)."""

    concurrency: Optional[int] = Field(None, description="the profiled level the bound was measured at")
    bound: str = Field(description="the bound's name: '<category> free'")
    bound_gain_pct: float = Field(description="the most the fix buys: wall step saved, %, median over the steps")
    bound_wall_us: float = Field(description="the step's wall time with the category free, median")
    wall_us: float = Field(description="the replayed steps' measured wall time, median")
    fix: Optional[str] = Field(None, description="the step model's projection of a fix of this category, if any")
    projected_gain_pct: Optional[float] = Field(None, description="its TPOT saved, % (positive = faster)")
    projection_batch: Optional[float] = Field(None, description="the batch the projection is priced at")
    exceeds_bound: Optional[bool] = Field(None, description="the projection saves more than the path allows")


SKEW_CALIBRATION_RECORD = "skew_calibration.json"


class SkewCalibrationRow(_Model):
    """One delay setting: 03's step replay with one rank late by a known delay before every collective, its
    profile read back through the critical path (micro.skewcal.SkewSetting)."""

    cpu_path: str = Field(description="native, avx2, or the device (gpu) the replay ran on")
    communicator: str = Field(description="the replay's communicator: vllm_shm, torch_gloo, torch_nccl")
    injected_us: float = Field(description="the delay asked for, D")
    skew_rank: int = Field(description="the rank made late")
    instances: int = Field(description="collective instances every rank has, over the profiled steps")
    late_rank_share: float = Field(description="of the instances, the share naming skew_rank late (NaN at D = 0)")
    skew_us_median: float = Field(description="the attributed arrival skew (last entry - first entry), median")
    skew_us_p10: float
    skew_us_p90: float
    error_us: float = Field(description="attributed median - injected")
    delivered_us: float = Field(description="the delay the rank ran: its spin's median range in the trace "
                                "(injected where nothing ran)")
    delivered_error_us: float = Field(description="attributed median - delivered")
    recovered: bool = Field(description="delivered_error_us within 10% of delivered_us or 20 us")
    raw_skew_us_median: float = Field(description="the late rank's entry minus the others' last, off the ops "
                                      "without the critical path, median")
    raw_abs_skew_us_median: float = Field(float("nan"), description="last entry - first over every rank, off the "
                                          "ops without the critical path (two ranks: |raw entry skew|), median: "
                                          "what the attributed median must equal")
    spin_us_median: float = Field(description="the injected range's own duration, median (0 at D = 0)")
    transfer_us_median: float = Field(description="last entry to end, median")


class SkewCalibration(Record):
    """data/skew_calibration.json (03_collectives): how far this host's critical path recovers a known
    arrival skew (micro.skewcal.replay_and_calibrate_for_phase); the report's methods section shows it."""

    world: int = Field(description="the replay's ranks (the tensor-parallel size)")
    steps: int = Field(description="steps profiled per setting")
    ran: bool = Field(description="False where nothing could be skewed (one rank) or no delay was asked")
    why_not: str = Field("", description="why it did not run")
    settings: list[SkewCalibrationRow] = Field(default_factory=list, description="one row per delay, in order")
