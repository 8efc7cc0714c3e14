"""A decode step as measured components (docs/step_model.md): the micro-benchmarks' GEMMs and collectives
(decodescope.verdict.stepparts) and what only the profile (04) measures: attention and the small ops, the
host's time in and between steps, the wait for the last rank, the profiler's own cost. StepModel, built from
StepInputs, prices each part in a method of its own and the whole step at batch b (predict), each component
with the file it came from, a band from its measured spread and its kind (stepparts.Kind). A host with
fewer cores than the server's processes is HostModel's (stepsample).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.model import arch as archmod
from decodescope.schema.records import ProfileCapture, StepCategoryRow, frame
from decodescope.verdict.stepparts import Component, Kind, collective_component, gemm_component, latency_at, latency_curve
from decodescope.trace.categorize import ALLREDUCE_CATEGORIES, WAIT_CATEGORIES
from decodescope.trace.classtime import class_time_per_step
from decodescope.verdict.stepsample import AS_PAID, PREEMPTED, HostModel, StepSample, across_levels, preempted_us

__all__ = ["AS_PAID", "PREEMPTED", "StepInputs", "StepModel", "StepPrediction", "predict_step", "step_samples"]


# ---- the whole step: what only the profile measures --------------------------------------------------
# Verdict classes the micro-benchmarks price (02: GEMMs, 03: collectives); the profile prices the rest.
MICRO_CLASSES = ("gemm", "communication")


def profiler_cost(cap: ProfileCapture, cats: pd.DataFrame, rank) -> tuple[Optional[float], tuple, str]:
    """What the profiler added to a step at one profiled level (04's profile_capture.json).

    It is the engine's inter-token latency under the profiler less that without it.
    Both run the same workload on the same server, a second apart.
    The band is the difference between the two unprofiled runs.
    A level may also have been measured unprofiled before the phase's first profile.
    There the profiled latency is taken less that measurement.
    So what earlier profiles left behind in the server is the profiler's cost as well.
    Where /metrics had no inter-token latency, it is the critical rank's ops per step x the profiler's cost
    per recorded op.
    That is a floor: it misses the trace writers and the profiled front end sharing the host's cores."""
    step, base = cap.profiler_step_cost_us, cap.engine_itl_unprofiled_us
    if step is not None and base:
        noise_us = float(cap.window_noise or 0.0) * float(base)
        v = max(float(step), 0.0)   # the profiler cannot speed a step up: a negative reading is noise
        source = "inter-token latency profiled - unprofiled"
        if cap.engine_itl_before_profiles_us:
            source += (" before 04's first profile" + (f" ({cap.profiler_residue_us:,.0f} us of it left by the "
                                                        "earlier profiles)" if cap.profiler_residue_us else ""))
        return v, (max(v - noise_us, 0.0), v + noise_us), source
    if cap.profiler_event_cost_us is None:
        return None, (), ""
    v = float(cats[cats["rank"] == rank]["calls_per_step"].sum()) * float(cap.profiler_event_cost_us)
    return v, (v, v), "ops per step x the profiler's cost per recorded op"


def allreduce_wait_us(cats: pd.DataFrame, rank, transfer_us: Optional[float]) -> float:
    """A rank's all-reduce time per step beyond the collectives' own (transfer, least time over ranks):
    its wait for the last rank to arrive, which a micro-benchmark issuing calls in lock-step never sees."""
    if transfer_us is None:
        return 0.0
    mine = cats[(cats["rank"] == rank) & cats["category"].isin(ALLREDUCE_CATEGORIES)]["time_per_step_us"].sum()
    return max(0.0, float(mine) - float(transfer_us))


def own_op_wait_by_rank(cats: pd.DataFrame) -> pd.Series:
    """Each rank's time per step in collective-wait ops (categorize.WAIT_CATEGORIES: gloo's c10d wait,
    functional collectives' wait_tensor): where a communicator waits for the other ranks in an op of its own."""
    if cats.empty:
        return pd.Series(dtype=float)
    return cats[cats["category"].isin(WAIT_CATEGORIES)].groupby("rank")["time_per_step_us"].sum()


def wait_in_own_op(summary) -> bool:
    """Whether a CPU profile's all-reduces wait in ops of their own on every rank (gloo: vLLM CPU's _C_AVX2
    path), so that a call costs its all-reduce op plus its wait op."""
    if summary is None or summary.device != "cpu":
        return False
    cats = frame(summary.per_step_categories, StepCategoryRow)
    wait = own_op_wait_by_rank(cats)
    ranks = set(cats["rank"]) if not cats.empty else set()
    return bool(ranks) and all(float(wait.get(r, 0.0)) > 0 for r in ranks)


def step_samples(summaries: dict, context_tokens: float,
                 captures: Optional[dict[int, ProfileCapture]] = None) -> list[StepSample]:
    """ProfileSummary per profiled concurrency -> StepSample per level, sorted by batch. captures
    (concurrency -> 04's profile_capture.json) give the profiler's own cost of a step (profiler_cost)
    and the workers' run-queue wait per step: the time the host's other processes held their cores."""
    out = []
    for conc, s in sorted(summaries.items()):
        cats = frame(s.per_step_categories, StepCategoryRow)
        ps = s.per_step
        if cats.empty or not ps.wall_us_median:
            continue
        by = class_time_per_step(cats).unstack(fill_value=0.0)
        rank = by["communication"].idxmin() if "communication" in by else by.index[0]
        cap = ProfileCapture.of(captures, conc)
        cost, band, how = profiler_cost(cap, cats, rank)
        worker, engine = cap.role("worker"), cap.role("engine core")
        # with the wait in an op of its own the calls are priced back to back, waits included (03): the
        # wait is not added again on top of them
        own_wait = float(own_op_wait_by_rank(cats).get(rank, 0.0)) if wait_in_own_op(s) else 0.0
        overlap = (ps.busy_us_median / ps.summed_us_median) if ps.summed_us_median and ps.busy_us_median else 1.0
        # the period's (trimmed) mean, not its median: TPOT is a request's mean gap, slow steps included,
        # and the profiler's cost taken off it is a difference of means (inter-token latency). On the H200
        # the 10-layer Kimi-shaped step's profiled periods at concurrency 1 had a median 9.6% under the
        # engine's profiled inter-token latency; against it the model read -14% of client TPOT with no drift
        period_us = ps.period_us
        out.append(StepSample(batch=float(ps.batch_median or conc), context_tokens=context_tokens,
                              classes_us={str(k): float(v) for k, v in by.loc[rank].items()},
                              idle_us=float(ps.idle_us_median or 0.0), between_us=float(ps.between_steps_us_median or 0.0),
                              overlap=min(1.0, overlap), period_us=float(period_us),
                              source=f"profile/c{conc}/profile_summary.json (rank {rank})",
                              profiler_cost_us=cost, profiler_cost_band_us=band, profiler_cost_how=how,
                              preempted_us=worker.runq_wait_us, engine_cpu_us=engine.cpu_us,
                              engine_wait_us=engine.runq_wait_us,
                              allreduce_wait_us=0.0 if own_wait else allreduce_wait_us(
                                  cats, rank, s.allreduce_transfer_us_per_step),
                              wait_own_op_us=own_wait,
                              kernels_per_step=float(cats.loc[cats["rank"] == rank, "calls_per_step"].sum())))
    return sorted(out, key=lambda x: x.batch)


def attention_component(samples: list[StepSample], batch: float, context_tokens: float) -> Component:
    """Attention (and KV-cache writes) from the profile, as a + c x (batch x context) through the
    profiled levels; one level: held at its value."""
    xs = np.array([s.batch * s.context_tokens for s in samples])
    ys = np.array([s.classes_us.get("attention", 0.0) for s in samples])
    x = batch * context_tokens
    notes = []
    if len(set(xs)) >= 2:
        c, a = np.polyfit(xs, ys, 1)
        v = float(max(a + c * x, 0.0))
        if not xs.min() <= x <= xs.max():
            notes.append(f"extrapolated in batch x context ({x:g} outside {xs.min():g}..{xs.max():g})")
    else:
        v = float(ys[0])
        notes.append("one profiled level: held at its value")
    return Component("attention", v, min(v, float(ys.min())), max(v, float(ys.max())),
                     "; ".join(s.source for s in samples), notes)


@dataclass
class StepPrediction:
    batch: float
    components: list[Component]
    overlap: float

    def _sum(self, attr: str, host: bool) -> float:
        work = sum(getattr(c, attr) for c in self.components if c.kind is Kind.WORK)
        gaps = sum(_signed(c, attr) for c in self.components
                   if c.kind is not Kind.WORK and (host or c.kind is Kind.HOST_IN_STEP))
        return work * self.overlap + gaps

    @property
    def period_us(self) -> float:
        """Step plus the host's time between steps: what one token costs a stream (TPOT)."""
        return self._sum("us", True)

    @property
    def band_us(self) -> tuple[float, float]:
        return self._sum("low_us", True), self._sum("high_us", True)

    @property
    def wall_us(self) -> float:
        return self._sum("us", False)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"component": c.name, "us": c.us, "low_us": c.low_us, "high_us": c.high_us,
                              "source": c.source, "notes": "; ".join(c.notes)} for c in self.components])


