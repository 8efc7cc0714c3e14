"""The step model at every level and the fixes priced on it (decodescope.verdict.verdict): the measured inputs from 02,
03 and 04, each fix as a whole predicted step, and the curves over batch. This is the verdict's one projection
engine: every fix, and every variant's projection (decodescope.verdict.variants), is a step the model predicts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace as dc_replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

import pandas as pd

from decodescope.engines.vllm_log import last_engine_modes
from decodescope.schema.records import HostOps, ProfileCapture, ProfileSummary
from decodescope.schema.rundata import COLLECTIVES, GEMM, RunDir
from decodescope.model import arch as archmod
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import graphless
from decodescope.verdict import stepparts as sp
from decodescope.exec.engine_comm import micro_communicator_for
from decodescope.micro.bench import GEMM_WHATIF_TP
from decodescope.schema.params_schema import KNEE

T = TypeVar("T")


def expected_tokens_per_verify(k: int, alpha: float) -> float:
    """Speculative decoding with k draft tokens and per-token acceptance alpha (i.i.d.): expected tokens
    per verify step, (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al.)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def nearest_batch(items: Iterable[T], batch: float, batch_of: Callable[[T], Any] = lambda x: x) -> T:
    """The item whose batch (batch_of(item); the item itself by default) is nearest `batch`; of two as
    near, the lower."""
    return min(items, key=lambda x: (abs(batch_of(x) - batch), batch_of(x)))


def _read_parquet(run_dir: Path, name: str) -> Optional[pd.DataFrame]:
    """A table under the run's data/ (schema.rundata.RunDir.table); None when absent."""
    return RunDir(run_dir).table(name)


def _profile_summary(run_dir: Path) -> Optional[ProfileSummary]:
    """04_profile's summary; None when the phase did not run, RecordError when it cannot be read."""
    return RunDir(run_dir).profile_summary()


COALESCED_LIMIT = 0.5   # above this share of coalesced token gaps, client TPOT describes delivery, not steps


def level_tpot(lv) -> tuple[float, str]:
    """A level's TPOT for setting against the step: the client's p50, unless the server released most
    tokens in bursts (01's coalesced gaps), which makes the client's TPOT describe delivery; then the
    engine's own mean TPOT from its metrics (vllm:request_time_per_output_token, 01's telemetry). A level
    with an engine stall reads its p50 with the stall taken out (tpot_unstalled_p50_us)."""
    coalesced = float(getattr(lv, "itl_coalesced_frac", 0.0) or 0.0)
    server = getattr(lv, "server_tpot_mean_us", None)
    if coalesced > COALESCED_LIMIT and server is not None and server == server and server > 0:
        return float(server), (f"server TPOT (vllm metrics): {100 * coalesced:.0f}% of the client's token gaps "
                               "coalesced, so its TPOT describes stream delivery")
    unstalled = getattr(lv, "tpot_unstalled_p50_us", None)
    stall_ms = getattr(lv, "engine_stall_ms", None)
    stalled = stall_ms is not None and stall_ms == stall_ms
    if stalled and unstalled is not None and unstalled == unstalled and unstalled > 0:
        # the step, not the stall: a compile inside the window adds its length to every stream it held
        return float(unstalled), (f"client TPOT p50 with the engine's {float(stall_ms or 0) / 1e3:.2f} s stall "
                                  f"taken out (p50 as read: {float(lv.tpot_p50_us):,.0f} us)")
    return float(lv.tpot_p50_us), "client TPOT p50"


# ---- the step model at every level, and the fixes as curves --------------------------------------------
def profile_summaries(run_dir: Path, params) -> dict[int, ProfileSummary]:
    """Every profiled level's summary (the levels of data/profile_capture.json), or the one in data/ for
    a run profiled at one level before levels existed."""
    out = RunDir(run_dir).level_summaries()
    if not out:
        only = _profile_summary(run_dir)
        if only is not None:
            first = next((c for c in params.profile.concurrency if c != KNEE), 1)
            out[int(only.concurrency or first)] = only
    return out


def _positive(x) -> Optional[float]:
    return float(x) if x is not None and x == x and x > 0 else None


def _engine_itls(lv, captures: Optional[dict[int, ProfileCapture]]) -> tuple[Optional[float], Optional[float]]:
    """A serving level's engine inter-token latency in the baseline's two measurements: 01's (its
    telemetry) and 04's unprofiled run at that concurrency (profile_capture.json), each None when absent."""
    cap = ProfileCapture.of(captures, int(lv.level))
    return _positive(getattr(lv, "server_itl_mean_us", None)), _positive(cap.engine_itl_unprofiled_us)


