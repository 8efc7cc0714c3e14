"""The verdict's findings: what 05 says in sentences, each naming the figure and the files it rests on,
from the typed verdict (decodescope.verdict.verdict builds it, then asks for these)."""
from __future__ import annotations

from typing import Optional, cast

from decodescope.schema.records import ProfileSummary, VariantRow, Verdict
from decodescope.verdict import leveldrift
from decodescope.verdict.stepmodel import DEDUCTED, PREEMPTED
from decodescope.verdict.variants import REPLAY_TOLERANCE

LEVEL_TOLERANCE = 0.20  # client TPOT within 20% of the profiled step counts as agreeing
RECONCILE_TOLERANCE = 0.30  # micro-benchmark vs profile per step: within 30% counts as agreeing
NO_HELP_PCT = -5.0          # a fix projected to gain less than 5% of TPOT "would not help"


def findings(v: Verdict, summary: Optional[ProfileSummary], tp: int) -> list[dict]:
    """The campaign's reasoning, sentence by sentence, each with the figure and files it reads."""
    return (_bottleneck_findings(v, summary, tp) + _reconcile_findings(v) + _model_findings(v)
            + _preemption_findings(v) + _variant_findings(v) + _fix_findings(v))


def _bottleneck_findings(v: Verdict, summary: Optional[ProfileSummary], tp: int) -> list[dict]:
    out = []
    prof = ["data/profile_summary.json"]
    if v.bottleneck and summary:
        ar = ", ".join(f"rank {r} {100 * x:.0f}%" for r, x in summary.allreduce_share_of_time.items())
        b = v.bottleneck
        cls, share = (b.summed_cls, b.summed_cls_share) if b.basis == "critical path" else (b.cls, b.share)
        if cls is not None:
            out.append({"topic": "bottleneck", "figure": "profile-breakdown", "files": prof, "text":
                        f"By summed op time (context: the critical path above attributes the wall step), the largest "
                        f"share is {cls}: {100 * (share or 0.0):.0f}% of op time on the median rank; all-reduce alone "
                        f"takes {ar} of all op time."})
        out += _collective_count_findings(summary, tp)
        ps = summary.per_step
        if ps.summed_us_median and ps.wall_us_median:
            out.append({"topic": "bottleneck", "figure": "profile-summed-wall", "files": prof + ["data/kernels.parquet"],
                        "text": f"Summed op time per step {ps.summed_us_median / 1e3:.2f} ms against a wall-clock step of "
                                f"{ps.wall_us_median / 1e3:.2f} ms" + (f" and a period of {ps.period_us_median / 1e3:.2f} ms "
                                "between step starts" if ps.period_us_median else "") +
                                (": streams overlap." if ps.summed_us_median > ps.wall_us_median else
                                 ": the step is not overlapped; the rest is host time.")})
    if v.engine:
        out.append({"topic": "bottleneck", "figure": "profile-breakdown", "files": ["logs/server.log"],
                    "text": f"The engine measured: {v.engine} (its own log)."})
    return out


def _collective_count_findings(summary: ProfileSummary, tp: int) -> list[dict]:
    out: list[dict] = []
    rows = summary.expected_vs_observed
    if not rows:
        return out
    first_rank = min(r.rank for r in rows)
    for r in (r for r in rows if r.rank == first_rank):
        op, observed, expected = r.collective, r.observed_per_step, r.expected_per_step
        if expected is not None:
            per_call = summary.allreduce_mean_us.get(r.rank)
            out.append({"topic": "bottleneck", "figure": "profile-expected", "files": ["data/profile_summary.json"],
                        "text": f"{op}: {observed:g} calls per step against {expected:g} the architecture issues at "
                                f"tensor-parallel {tp}" + (f"; {per_call:.1f} us per call in the step" if per_call and
                                                            op == "all_reduce" else "") + "."})
    return out