PROFILER_COST = "profiler's own cost"
WAIT = "all-reduce wait for the last rank"
REST = "rest of the profiled period"
# a variant's ops that its CUDA graphs no longer cover, run by the host inside the step (verdict.graphless)
OUTSIDE_GRAPH = "ops outside the CUDA graph, on the host"
# a variant that schedules synchronously where the baseline overlapped its host's work between steps
LOST_ASYNC = "host between steps, no longer overlapped"
# speculative decoding's drafter: its passes run inside the engine's step
DRAFTER = "drafter's passes"
# the names of deducted parts, for tables that carry names only (findings reads verdict.json's rows)
DEDUCTED = (PROFILER_COST,)
# A deducted component (the profiler's cost: 04 measured the profiled step) is a cost as measured, never below
# zero, subtracted where the components add up; its band's high end takes the most off, so it bounds the low end
_OPPOSITE = {"us": "us", "low_us": "high_us", "high_us": "low_us"}


def _signed(c: "Component", attr: str) -> float:
    """A component's share of a sum: its value, or for a deducted one minus its value (the band reversed)."""
    return -getattr(c, _OPPOSITE[attr]) if c.kind is Kind.DEDUCTED else getattr(c, attr)


@dataclass(frozen=True)
class StepInputs:
    """What the step model is built from: 02's GEMMs (gemm, at gemm_source), 03's collectives (coll, through
    `communicator` timed as `timing`, at world size measured_world, default tp), the architecture sharded at
    tp, and 04's profiled levels (samples) at context_tokens. attention_scale: heads per rank against the
    profiled size; host_cores: the host's cores (HostModel)."""

    gemm: pd.DataFrame
    coll: pd.DataFrame
    arch: archmod.ArchConfig
    tp: int
    communicator: str
    timing: str
    samples: list[StepSample]
    context_tokens: float
    dtype: str = "bf16"
    gemm_source: str = "gemm.parquet"
    measured_world: Optional[int] = None
    attention_scale: float = 1.0
    host_cores: Optional[int] = None
    weight_dtype: Optional[str] = None