def host_cores(run_dir: Path) -> Optional[int]:
    """The logical CPU cores of the host the server ran on (host.json), when recorded."""
    host = RunDir(run_dir).host()
    return host.cpu.logical_cores if host is not None else None


def profile_captures(run_dir: Path) -> dict[int, ProfileCapture]:
    """Concurrency -> each profiled level's capture (data/profile_capture.json)."""
    return RunDir(run_dir).level_captures()


@dataclass
class ModelInputs:
    gemm: pd.DataFrame
    gemm_tp: Optional[pd.DataFrame]
    coll: pd.DataFrame
    arch: archmod.ArchConfig
    tp: int
    communicator: str
    timing: str
    samples: list
    serving_context_tokens: float
    host_cores: Optional[int] = None
    weight_dtype: Optional[str] = None  # model.weight_dtype: the quantized kinds' GEMMs are priced in it
    skews: tuple = ()                   # (batch, routing skew) measured by 04 (stepparts.measured_routing_skews)
    host_ops: Optional[HostOps] = None  # 04's un-graphed step: the host's cost of the ops graphs hide (graphless)
    per_event_us: Optional[float] = None  # the profiler's cost per recorded event, taken off those costs
    per_event_how: str = ""
    splitting_ops: tuple = ()           # the ops the baseline engine's piecewise graphs leave to the host (its log)
    host_gaps: tuple = ()               # (batch, host us between steps, GPU idle us a period) per profiled level

    def host_gap_at(self, batch: float) -> tuple[Optional[float], float, str]:
        """At the profiled level nearest `batch` (the lower on a tie): the host's time between steps, the
        time the GPU sat idle per step period (the period less its busy time), and where they come from."""
        if not self.host_gaps:
            return None, 0.0, ""
        b, gap_us, idle_us = nearest_batch(self.host_gaps, batch, lambda g: g[0])
        return gap_us, idle_us, f"profile_summary.json host_between_steps_us_median, period less busy (04, batch {b:g})"

    def gpu_us(self, pred) -> tuple[float, float]:
        """(the step's GPU time, its attention part) in a prediction: its work components after the lanes' overlap."""
        work = sum(c.us for c in pred.components if c.kind is sp.Kind.WORK) * pred.overlap
        return work, sum(c.us for c in pred.components if c.name == "attention") * pred.overlap

    def host_costs_at(self, batch: float) -> Optional[tuple[float, dict[str, float]]]:
        """(the measured batch nearest `batch`, 02's host cost of a bare call there per stepparts.HOST_COLUMNS);
        None where 02 measured none."""
        g = self.gemm[self.gemm["status"] == "ok"] if "status" in self.gemm else self.gemm
        if "host_time_us" not in g or g["host_time_us"].dropna().empty:
            return None
        g = g.dropna(subset=["host_time_us"])
        nb = nearest_batch(set(g["batch"]), batch)
        return float(nb), {c: float(g.loc[g["batch"] == nb, c].median()) for c in sp.HOST_COLUMNS}

    def call_us(self, batch: float) -> Optional[float]:
        """02's host cost of a bare call at the measured batch nearest `batch`; None where 02 measured none."""
        costs = self.host_costs_at(batch)
        return costs[1]["host_time_us"] if costs is not None else None

    def predict(self, batch: float, **kw):
        return sm.predict_step(self.gemm, self.coll, self.arch, self.tp, int(round(batch)), self.communicator,
                               self.timing, self.samples, self.serving_context_tokens,
                               weight_dtype=self.weight_dtype, skew=sp.skew_at(self.skews, batch), **kw)

    def at_tensor_parallel(self, t: int, batch: float) -> Optional["Fix"]:
        """Tensor-parallel t with replicas keeping the rank count: GEMMs at t's shapes (02's what-if
        table), attention x tp / t, collectives extrapolated from 03's world size; None when 02 did not
        measure t's GEMMs."""
        if self.gemm_tp is None or self.gemm_tp.empty or t not in set(self.gemm_tp["tp"]):
            return None
        pred = sm.predict_step(self.gemm_tp[self.gemm_tp["tp"] == t], self.coll, self.arch, t, int(batch),
                               self.communicator, self.timing, self.samples, self.serving_context_tokens,
                               measured_world=self.tp, attention_scale=self.tp / t,
                               gemm_source=f"gemm_whatif_tp.parquet (tp {t})", host_cores=self.host_cores)
        return Fix(f"tensor-parallel {t} x {max(self.tp // t, 1)} replicas", pred, 1.0, t, [
            f"GEMMs at tp {t} shapes (02); attention x {self.tp / t:g} (heads per rank); small ops, framework and "
            f"host time as profiled at tp {self.tp}; where tp {t} leaves the host a core, less the workers' "
            "preemption, and between steps the engine core's own CPU time instead of its wait for a core; the "
            "profiler's cost in the share it had of the parts it inflated; each replica serves the batch"])


