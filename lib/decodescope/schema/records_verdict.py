"""The verdict's record (data/verdict.json, 05_verdict) and its rows: attribution, reconciliation, projections,
curves, levels, replay, variants, findings (decodescope.schema.records re-exports them)."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from decodescope.schema.recordbase import Record, _Model
from decodescope.schema.records_critpath import CritPathFixRow


# ---- verdict (data/verdict.json) -------------------------------------------------------------------
class AttributionRow(_Model):
    rank: int
    cls: str = Field(description="verdict class (communication, gemm, attention, ...)")
    time_per_step_us: float = Field(description="median time per decode step")
    share: float = Field(description="share of the rank's summed time per step")


class Bottleneck(_Model):
    """What holds a decode step: from its critical path where 04 walked one (basis "critical path": the
    category with the largest share of the wall step at the lowest profiled level), else from summed op
    time (basis "summed op time": the class with the largest share on the median rank)."""

    cls: str = Field(alias="class", description="the verdict class (a path gap: host, launch, idle)")
    share: float = Field(description="of the wall step on the path (median over steps), or of summed op time")
    basis: str = Field("summed op time", description="critical path | summed op time")
    category: Optional[str] = Field(None, description="the category on the path (basis critical path)")
    share_p10: Optional[float] = None
    share_p90: Optional[float] = None
    level: Optional[int] = Field(None, description="the profiled concurrency the path share is read at")
    wall_us: Optional[float] = Field(None, description="that level's wall step, median")
    summed_share: Optional[float] = Field(None, description="the category's summed share of op time, beside it")
    summed_cls: Optional[str] = Field(None, description="the class summed op time puts first")
    summed_cls_share: Optional[float] = None


class ReconcileRow(_Model):
    piece: str
    micro_benchmark_us: Optional[float] = Field(None, description="None when nothing like for like was measured")
    micro_source: str
    profile_us: Optional[float] = None
    profile_source: str
    profile_over_micro: Optional[float] = None
    note: str = Field("", description="which communicator was compared, or why a row is not compared")


class ServingHeadline(_Model):
    lowest_level: int
    tpot_p50_us: float
    max_output_tok_s: float
    source: str


class ProjectionRow(_Model):
    """One fix priced by the step model, calibrated by the measured TPOT (decodescope.verdict.fixes)."""

    fix: str
    step_us: float
    low_us: float
    high_us: float
    tokens_per_step: float
    tpot_us: float
    tpot_low_us: float
    tpot_high_us: float
    gain_pct: float = Field(description="projected TPOT change against the measured step, % (negative = faster)")
    assumptions: str
    batch: Optional[float] = Field(None, description="the batch (serving level) the projection is priced at")
    tok_s_per_gpu: Optional[float] = Field(None, description="output tokens/s per GPU at that batch")
    gpus_per_replica: Optional[int] = None
    status: str = Field("priced", description="priced (every input measured) | measured (a drafter a variant ran) | "
                        "break-even (an input assumed: not ranked, stated as the condition under which it pays off)")
    rank: Optional[int] = Field(None, description="1 = the best projected TPOT among the ranked; None: break-even")
    condition: str = Field("", description="break-even: when the fix would pay off, from the measured verify step")
    bound: Optional[str] = Field(None, description="the critical path's bound of what this fix frees")
    bound_gain_pct: Optional[float] = Field(None, description="the most that bound buys: wall step saved, %")
    beyond_bound: Optional[bool] = Field(None, description="the projection saves more than its bound allows")


class CurveRow(_Model):
    """One point of a TPOT vs output-tokens/s-per-GPU curve: the measured sweep, the step model, or a fix."""

    fix: str = Field(description="'measured (01)', 'step model' or the fix's name")
    batch: float
    tpot_us: float
    tpot_low_us: float
    tpot_high_us: float
    tok_s_per_gpu: float
    model_us: Optional[float] = Field(None, description="the step model's period for this curve at this batch")
    calibrated: bool = Field(False, description="scaled by measured TPOT / base model at this batch")
    notes: str = ""


class LevelReconcileRow(_Model):
    """One serving level: the client's TPOT against the profiled step and the step model."""

    level: int
    tpot_p50_us: float = Field(description="client TPOT p50 (01)")
    reference_tpot_us: Optional[float] = Field(None, description="the TPOT the step is set against: the client's "
                                               "p50, or the engine's own (vllm metrics) when delivery coalesced")
    reference: str = Field("", description="which TPOT that is, and why")
    profile_batch: Optional[int] = Field(None, description="the profiled batch nearest this level (04)")
    profile_wall_us: Optional[float] = Field(None, description="median wall-clock decode step there (04)")
    model_us: Optional[float] = Field(None, description="the step model's period (step + time between steps) at "
                                      "this batch: GEMMs (02), collectives (03), the rest from 04 (stepmodel)")
    model_low_us: Optional[float] = None
    model_high_us: Optional[float] = None
    model_error: Optional[float] = Field(None, description="model / client TPOT - 1")
    profile_period_us: Optional[float] = Field(None, description="median step start-to-start at the nearest profiled level")
    residual_us: Optional[float] = Field(None, description="TPOT - profiled step")
    within_tolerance: Optional[bool] = None
    attributed_to: str = Field("", description="what the residual is put down to, from the measurements")
    engine_itl_us: Optional[float] = Field(None, description="the engine's mean inter-token latency during this "
                                           "level (vllm metrics, 01's telemetry)")
    profile_engine_itl_us: Optional[float] = Field(None, description="the same, over 04's unprofiled runs of the "
                                                   "profile workload at this concurrency (04's server)")
    host_drift: Optional[float] = Field(None, description="profile_engine_itl_us / engine_itl_us - 1: how much the "
                                        "host's step changed between 01 and 04 (minutes later; on one server when they ran in one run)")
    model_error_same_server: Optional[float] = Field(None, description="model / profile_engine_itl_us - 1: the model "
                                                     "against the step measured where its 04 inputs were")
    window_noise: Optional[float] = Field(None, description="|a - b| / mean of the engine's inter-token latency over "
                                          "04's two unprofiled runs of the profile workload, a second apart on one "
                                          "server: how much the host's step moves between two windows; at least "
                                          "the profiled run's shortfall below them, where it was faster")
    tpot_first_quarter_us: Optional[float] = Field(None, description="median client TPOT of the level's first "
                                                   "quarter of timed requests, in the order sent (01)")
    tpot_last_quarter_us: Optional[float] = Field(None, description="the same, of its last quarter")
    in_level_drift: Optional[float] = Field(None, description="tpot_last_quarter_us / tpot_first_quarter_us - 1: "
                                            "how much the step moved while the level ran")
    model_miss: str = Field("", description="what the step model's error beyond 10% is put down to, from the "
                            "step's measured movement (decodescope.verdict.leveldrift); empty within 10%")