class StepModel:
    """The decode step at a batch as measured components (predict), one method per part. The host's own
    contention on a host with fewer cores than processes is HostModel's (stepsample)."""

    def __init__(self, inputs: StepInputs):
        self.x = inputs
        self.world = inputs.measured_world or inputs.tp
        self.host = HostModel(inputs.host_cores, inputs.tp, self.world)
        # what the profiled levels would be with this host's contention (a freed core keeps less op time)
        self.samples = self.host.as_run(inputs.samples)
        self.source = "; ".join(s.source for s in inputs.samples)

    def gemms(self, batch: int, skew: float = 0.0) -> Component:
        """02's GEMMs of the step at `batch` (skew: the routing skew 04 measured, for the expert GEMMs)."""
        x = self.x
        return gemm_component(x.gemm, x.arch, x.tp, batch, x.dtype, source=x.gemm_source,
                              weight_dtype=x.weight_dtype, skew=skew)

    def collectives(self, batch: int) -> list[Component]:
        """03's collectives at `batch` (none at tensor-parallel 1), and where gloo waits in ops of its own, what
        the engine's calls cost beyond (or short of) that price at the profiled levels."""
        x = self.x
        if x.tp <= 1:
            return []
        priced = _priced_collectives(x.coll, x.arch, x.tp, batch, x.communicator, x.timing, x.dtype, self.world)
        as_paid = self.host.collectives_as_paid(x.samples, batch, priced.us)
        return [priced] + ([as_paid] if as_paid is not None else [])

    def rank_wait(self, batch: int) -> list[Component]:
        """The critical rank's wait for the last rank in its all-reduces (04), where it waited."""
        x = self.x
        if not (x.samples and x.tp > 1 and any(s.allreduce_wait_us for s in x.samples)):
            return []
        v, lo, hi, notes = across_levels(x.samples, batch, lambda s: s.allreduce_wait_us)
        return [Component(WAIT, v, lo, hi, self.source + " (all-reduce time on the rank minus the transfer: "
                          "least time over ranks per call)", notes)]

    def profiled_ops(self, batch: int) -> list[Component]:
        """Attention, small ops and framework time (04), as this host runs them."""
        x = self.x
        # preemption inside ops is contention a freed core removes, like the preemption in the idle: the op
        # classes keep, at this batch, the share of their time that was not run-queue wait (ops_keep across
        # the profiled levels). Scaled level by level before attention's fit through the levels, the levels'
        # shares set its slope (a native campaign: 0.70 at batch 1, 0.54 at 2; TP=1's attention fell to 0 at 4).
        return _profiled_ops(x.samples, batch, x.context_tokens, x.attention_scale,
                             self.host.ops_keep_at(x.samples, batch), x.tp, self.source)

    def host_in_step(self, batch: int) -> list[Component]:
        """The host's time inside the step: the workers' preemption (HostModel), then the rest of the idle."""
        preempted = self.host.preempted(self.samples, batch, _capture_sources(self.samples))
        v, lo, hi, notes = across_levels(self.samples, batch, lambda s: s.idle_us - preempted_us(s))
        return ([preempted] if preempted is not None else []) + [
            Component("idle in step", v, lo, hi, self.source, notes, Kind.HOST_IN_STEP)]

    def between_steps(self, batch: int) -> Component:
        """The host's time between steps (04), as this host would spend it (HostModel.between_us)."""
        v, lo, hi, notes = across_levels(self.samples, batch, self.host.between_us)
        return Component("between steps", v, lo, hi, self.source, notes + self.host.between_notes(self.samples),
                         Kind.HOST_BETWEEN)

    def overlap(self, batch: int) -> float:
        """The critical rank's lanes' overlap (busy / summed) at `batch`; 1 without a profile."""
        return across_levels(self.samples, batch, lambda s: s.overlap)[0] if self.samples else 1.0

    def rest(self, batch: int, comps: list[Component], overlap: float) -> Component:
        """The rest of the profiled period (_rest), from the levels as profiled."""
        return _rest(self.x.samples, batch, comps, overlap, self.x.tp if self.world != self.x.tp else None,
                     self.source)

    def profiler_cost(self, batch: int, comps: list[Component], overlap: float) -> list[Component]:
        """The profiler's measured cost, taken off the parts it inflated (_profiler_cost)."""
        return _profiler_cost(self.samples, batch, comps, overlap)

    def predict(self, batch: int, collectives: Optional[Component] = None, skew: float = 0.0) -> StepPrediction:
        """The step at `batch`: every part in order; `collectives` replaces 03's (a fix)."""
        comps = [self.gemms(batch, skew)]
        comps += [collectives] if collectives is not None else self.collectives(batch)
        comps += self.rank_wait(batch)
        if not self.x.samples:
            return StepPrediction(float(batch), comps, 1.0)
        comps += self.profiled_ops(batch) + self.host_in_step(batch)
        comps.append(self.between_steps(batch))
        overlap = self.overlap(batch)
        comps.append(self.rest(batch, comps, overlap))
        comps += self.profiler_cost(batch, comps, overlap)
        return StepPrediction(float(batch), comps, overlap)