NO_STEP_MODEL = ("none: fixes are priced by the step model alone, which needs 02's GEMMs (gemm.parquet) and, above "
                 "one GPU, 03's all-reduce (collectives.parquet) timed the way 04's profile shows the step issuing it")


def model_inputs(run_dir: Path, params, summaries: dict[int, ProfileSummary],
                 captures: dict[int, ProfileCapture]) -> Optional[ModelInputs]:
    """What the step model needs from 02, 03 and 04 (captures: profile_captures); None when 02 or 03
    did not run, or 03 did not measure an all-reduce the model can use."""
    gemm, coll = _read_parquet(run_dir, GEMM), _read_parquet(run_dir, COLLECTIVES)
    tp = params.server.tensor_parallel
    if gemm is None or gemm.empty or ((coll is None or coll.empty) and tp > 1):
        return None
    primary = summaries[min(summaries)] if summaries else None
    engine_comm = micro_communicator_for(next(iter(primary.allreduce_communicators), "")
                                                    if primary else "")
    prof, wl = params.profile, params.workload
    samples = sm.step_samples(summaries, prof.input_tokens + prof.output_tokens / 2, captures)
    comm, timing = engine_comm, "back_to_back"
    if coll is not None and not coll.empty:
        measured = [c for c in sorted(set(coll["communicator"].dropna()))]
        comm = engine_comm if engine_comm in measured else (measured[0] if measured else engine_comm)
        timings = sp.step_timings(sm.wait_in_own_op(primary))
        timing = next((t for t in timings if not sp.latency_curve(coll, comm, t).empty), "")
        if not timing:
            return None
    arch = archmod.normalize_config(params.model_config_dict())
    skews = sp.measured_routing_skews(gemm, arch, tp, summaries, weight_dtype=params.model.weight_dtype)
    host_ops = graphless.read_host_ops(run_dir)
    per_event, per_event_how = graphless.profiler_us_per_event(host_ops, captures)
    modes = last_engine_modes(Path(run_dir) / "logs" / "server.log")
    gaps = tuple((float(x.per_step.batch_median or c), float(x.per_step.host_between_steps_us_median),
                  max(float(x.per_step.period_us or 0.0) - float(x.per_step.busy_us_median or 0.0), 0.0))
                 for c, x in sorted(summaries.items()) if x.per_step.host_between_steps_us_median is not None)
    return ModelInputs(host_ops=host_ops, per_event_us=per_event, per_event_how=per_event_how, host_gaps=gaps,
                       splitting_ops=modes.splitting_ops if modes else (), gemm=gemm, gemm_tp=_read_parquet(run_dir, GEMM_WHATIF_TP), coll=coll if coll is not None
                       else pd.DataFrame(), arch=arch, tp=tp,
                       communicator=comm, timing=timing, samples=samples,
                       serving_context_tokens=wl.input_tokens + wl.output_tokens / 2, host_cores=host_cores(run_dir),
                       weight_dtype=params.model.weight_dtype, skews=skews)