def _reconcile_findings(v: Verdict) -> list[dict]:
    out = []
    for r in v.reconcile:
        ratio = r.profile_over_micro
        # reconcile() fills it by a division (NaN, never None); a None failed in `ratio - 1` below anyway
        assert ratio is not None
        if ratio != ratio:  # NaN: not comparable
            text = f"{r.piece}: not compared ({r.note})."
        elif abs(ratio - 1) <= RECONCILE_TOLERANCE:
            text = (f"{r.piece}: micro-benchmark {r.micro_benchmark_us:,.0f} us vs profile {r.profile_us:,.0f} us per step "
                    f"({ratio:.2f}), within {100 * RECONCILE_TOLERANCE:.0f}%.")
        else:
            text = (f"{r.piece}: micro-benchmark {r.micro_benchmark_us:,.0f} us vs profile {r.profile_us:,.0f} us per step "
                    f"({ratio:.2f}), outside {100 * RECONCILE_TOLERANCE:.0f}%" + (f": {r.note}." if r.note else "."))
        out.append({"topic": "consistency", "figure": "verdict-reconcile", "files": [
            f"data/{r.micro_source.split(' ')[0].rstrip(',')}", "data/profile_summary.json"], "text": text})
    return out


def _model_findings(v: Verdict) -> list[dict]:
    """The step model against the replay (03) and against the serving levels (01)."""
    out = []
    if v.replay:
        ok = [r for r in v.replay if abs(r.error) <= REPLAY_TOLERANCE]
        worst = max(v.replay, key=lambda r: abs(r.error))
        out.append({"topic": "consistency", "figure": "verdict-replay", "files": [
            "data/step_replay.parquet", "data/gemm.parquet", "data/collectives.parquet"],
            "text": f"The step replayed without the framework (03) against the step model's GEMMs + collectives: "
                    f"within {100 * REPLAY_TOLERANCE:.0f}% at {len(ok)} of {len(v.replay)} (batch, mode); the "
                    f"worst, batch {worst.batch} {worst.mode}: {worst.predicted_us / 1e3:.2f} ms predicted vs "
                    f"{worst.replay_us / 1e3:.2f} ms replayed ({100 * worst.error:+.0f}%)."})
    with_model = [lv for lv in v.levels if lv.model_error is not None]
    if with_model:
        # with_model holds the levels whose model_error is set
        ok_levels = [lv for lv in with_model if abs(cast(float, lv.model_error)) <= LEVEL_TOLERANCE]
        first = with_model[0]
        # level_reconcile sets model_us with model_error; a None failed in the f-string below anyway
        assert first.model_us is not None and first.model_error is not None
        out.append({"topic": "consistency", "figure": "verdict-levels", "files": [
            "data/serving_levels.parquet", "data/gemm.parquet", "data/collectives.parquet", "data/profile/"],
            "text": f"The step model is within {100 * LEVEL_TOLERANCE:.0f}% of the measured TPOT at {len(ok_levels)} of "
                    f"{len(with_model)} serving levels; at concurrency {first.level}: {first.model_us / 1e3:.2f} ms "
                    f"predicted vs {(first.reference_tpot_us or first.tpot_p50_us) / 1e3:.2f} ms measured "
                    f"({100 * first.model_error:+.0f}%; {first.reference or 'client TPOT p50'})"
                    + (f"; against the engine's step on 04's own server, where the model's profile inputs were "
                       # host_drift is set only with profile_engine_itl_us (level_reconcile)
                       f"measured ({cast(float, first.profile_engine_itl_us) / 1e3:.2f} ms): "
                       f"{100 * first.model_error_same_server:+.0f}%, "
                       f"the host's step having drifted {100 * first.host_drift:+.0f}% between 01 and 04"
                       if first.model_error_same_server is not None and first.host_drift is not None else "")
                    + "."})
        missed = [lv for lv in with_model if lv.model_miss]
        if missed:
            out.append({"topic": "consistency", "figure": "verdict-levels", "files": [
                "data/serving_requests.parquet", "data/profile_capture.json"],
                "text": f"Where the step model misses client TPOT by more than {100 * leveldrift.MODEL_TARGET:.0f}%: "
                        + "; ".join(f"concurrency {lv.level} ({100 * cast(float, lv.model_error):+.0f}%): "
                                    f"{lv.model_miss}" for lv in missed) + "."})
    return out