def predict_step(gemm: pd.DataFrame, coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int,
                 communicator: str, timing: str, samples: list[StepSample], context_tokens: float,
                 collectives: Optional[Component] = None, skew: float = 0.0, **inputs) -> StepPrediction:
    """StepModel(StepInputs(...)).predict(batch) for callers holding the inputs loose; `inputs` are
    StepInputs' optional fields."""
    return StepModel(StepInputs(gemm, coll, arch, tp, communicator, timing, samples, context_tokens, **inputs)
                     ).predict(batch, collectives, skew)


def _profiled_ops(samples: list[StepSample], batch: float, context_tokens: float, attention_scale: float,
                  keep: float, tp: int, src: str) -> list[Component]:
    """The op classes only the profile prices (attention, small ops, framework) at `batch`: attention x
    attention_scale (heads per rank), each x keep (the share of their time that was not run-queue wait,
    where this tensor-parallel size frees a core)."""
    keep_note = [f"x {keep:.2f}: less the workers' run-queue wait inside ops (a core of their own at "
                 f"tensor-parallel {tp})"] if keep != 1.0 else []
    a = attention_component(samples, batch, context_tokens)
    if attention_scale != 1.0 or keep != 1.0:
        scale = attention_scale * keep
        a = Component(a.name, a.us * scale, a.low_us * scale, a.high_us * scale, a.source, a.notes + keep_note +
                      ([f"x {attention_scale:g}: heads per rank at this tensor-parallel size"]
                       if attention_scale != 1.0 else []))
    out = [a]
    for cls in sorted({c for s in samples for c in s.classes_us} - set(MICRO_CLASSES) - {"attention"}):
        v, lo, hi, notes = across_levels(samples, batch, lambda s, c=cls: s.classes_us.get(c, 0.0))
        out.append(Component(cls, v * keep, lo * keep, hi * keep, src, notes + keep_note))
    return out