@dataclass
class Fix:
    name: str
    prediction: sm.StepPrediction
    tokens_per_step: float = 1.0
    gpus_per_replica: int = 1
    assumptions: list = field(default_factory=list)
    # the batch whose measured TPOT calibrates the fix (a capped batch runs at the cap's); None: the level's own
    calibrate_at: Optional[float] = None
    calibrated: bool = True   # False: the model's own value (a step of another kind than the one measured)
    per_kernel: Optional[tuple[float, float]] = None  # an eager step's (kernels per step, between-steps us)
    # a part of the period measured whole (a profiled drafter): the calibration, which corrects the model's
    # own error at the level, leaves it as measured
    measured_us: float = 0.0
    # an input assumed, not measured (speculative decoding at a given acceptance with the drafter free): such a
    # fix is no ranked gain, only a break-even condition (speccurve.ranked_fixes)
    assumed: bool = False

    def calibrated_us(self, period_us: float, scale: float) -> float:
        """A period of this fix's prediction (value or band end) under the calibration `scale`."""
        return (period_us - self.measured_us) * scale + self.measured_us

    def tpot_us(self, period_us: float, scale: float) -> float:
        """The same over the tokens a step yields (divided before scaling, as every fix was before)."""
        return ((period_us - self.measured_us) / self.tokens_per_step * scale
                + self.measured_us / self.tokens_per_step)


EAGER_STEP = "eager step (host-paced walk)"


def eager_fix(inp: ModelInputs, batch: float) -> tuple[Optional[Fix], str]:
    """No CUDA graphs and no torch.compile (--enforce-eager) on a GPU: the host issues the step's kernels one
    by one. Priced as the eager walk (stepparts.eager_walk) of the profiled step's kernels (04, the nearest
    profiled level), each issued at 02's measured host cost per call and run in its share of the step's GPU
    time (the model's work at this batch), then the host's time between steps; (None, why) without those."""
    costs = inp.host_costs_at(batch)
    if costs is None:
        return None, "02 measured no host cost per call (it does on a GPU)"
    counted = [s for s in inp.samples if s.kernels_per_step >= 1]
    if not counted:
        return None, "04 counted no kernels per step"
    s = nearest_batch(counted, batch, lambda x: x.batch)
    nb, host = costs
    base = inp.predict(batch)
    gpu_us = inp.gpu_us(base)[0]
    n = int(round(s.kernels_per_step))
    between = next((c for c in base.components if c.name == "between steps"),
                   sp.Component("between steps", 0.0, 0.0, 0.0, "none profiled", kind=sp.Kind.HOST_BETWEEN))
    if inp.host_ops is not None and inp.host_ops.ops:
        # the custom ops at their host cost in the baseline's un-graphed step, the other kernels at 02's
        walks = [graphless.eager_items(inp.host_ops, inp.per_event_us, n, host[c], gpu_us) for c in sp.HOST_COLUMNS]
        end, lo, hi = (sp.eager_walk(items)[0] for items, _ in walks)
        walk = sp.Component(EAGER_STEP, end, min(lo, end), max(hi, end),
                            f"host_ops.json (04's un-graphed step) and gemm.parquet host_time_us (02, batch {nb:g}), "
                            f"{n} kernels per step ({s.source})", walks[0][1] + [
                                f"the profiler's cost taken off per recorded event: {inp.per_event_us or 0:,.2f} us "
                                f"({inp.per_event_how})"])
        how = ("the host issues the forward's custom ops at their host cost in 04's un-graphed step (the baseline's "
               "engine, the profiler's cost taken off) and the profiled step's other kernels at 02's host cost per call")
        per_kernel = None
    else:
        end, lo, hi = (sp.eager_walk([(host[c], gpu_us / n)] * n)[0] for c in sp.HOST_COLUMNS)
        walk = sp.Component(EAGER_STEP, end, min(lo, end), max(hi, end),
                            f"gemm.parquet host_time_us (02, batch {nb:g}) x {n} kernels per step ({s.source})", [
                                f"{n} kernels issued at {host['host_time_us']:.1f} us each, {gpu_us:,.0f} us of GPU time"])
        how = (f"the host issues the {n} kernels of the profiled step (graph mode, at batch {s.batch:g}) one by one at "
               f"02's host cost per call ({host['host_time_us']:.1f} us, a bare GEMM call)")
        per_kernel = (float(n), between.us)
    return Fix("eager: no CUDA graphs, no torch.compile", sm.StepPrediction(batch, [walk, between], 1.0), 1.0, inp.tp, [
        how + "; the GPU runs each in its share of the step's GPU time; then the host's time between steps; not "
        "calibrated (a step of another kind than 01's)"], calibrated=False, per_kernel=per_kernel), ""


def capped_fix(inp: ModelInputs, batch: float, cap: int) -> Fix:
    """A batch cap (max-num-seqs): the level runs at most `cap` sequences at once, the rest queue; a
    stream's token costs the step at min(level, cap), calibrated by the baseline measured at that batch."""
    ran = min(float(batch), float(cap))
    return Fix(f"max-num-seqs {cap}: the step at batch {ran:g}", inp.predict(ran), 1.0, inp.tp, [
        f"at most {cap} sequences decode together; the others wait for a slot (their TTFT, not TPOT)"],
               calibrate_at=ran)