class ReplayRow(_Model):
    """The step replay (03) at one batch against the step model's GEMMs + collectives."""

    batch: int
    mode: str = Field(description="eager or cuda_graph")
    replay_us: float = Field(description="the replayed step, slowest rank's median (03, step_replay.parquet)")
    predicted_us: float = Field(description="GEMMs (02) + collectives (03, the replay's communicator)")
    low_us: float
    high_us: float
    error: float = Field(description="predicted / replayed - 1")
    communicator: str
    model: str = Field("serial", description="serial: GEMMs + collectives one after another; host_paced: "
                                              "the host issues each op at its measured cost and the GPU "
                                              "runs it once issued (an eager GPU step)")


class VariantRow(_Model):
    """One variant (params.experiments) at one serving level: measured against its projection."""

    variant: str
    status: str = Field(description="ok, failed or not run (the manifest's record of the variant)")
    error: str = ""
    level: Optional[int] = None
    tpot_p50_us: Optional[float] = Field(None, description="the variant's TPOT at this level (its 01): the client's "
                                         "p50, or the engine's own when delivery coalesced (see reference)")
    reference: str = ""
    baseline_tpot_p50_us: Optional[float] = None
    measured_gain_pct: Optional[float] = Field(None, description="variant / baseline TPOT - 1, %")
    tok_s_per_gpu: Optional[float] = None
    projection: str = Field("", description="the fix of the verdict that projects this variant ('' when none)")
    projected_tpot_us: Optional[float] = None
    projected_low_us: Optional[float] = None
    projected_high_us: Optional[float] = None
    projection_error_pct: Optional[float] = Field(None, description="projected / measured TPOT - 1, %")
    notes: str = ""
    gpu_host_split: str = Field("", description="where the TPOT went against the baseline's: the GPU's busy share "
                                "of the level (NVML) x TPOT, and the rest, the GPU waiting on the host")
    engine_modes: str = Field("", description="the variant's engine as its log states it: CUDA graphs, torch.compile")