def _rest(samples: list[StepSample], batch: float, comps: list[Component], overlap: float,
          other_tp: Optional[int], src: str) -> Component:
    """The rest of the profiled period: what the medians of its parts leave of the period.

    The period is its trimmed mean, the median in older summaries (StepSample.period_us).
    At the tensor-parallel size profiled, the rest is as measured.
    At another size (other_tp), it is the same share of that step's parts.
    The share is the parts' spread step to step, which goes with them.
    On gloo each all-reduce is a sleep in gloo's wait, 1-6 ms a step.
    There TP=2's rest was 2.0-3.3 ms a step and a profiled TP=1 server's 30-70 us (benchmarks/tp1_projection_parts.py).
    Carried whole, it was most of the projection's excess over the TP=1 profile's step.
    That excess was x 1.72 and x 1.93 at batch 1 and 4."""
    if other_tp is None:
        v, lo, hi, notes = across_levels(samples, batch, lambda s: s.rest_us)
        return Component(REST, v, lo, hi, src, notes, Kind.HOST_BETWEEN)
    share, lo_s, hi_s, notes = across_levels(samples, batch, _rest_share)
    parts_us = sum(c.us * (overlap if c.kind is Kind.WORK else 1.0) for c in comps)
    notes.append(f"{share:.3f} of the step's parts ({parts_us:.0f} us at tensor-parallel {other_tp}), the rest's "
                 "share of the profiled parts")
    return Component(REST, share * parts_us, lo_s * parts_us, hi_s * parts_us, src, notes, Kind.HOST_BETWEEN)


def _rest_share(s: StepSample) -> float:
    """The rest of the profiled period as a share of the parts it was left by."""
    parts_us = s.period_us - s.rest_us
    return s.rest_us / parts_us if parts_us > 0 else 0.0


def _priced_collectives(coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int, communicator: str,
                        timing: str, dtype: str, world: int) -> Component:
    """03's collectives of the step at `batch`; at another tensor-parallel size than 03 measured (world),
    scaled by (tp - 1) / (world - 1), a ring's latency term, and labelled extrapolated."""
    c = collective_component(coll, arch, tp, batch, communicator, timing, dtype)
    if world == tp:
        return c
    f = (tp - 1) / max(world - 1, 1)
    return Component(c.name, c.us * f, c.low_us * f, c.high_us * f, c.source, c.notes + [
        f"extrapolated from world size {world} to {tp}: x {f:.2f} ((n - 1) / (world - 1))"])