def fixes_at(inp: ModelInputs, batch: float, params) -> list[Fix]:
    """Every fix the measured inputs price at `batch`, each as a whole predicted step."""
    out = []
    tp = inp.tp
    calls = [c for c in archmod.collective_schedule(inp.arch, tp, int(batch)) if c.op == "all_reduce"]
    n_ar = sum(c.count for c in calls)
    if tp > 1 and not inp.coll.empty:
        for comm in sorted(set(inp.coll["communicator"].dropna()) - {inp.communicator}):
            timing = next((t for t in sp.STEP_TIMINGS if not sp.latency_curve(inp.coll, comm, t).empty), None)
            if timing is None:
                continue
            c = sp.collective_component(inp.coll, inp.arch, tp, int(batch), comm, timing)
            out.append(Fix(f"all-reduce through {comm}", inp.predict(batch, collectives=c), 1.0, tp,
                           [f"every collective priced from 03's {comm} curve ({timing})"]))
        for lat in params.whatif.allreduce_us:
            c = sp.Component("collectives", n_ar * lat, n_ar * lat, n_ar * lat, "whatif.allreduce_us (params)")
            out.append(Fix(f"all-reduce at {lat:g} us per call", inp.predict(batch, collectives=c), 1.0, tp,
                           [f"{n_ar} all-reduces per step at {lat:g} us each (given)"]))
        a2a = inp.coll[(inp.coll["part"] == "all_to_all") & (inp.coll["status"] == "ok")]
        if inp.arch.moe_layers and not a2a.empty:
            c = sm.expert_parallel_collectives(inp.coll, inp.arch, tp, int(batch), inp.communicator, inp.timing)
            out.append(Fix("expert parallelism", inp.predict(batch, collectives=c), 1.0, tp, c.notes + [
                "expert GEMMs unchanged (the same tokens reach the same experts); balanced load assumed"]))
    for k in params.whatif.spec_k:
        verify = inp.predict(batch * (k + 1))
        for alpha in params.whatif.spec_alpha:
            tokens = expected_tokens_per_verify(k, alpha)
            out.append(Fix(f"speculative decoding k={k}, alpha={alpha:g}", verify, tokens, tp, [
                f"verify step = the step model at batch {batch:g} x {k + 1}; {tokens:.2f} tokens per verify step "
                "((1 - a^(k+1)) / (1 - a)); drafter assumed free (an n-gram's host time; a draft model's passes "
                "are priced only where a variant measured one)"], assumed=True))
    g = inp.predict(batch).components[0]
    half = sp.Component("gemm", g.us / 2, g.low_us / 2, g.high_us / 2, g.source, ["every GEMM twice as fast"])
    out.append(Fix("GEMMs 2x faster", _with_component(inp.predict(batch), half), 1.0, tp,
                   ["every GEMM of the step at half its measured time (02); nothing else changes"]))
    for t in params.projected_tensor_parallel():
        fix = inp.at_tensor_parallel(t, batch) if t != tp else None
        if fix is not None:
            out.append(fix)
    return out


def _with_component(pred, comp):
    """The prediction with one component (by name) replaced."""
    return dc_replace(pred, components=[comp if c.name == comp.name else c for c in pred.components])


def baseline_tpot(levels: Optional[pd.DataFrame], captures: Optional[dict[int, ProfileCapture]] = None) -> dict[float, float]:
    """The baseline's TPOT per serving level, as fixes and variants are calibrated by it: 01's
    (level_tpot), and where 04 also ran that concurrency unprofiled, the mean of the two measurements
    (01's TPOT x the mean of 1 and 04's engine ITL / 01's). The step moves between the two on a small host
    (host_drift up to ~30% on two cores when each phase had a server start of its own), and a projection
    calibrated by one of them carries its draw."""
    out: dict[float, float] = {}
    if levels is None or levels.empty:
        return out
    for lv in levels.sort_values("level").itertuples():
        tpot = level_tpot(lv)[0]
        itl01, itl04 = _engine_itls(lv, captures)
        out[float(lv.level)] = tpot * (1 + itl04 / itl01) / 2 if itl01 and itl04 else tpot
    return out