def _preemption_findings(v: Verdict) -> list[dict]:
    pre = [c for c in v.step_model if c["component"] == PREEMPTED and c["us"] > 0]
    if not pre:
        return []
    c = pre[0]
    step = sum(x["us"] for x in v.step_model if x["batch"] == c["batch"] and x["us"] > 0
               and x["component"] not in DEDUCTED)
    return [{"topic": "host", "figure": "verdict-levels", "files": [
        f"data/{c['source'].split(';')[0].split(' ')[0]}"],
        "text": f"At batch {c['batch']:g} the workers waited {c['us']:,.0f} us per step for a core the host's "
                f"other processes (engine core, API server) held: {100 * c['us'] / step:.0f}% of the modelled "
                "step (/proc schedstat over 04's unprofiled run); a configuration that leaves them a core "
                "sheds it."}]


def _variant_findings(v: Verdict) -> list[dict]:
    out = []
    measured: dict[str, VariantRow] = {}
    for r in v.variants:
        if r.status != "ok" or r.measured_gain_pct is None:
            continue
        if r.variant not in measured or (r.level or 0) < (measured[r.variant].level or 0):
            measured[r.variant] = r  # the lowest level each variant shares with the baseline
    # measured holds only rows whose measured_gain_pct is set (the loop above skips the rest)
    for r in sorted(measured.values(), key=lambda r: cast(float, r.measured_gain_pct)):
        proj = (f"; projected {r.projected_tpot_us / 1e3:.2f} ms ({r.projection}), {r.projection_error_pct:+.0f}% off"
                if r.projected_tpot_us else f"; no projection ({r.notes})" if r.notes else "")
        # variant_rows sets both with measured_gain_pct, from them; a None failed in the f-string below anyway
        assert r.tpot_p50_us is not None and r.baseline_tpot_p50_us is not None
        out.append({"topic": "measured", "figure": "verdict-variants", "files": [f"variants/{r.variant}/data/serving_levels.parquet"],
                    "text": f"Variant {r.variant}{' (' + r.engine_modes + ')' if r.engine_modes else ''}, measured: "
                            f"TPOT {r.measured_gain_pct:+.0f}% at concurrency {r.level} "
                            f"({r.tpot_p50_us / 1e3:.2f} ms vs {r.baseline_tpot_p50_us / 1e3:.2f} ms){proj}"
                            f"{'. ' + r.gpu_host_split[0].upper() + r.gpu_host_split[1:] if r.gpu_host_split else ''}."})
    for r in [r for r in v.variants if r.status != "ok" and r.level is None]:
        out.append({"topic": "measured", "figure": "verdict-variants", "files": ["manifest.json"],
                    "text": f"Variant {r.variant} {r.status}: {r.error}"})
    return out


def _fix_findings(v: Verdict) -> list[dict]:
    """The ranked fixes that help (the best three), with their bound on the path; those that would not; and
    each fix with an assumed input as the condition under which it would pay off, never as a gain."""
    out = []
    ranked = [p for p in v.projections if p.status != "break-even"]
    helps = [p for p in ranked if p.gain_pct < NO_HELP_PCT]
    for p in helps[:3]:
        bound = (f"; the critical path's {p.bound} allows at most {p.bound_gain_pct:.0f}%"
                 + (": the projection is beyond it" if p.beyond_bound else "") if p.bound else "")
        out.append({"topic": "fix", "figure": "verdict-fixes", "files": ["data/verdict.json"], "text":
                    f"{p.fix} ({p.status}): TPOT {p.gain_pct:+.0f}% ({p.tpot_low_us / 1e3:.2f}-"
                    f"{p.tpot_high_us / 1e3:.2f} ms) at batch {p.batch or 1:g}{bound}."})
    for p in [p for p in ranked if p.gain_pct >= NO_HELP_PCT]:
        out.append({"topic": "no_help", "figure": "verdict-fixes", "files": ["data/verdict.json"],
                    "text": f"Would not help: {p.fix}: {p.gain_pct:+.0f}%."})
    said: dict[str, list[str]] = {}  # one sentence per condition: the acceptances assumed share their k's
    for p in [p for p in v.projections if p.status == "break-even" and p.condition]:
        said.setdefault(p.condition, []).append(p.fix)
    for condition, fixes in said.items():
        out.append({"topic": "fix", "figure": "verdict-fixes", "files": ["data/verdict.json"],
                    "text": f"Not ranked, an input assumed ({'; '.join(fixes)}): {condition}."})
    return out