def _profiler_cost(samples: list[StepSample], batch: float, comps: list[Component], overlap: float) -> list[Component]:
    """The profiler's measured cost at `batch` (across the profiled levels that measured it), as a share
    of the profile-sourced parts it inflated, taken off these parts in that share and never more than
    they add up to."""
    parts_us = {id(s): _profiled_parts_us(s) for s in samples}
    measured = [s for s in samples if s.profiler_cost_us is not None and parts_us[id(s)] > 0]
    if not measured:
        return []
    profiled = sum(c.us * (overlap if c.kind is Kind.WORK else 1.0) for c in comps
                   if c.name not in ("gemm", "collectives", WAIT, AS_PAID))
    # the cost as a share of what the profiler inflated, applied to these parts: where a fix shrinks
    # them (another tensor-parallel size), the profiler would have cost that step less too
    share, _, _, notes = across_levels(measured, batch, lambda s: s.profiler_cost_us / parts_us[id(s)])
    lo_share = across_levels(measured, batch, lambda s: s.profiler_cost_band_us[0] / parts_us[id(s)])[1]
    hi_share = across_levels(measured, batch, lambda s: s.profiler_cost_band_us[1] / parts_us[id(s)])[2]
    v, lo, hi = share * profiled, lo_share * profiled, hi_share * profiled
    if v > profiled:
        notes.append(f"capped at the profile-sourced parts ({profiled:.0f} us of {v:.0f})")
        v, lo, hi = profiled, min(lo, profiled), min(hi, profiled)
    how = sorted({s.profiler_cost_how for s in measured})
    notes.append("a cost taken off the profiled parts (the unprofiled step is what TPOT measures)")
    return [Component(PROFILER_COST, v, lo, hi, f"{_capture_sources(measured)} ({'; '.join(how)})", notes,
                      Kind.DEDUCTED)]


def _profiled_parts_us(s: StepSample) -> float:
    """What the profile priced in this sample's step (the parts the profiler's cost is taken off): its
    classes other than GEMMs and communication times the overlap, and the host's time in, between and
    around its steps."""
    work = sum(v for k, v in s.classes_us.items() if k not in MICRO_CLASSES)
    return work * s.overlap + s.idle_us + s.between_us + s.rest_us


def _capture_sources(samples: list[StepSample]) -> str:
    """The profile_capture.json files (04's capture record) of the levels sampled."""
    return "; ".join(s.source.split(" (")[0].replace("profile_summary", "profile_capture") for s in samples)


def all_to_all_at(coll: pd.DataFrame, tokens: float) -> tuple[float, float, float, str]:
    """03's all-to-all (median over ranks of its median) at `tokens` per GPU, log-log between measured
    token counts, held at the ends: (us, p10, p90, how)."""
    a = coll[(coll["part"] == "all_to_all") & (coll["status"] == "ok")]
    g = a.groupby("tokens_per_gpu")[["time_us"] + [c for c in ("p10_us", "p90_us") if c in a]].median().reset_index()
    xs = g["tokens_per_gpu"].to_numpy(float)
    out = []
    for col in ("time_us", "p10_us", "p90_us"):
        ys = g[col].to_numpy(float) if col in g else g["time_us"].to_numpy(float)
        out.append(float(np.exp(np.interp(np.log(tokens), np.log(xs), np.log(ys)))))
    how = "measured range" if xs[0] <= tokens <= xs[-1] else f"held at {xs[0] if tokens < xs[0] else xs[-1]:g} tokens"
    return out[0], out[1], out[2], how


def expert_parallel_collectives(coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int,
                                communicator: str, timing: str, dtype: str = "bf16") -> Component:
    """The step's collectives under expert parallelism: each MoE layer's all-reduce replaced by a
    dispatch and a combine all-to-all at batch x top_k tokens per GPU (03); the rest as measured."""
    curve = latency_curve(coll, communicator, timing)
    total = low = high = 0.0
    for c in archmod.collective_schedule(arch, tp, batch, dtype):
        if c.where == "moe_out":
            continue
        total += c.count * latency_at(curve, c.msg_bytes)[0]
        low += c.count * latency_at(curve, c.msg_bytes, "p10_us")[0]
        high += c.count * latency_at(curve, c.msg_bytes, "p90_us")[0]
    t, lo, hi, how = all_to_all_at(coll, batch * arch.top_k)
    n = 2 * arch.moe_layers
    return Component("collectives", total + n * t, low + n * lo, high + n * hi,
                     f"collectives.parquet ({communicator}, {timing}; all_to_all)",
                     [f"{arch.moe_layers} MoE all-reduces -> {n} all-to-all at {batch * arch.top_k} tokens per GPU "
                      f"({t:.1f} us each, {how})"])