def served_batches(levels: Optional[pd.DataFrame]) -> dict[float, float]:
    """Level -> the batch the server ran it at, where that is not the level: a level of more slots than
    it sent requests (workload.requests_per_level below the concurrency) runs at most that many at once."""
    if levels is None or levels.empty or "requests" not in levels:
        return {}
    return {float(lv.level): float(lv.requests) for lv in levels.itertuples()
            if 0 < int(lv.requests) < int(lv.level)}


def curves(inp: ModelInputs, params, levels: Optional[pd.DataFrame], captures: Optional[dict[int, ProfileCapture]] = None,
           more_fixes=None) -> tuple[list[dict], list[dict], list[dict]]:
    """TPOT vs output tokens/s per GPU: the measured sweep, the step model, and every fix, at each
    serving level (and profiled batch). A fix's TPOT is calibrated where the sweep measured the batch:
    the baseline's TPOT (baseline_tpot: 01's, with 04's start where it ran that level) x fix / base
    model, so the model's own error cancels; elsewhere it is the model's.
    more_fixes(batch, scale): fixes priced elsewhere (the measured drafters, verdict.speccurve), at the
    batch and its calibration.
    Returns (curve rows, step-model component rows, projection rows at the lowest level)."""
    tp = inp.tp
    measured = {}
    if levels is not None and not levels.empty:
        for lv in levels.sort_values("level").itertuples():
            measured[float(lv.level)] = level_tpot(lv)[0]
    calibration = baseline_tpot(levels, captures)
    served = served_batches(levels)
    batches = sorted(set(measured) | {s.batch for s in inp.samples}) or [1.0]
    rows, comps, proj = [], [], []
    for b, t in measured.items():
        rows.append({"fix": "measured (01)", "batch": b, "tpot_us": t, "tpot_low_us": t, "tpot_high_us": t,
                     "tok_s_per_gpu": b * 1e6 / t / tp})
    lowest = min(measured) if measured else batches[0]
    for b in batches:
        sb = served.get(b, b)  # the batch the server ran this level at
        base = inp.predict(sb)
        lo, hi = base.band_us
        rows.append({"fix": "step model", "batch": b, "tpot_us": base.period_us, "tpot_low_us": lo, "tpot_high_us": hi,
                     "tok_s_per_gpu": sb * 1e6 / base.period_us / tp, "model_us": base.period_us})
        comps += [{"batch": b, **r} for r in base.table().to_dict("records")]
        scale = calibration.get(b, base.period_us) / base.period_us
        extra = more_fixes(sb, scale) if more_fixes else []
        for f in fixes_at(inp, sb, params) + extra:
            flo, fhi = f.prediction.band_us
            tpot = f.tpot_us(f.prediction.period_us, scale)
            row = {"fix": f.name, "batch": b, "tpot_us": tpot, "tpot_low_us": f.tpot_us(flo, scale),
                   "tpot_high_us": f.tpot_us(fhi, scale),
                   "tok_s_per_gpu": b * 1e6 / tpot / f.gpus_per_replica, "model_us": f.prediction.period_us,
                   "calibrated": b in measured, "notes": "; ".join(f.assumptions)}
            rows.append(row)
            if b == lowest:
                ref = calibration.get(b, base.period_us)  # the fix against the baseline it is calibrated by
                proj.append({"fix": f.name, "step_us": f.calibrated_us(f.prediction.period_us, scale),
                             "low_us": f.calibrated_us(flo, scale), "high_us": f.calibrated_us(fhi, scale),
                             "tokens_per_step": f.tokens_per_step, "tpot_us": tpot,
                             "tpot_low_us": row["tpot_low_us"], "tpot_high_us": row["tpot_high_us"],
                             "gain_pct": 100 * (tpot / ref - 1), "batch": b, "tok_s_per_gpu": row["tok_s_per_gpu"],
                             "gpus_per_replica": f.gpus_per_replica,
                             # an assumed input is no ranked gain (speccurve.ranked_fixes); a drafter a variant
                             # ran is priced from what was measured
                             "status": "break-even" if f.assumed else ("measured" if f in extra else "priced"),
                             "assumptions": "; ".join(f.assumptions + ([f"calibrated: x {scale:.2f} (baseline TPOT / "
                                                                        "base model at this level)"] if b in measured else []))})
    return rows, comps, sorted(proj, key=lambda r: (r["status"] == "break-even", r["gain_pct"]))