# A finding's topic, spelled out for mypy (a Literal built from FINDING_TOPICS at runtime is no type to it);
# FINDING_TOPICS' annotation makes mypy reject a key that is not one of these.
FindingTopic = Literal["bottleneck", "consistency", "host", "measured", "fix", "no_help"]

# The verdict page's sections, in order: a finding's topic -> the heading the report gives it.
FINDING_TOPICS: dict[FindingTopic, str] = {
    "bottleneck": "Where the step goes", "consistency": "Do the measurements agree?",
    "host": "What the host itself costs the step",
    "measured": "Fixes measured as variants (ranked by measured gain)",
    "fix": "What would move it (projected, ranked)", "no_help": "What would not help"}


class Finding(_Model):
    """One sentence of the verdict page, with where it came from."""

    topic: FindingTopic = Field(description="the verdict page's section (FINDING_TOPICS)")
    text: str
    figure: Optional[str] = Field(None, description="the report's anchor id of the figure it reads")
    files: list[str] = Field(default_factory=list, description="run-directory paths of the files it reads")


class SpecKRow(_Model):
    """Speculative decoding at one k for a measured drafter, at one serving level (decodescope.verdict.speccurve)."""

    drafter: str
    level: int
    k: int
    projected_tpot_us: float
    measured_tpot_us: Optional[float] = Field(None, description="the variant that ran this k, where one did")
    drafter_us: float = Field(description="the drafter's time a verify step, measured in a profiled variant")
    tokens_per_verify: float = Field(description="from the measured acceptance per position")
    acceptance_from: str = Field(description="the variant whose acceptance per position it used")
    drafter_from: str
    variant: str = Field("", description="the variant that ran this k, else ''")
    best_projected: bool = Field(description="the k the projection names best at this level")


class Verdict(Record):
    """data/verdict.json (05_verdict): where a decode step's time goes and what would move it."""

    sources: dict[str, str] = Field(default_factory=dict, description="figure -> the file it came from")
    verdict: Optional[str] = Field(None, description="the headline sentence; None without a profile")
    attribution: list[AttributionRow] = Field(default_factory=list)
    bottleneck: Optional[Bottleneck] = None
    wall_us: Optional[float] = Field(None, description="median wall time of a profiled step")
    reconcile: list[ReconcileRow] = Field(default_factory=list)
    projections: list[ProjectionRow] = Field(default_factory=list)
    curves: list[CurveRow] = Field(default_factory=list)
    step_model: list[dict[str, Any]] = Field(default_factory=list, description="the step model's components at "
                                             "each batch: batch, component, us, low_us, high_us, source, notes")
    levels: list[LevelReconcileRow] = Field(default_factory=list)
    serving: Optional[ServingHeadline] = None
    findings: list[Finding] = Field(default_factory=list, description="the verdict page, sentence by sentence")
    variants: list[VariantRow] = Field(default_factory=list, description="each variant measured against its projection")
    replay: list[ReplayRow] = Field(default_factory=list, description="the step replay against the step model")
    spec_k: list[SpecKRow] = Field(default_factory=list, description="speculative decoding at k = 1..5 per measured "
                                   "drafter and level, projected and measured")
    engine: str = Field("", description="the baseline's engine as its log (logs/server.log) states it: vLLM "
                        "version, CUDA graphs, torch.compile")
    critical_path: list[CritPathFixRow] = Field(default_factory=list, description="each fix's bound on the "
                                                "critical path beside the step model's projection (empty for runs "
                                                "without data/profile/c<N>/critical_path.json)")

    @model_validator(mode="before")
    @classmethod
    def _without_fixed_factors(cls, data: Any) -> Any:
        """Verdicts written before the step model was the one projection engine held `what_if`, fixed
        factors on the profiled shares: still read, that table left out."""
        if isinstance(data, dict) and "what_if" in data:
            data = {k: v for k, v in data.items() if k != "what_if"}
        return data
