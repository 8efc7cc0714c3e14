"""The verdict: where a decode step's time goes, how the pieces reconcile, and what would move it.

Inputs are the phases' files in the run directory; each figure says which file it came from. The
result is a records.Verdict, written to data/verdict.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from decodescope.schema.records_verdict import SpecKRow
from decodescope.schema.records import (AttributionRow, Bottleneck, CurveRow, Finding, LevelReconcileRow,
                                        ProfileCapture, ProfileSummary, ProjectionRow, ReconcileRow, ReplayRow,
                                        ServingHeadline, StepCategoryRow, VariantRow, Verdict, frame)
from decodescope.schema.records_serving import ServingLevel
from decodescope.model import arch as archmod
from decodescope.verdict import leveldrift, stepmodel as sm, stepparts as sp
from decodescope.verdict.pathanswer import (critical_path_findings, critical_path_records, disagreement, fix_rows,
                                               headline, path_bottleneck, transfer_reconcile_row)
from decodescope.exec.engine_comm import micro_communicator_for
from decodescope.engines.vllm_log import last_engine_modes
from decodescope.micro.bench import with_timing_columns
from decodescope.verdict.stepmodel import allreduce_wait_us
from decodescope.trace import categorize
from decodescope.trace.classtime import class_time_per_step
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.recordbase import write_record
from decodescope.schema.rundata import COLLECTIVES, GEMM, SERVING_LEVELS, SERVING_REQUESTS, VERDICT
from decodescope.verdict.fixes import (NO_STEP_MODEL, ModelInputs, _engine_itls, _profile_summary, _read_parquet,
                                       baseline_tpot, curves, level_tpot, model_inputs, profile_captures,
                                       profile_summaries, served_batches)
from decodescope.verdict.ranking import rank_projections
from decodescope.verdict.findings import LEVEL_TOLERANCE, NO_HELP_PCT, RECONCILE_TOLERANCE, findings
from decodescope.verdict.speccurve import (loo_rows, measured_drafters, measured_spec_fixes, ranked_fixes,
                                           unprofiled_k_rows)
from decodescope.verdict.variants import drafter_sources, gpu_host_split, replay_rows, variant_rows


def step_attribution(per_step_categories: pd.DataFrame) -> pd.DataFrame:
    """Per rank and class: median time per decode step and its share of the summed time."""
    g = class_time_per_step(per_step_categories).reset_index()
    g["share"] = g["time_per_step_us"] / g.groupby("rank")["time_per_step_us"].transform("sum")
    return g


def bottleneck(attribution: pd.DataFrame) -> tuple[str, float]:
    """The class with the largest share on the median rank, and that share."""
    median_share = attribution.groupby("cls")["share"].median()
    cls = str(median_share.idxmax())
    return cls, float(median_share.max())


def nearest(df: pd.DataFrame, col: str, value: float) -> pd.DataFrame:
    if df is None or df.empty:
        return pd.DataFrame()
    target = df.iloc[(df[col] - value).abs().argsort()[:1]][col].iloc[0]
    return df[df[col] == target]


def reconcile(run_dir: Path, profile_batch: int, summary: Optional[ProfileSummary] = None, arch=None,
              tp: int = 1, weight_dtype: Optional[str] = None) -> pd.DataFrame:
    """Micro-benchmarks against the profile, per decode step, at the batch the profile ran (the
    profile's summary is read from the run directory unless given; 02's GEMMs in the dtype each op is
    served in, model.weight_dtype for the quantized kinds)."""
    rows: list[dict] = []
    summary = summary if summary is not None else _profile_summary(run_dir)
    per_step = frame(summary.per_step_categories, StepCategoryRow) if summary else pd.DataFrame()
    observed_ar = observed_gemm = observed_wait = None
    if not per_step.empty:
        assert summary is not None  # per_step has rows only from a summary's per_step_categories
        by_rank = class_time_per_step(per_step).unstack(fill_value=0.0)
        # the rank that arrives last at each all-reduce waits least: its time is closest to the transfer
        ar_by_rank = per_step[per_step["category"].isin(categorize.ALLREDUCE_CATEGORIES)].groupby("rank")["time_per_step_us"].sum()
        # none in the profile (one GPU: a step issues none): nothing to set 03 against, no row
        observed_ar = float(ar_by_rank.min()) if not ar_by_rank.empty else None
        transfer = summary.allreduce_transfer_us_per_step
        if sm.wait_in_own_op(summary):
            # gloo: each call is an all-reduce op and a wait op; a step pays both (the rank that waits least)
            return _reconcile_wait_in_own_op(run_dir, summary, per_step, ar_by_rank, transfer, profile_batch,
                                             arch, tp, rows, by_rank, weight_dtype)
        if transfer is not None:  # per call, the least time over the ranks: no waiting at all
            observed_wait = allreduce_wait_us(per_step, ar_by_rank.idxmin(), transfer)
            observed_ar = float(transfer)
        observed_gemm = float(by_rank.get("gemm", pd.Series([0.0])).median())
    coll = _read_parquet(run_dir, COLLECTIVES)
    if coll is not None and not coll.empty and observed_ar is not None:
        rows.append(allreduce_reconcile_row(coll, summary, observed_ar, profile_batch, arch, tp, observed_wait))
    return _with_gemm_row(run_dir, rows, profile_batch, observed_gemm, weight_dtype, arch, tp)


def _reconcile_wait_in_own_op(run_dir: Path, summary: ProfileSummary, per_step: pd.DataFrame,
                              ar_by_rank: pd.Series, transfer: Optional[float], profile_batch: int, arch, tp: int,
                              rows: list, by_rank: pd.DataFrame, weight_dtype: Optional[str] = None) -> pd.DataFrame:
    """The all-reduce rows where the wait is an op of its own (gloo).

    The first row is a typical call.
    On the profile's side it is the median call x calls per step.
    That call is its all-reduce op plus its wait op, at its least time over the ranks.
    On 03's side it is the median call back to back, each call timed by itself, among the calls no scheduler
    tick stalled where 03 split them (unstalled_us).
    On a quiet core gloo's TCP loop can spin until the tick while its work thread waits for the core
    (probes.timing.tick_stalls), in up to half of 03's calls: their median then falls among the stalls.
    The engine's busier cores end those spins sooner, so the stalls are the host's, and the step model
    takes them from the profile (stepsample.collectives_as_paid).
    The second row is the calls as a step pays them, on the rank that waits least.
    That includes the ranks' skew and the host's stalls; 03's side is its calls back to back as the step
    model prices them (the unstalled ones, where 03 split them).
    Summaries written before the per-call figure have the second row and the hand-over alone."""
    wait = sm.own_op_wait_by_rank(per_step).reindex(ar_by_rank.index, fill_value=0.0)
    paid = ar_by_rank + wait
    rank = paid.idxmin()
    observed_gemm = float(by_rank.get("gemm", pd.Series([0.0])).median())
    coll = _read_parquet(run_dir, COLLECTIVES)
    calls = summary.allreduce_with_wait
    if coll is None or coll.empty:
        return _with_gemm_row(run_dir, rows, profile_batch, observed_gemm, weight_dtype, arch, tp)
    comm = next(iter(summary.allreduce_communicators), "unknown")
    if calls is not None:
        row = allreduce_reconcile_row(coll, summary, calls.median_us * calls.calls_per_step, profile_batch, arch, tp,
                                      timings=("back_to_back",), statistic="unstalled_us")
        row["profile_source"] = (
            f"profile_summary.json allreduce_with_wait: each call, all-reduce op + its wait op, at its least time over "
            f"the ranks; the median call ({calls.median_us:,.0f} us) x {calls.calls_per_step:g} calls per step")
        row["note"] = (f"same communicator ({comm}); a typical call on both sides, its wait included: 03's median "
                       "call back to back (the ranks arrive together, as at a step's typical call) against the "
                       "profile's median call at its least time over the ranks")
        row["note"] += _tick_stall_note(coll, comm, arch, tp, profile_batch)
        rows.append(row)
    step = allreduce_reconcile_row(coll, summary, float(paid.min()), profile_batch, arch, tp,
                                   timings=sp.WAIT_INCLUDED_TIMINGS, statistic="unstalled_us")
    step["profile_source"] = (f"profile_summary.json per_step_categories, rank {rank} (the one that waits least): "
                              f"all-reduce {float(ar_by_rank[rank]):,.0f} us + its wait op (collective_wait) "
                              f"{float(wait[rank]):,.0f} us per step: on this path a call costs both")
    if calls is not None:
        step["piece"] = f"all-reduces as a step pays them ({comm}), the ranks' skew and the host's stalls in"
        step["note"] = (f"the mean call at its least over the ranks is {calls.mean_us:,.0f} us against the median's "
                        f"{calls.median_us:,.0f} (p90 {calls.p90_us:,.0f} us): calls stalled on both ranks, "
                        f"{(calls.mean_us - calls.median_us) * calls.calls_per_step:,.0f} us per step of the host's "
                        "time, which the step model books to the all-reduces as the engine paid them")
    else:
        step["note"] = (step.get("note", "") + "; the wait is an op of its own here (gloo), so both sides take the "
                        "calls as a step issues them, waits included").lstrip("; ")
    rows.append(step)
    if calls is None and transfer is not None:
        t = allreduce_reconcile_row(coll, summary, float(transfer), profile_batch, arch, tp, timings=("late_rank",))
        t["piece"] = f"all-reduce hand-over only ({comm}), without its wait"
        t["profile_source"] = ("profile_summary.json allreduce_transfer_us_per_step (each call's all-reduce op at "
                               "its least time over the ranks, its wait op left out)")
        t["note"] = "the all-reduce op alone: not what a step pays per call on this path (see the row above)"
        rows.append(t)
    return _with_gemm_row(run_dir, rows, profile_batch, observed_gemm, weight_dtype, arch, tp)


def _tick_stall_note(coll: pd.DataFrame, comm: str, arch, tp: int, batch: int) -> str:
    """What 03's tick split left out of its typical call at the step's message size, or nothing where 03
    did not split its calls."""
    curve = sp.latency_curve(coll, micro_communicator_for(comm), "back_to_back")
    calls = [c for c in archmod.collective_schedule(arch, tp, batch) if c.op == "all_reduce"] if arch else []
    if curve.empty or not calls or "stalled_share" not in curve or curve["stalled_share"].isna().any():
        return ""
    nbytes = calls[0].msg_bytes
    at = curve.iloc[(np.log(curve["bytes"].astype(float)) - np.log(nbytes)).abs().argmin()]
    return (f"; 03's median among its calls no scheduler tick stalled ({float(at['unstalled_us']):,.0f} us at "
            f"{int(at['bytes'])} B, against {float(at['time_us']):,.0f} us over all): {float(at['stalled_share']):.0%} "
            "of its calls lasted half a tick past its fastest, gloo's TCP loop spinning on a quiet core until the "
            "tick; the engine's stalls are the profile's to price")


def _with_gemm_row(run_dir: Path, rows: list, profile_batch: int, observed_gemm: Optional[float],
                   weight_dtype: Optional[str] = None, arch=None, tp: int = 1) -> pd.DataFrame:
    gemm = _read_parquet(run_dir, GEMM)
    if gemm is not None and not gemm.empty:
        ok = gemm[gemm["status"] == "ok"]
        dtype = "bf16" if "bf16" in set(ok["dtype"]) else ok["dtype"].iloc[0]
        served = sp.gemm_rows_as_served(ok, dtype, weight_dtype)
        unbatched = sp.recorded_unbatched(served, archmod.gemm_shapes(arch, tp, profile_batch)) if arch else set()
        per = served[~served["op"].isin(unbatched)].groupby("batch")["step_time_us"].sum().reset_index()
        dtypes = " + ".join(sorted(set(served["dtype"]))) or dtype
        g = nearest(per, "batch", profile_batch)
        if not g.empty:
            row = {"piece": "GEMMs per step", "micro_benchmark_us": float(g["step_time_us"].iloc[0]),
                   "micro_source": f"gemm.parquet, batch {int(g['batch'].iloc[0])}, {dtypes}",
                   "profile_us": observed_gemm, "profile_source": "profile_summary.json per_step_categories"}
            if unbatched:
                row["note"] = (f"left out of the micro-benchmark side: {', '.join(sorted(unbatched))}, measured as "
                               "single GEMMs, which the step runs as one batched GEMM")
            rows.append(row)
    df = pd.DataFrame(rows)
    if not df.empty:
        df["profile_over_micro"] = df["profile_us"] / df["micro_benchmark_us"]
        if "note" not in df:
            df["note"] = ""
        df["note"] = df["note"].fillna("")
    return df


def allreduce_reconcile_row(coll: pd.DataFrame, summary: Optional[ProfileSummary], observed_us: float, batch: int,
                            arch=None, tp: int = 1, wait_us: Optional[float] = None,
                            timings: Optional[tuple] = None, statistic: str = "time_us") -> dict:
    """The step's all-reduces from the micro-benchmark of the communicator the profile saw, like for like.

    The price is calls per step x the latency at the step's message size, from 03's size sweep.
    The latency is timed as a step issues the calls.
    On GPUs that is the CUDA graph timing.
    On CPUs it is the late rank's own time, set against the profile's per-call least time over the ranks.
    Failing that, it is back to back.
    When the sweep lacks the size, the barrier-aligned burst prices it.
    `statistic` is the sweep's column a call is read from (its median call, time_us, unless the sweep
    carries another at every size, as unstalled_us).
    When the probe did not measure that communicator, the row says so and divides nothing."""
    comms = summary.allreduce_communicators if summary else {}
    profile_comm = next(iter(comms), "unknown")
    micro_comm = micro_communicator_for(profile_comm)
    row = {"piece": f"all-reduces per step ({profile_comm})", "profile_us": observed_us,
           "profile_source": ("profile_summary.json allreduce_transfer_us_per_step (each call at its least time over "
                              f"the ranks; the fastest rank also waited {wait_us:,.0f} us per step for the last one)"
                              if wait_us is not None else
                              "profile_summary.json per_step_categories (fastest rank: transfer, least wait)")}
    measured = sorted(set(with_timing_columns(coll)["communicator"].dropna()))
    if micro_comm not in measured:
        return {**row, "micro_benchmark_us": float("nan"), "micro_source": "collectives.parquet",
                "note": f"the profile ran {profile_comm}; the probe measured {measured}, not it: not compared"}
    calls = [c for c in archmod.collective_schedule(arch, tp, batch) if c.op == "all_reduce"] if arch else []
    for timing in (timings or sp.STEP_TIMINGS) if calls and "op" in coll else ():
        curve = sp.latency_curve(coll, micro_comm, timing)
        if not curve.empty:
            col = sp.price_column(curve, statistic)
            us = sum(c.count * sp.latency_at(curve, c.msg_bytes, col)[0] for c in calls)
            n = sum(c.count for c in calls)
            return {**row, "micro_benchmark_us": us,
                    "micro_source": f"collectives.parquet sweep, {micro_comm} {timing}, {n} calls at "
                                    f"{calls[0].msg_bytes} B (batch {batch})",
                    "note": f"same communicator ({micro_comm}) in both, timed as a step issues the calls"}
    burst = with_timing_columns(coll[(coll["part"] == "burst") & (coll["status"] == "ok")])
    mine = burst[burst["communicator"] == micro_comm]
    mode = "cuda_graph" if (mine["mode"] == "cuda_graph").any() else "eager"
    b = nearest(mine[mine["mode"] == mode], "batch", batch)
    return {**row, "micro_benchmark_us": float(b["time_us"].median()),
            "micro_source": f"collectives.parquet burst, {micro_comm}, batch {int(b['batch'].iloc[0])}, {mode}",
            "note": f"same communicator ({micro_comm}); burst aligned by a barrier (no back-to-back sweep)"}


def level_reconcile(levels: pd.DataFrame, summaries: dict[int, ProfileSummary],
                    model: dict[float, tuple[float, float, float]],
                    captures: Optional[dict[int, ProfileCapture]] = None,
                    requests: Optional[pd.DataFrame] = None) -> list[dict]:
    """Per serving level: client TPOT p50 against the nearest profiled level's step period (start to
    start: the step plus the host's time between steps) and the step model's period with its band;
    the residual put down to what the measurements show. Where 04 profiled this concurrency, the
    engine's inter-token latency of its unprofiled run (captures: profile_capture.json per concurrency)
    is set against 01's: the host's drift between the two phases, and the model on 04's own server. With
    01's requests (serving_requests.parquet), the level's own drift while it ran; the model's miss beyond
    leveldrift.MODEL_TARGET is put down to the step's measured movement (leveldrift.model_miss_causes)."""
    rows = []
    served = served_batches(levels)
    quarters = leveldrift.tpot_quarters(requests) if requests is not None else {}
    for lv in levels.sort_values("level").itertuples():
        level = int(lv.level)
        tpot, basis = level_tpot(lv)
        row: dict[str, Any] = {"level": level, "tpot_p50_us": float(lv.tpot_p50_us), "reference_tpot_us": tpot,
                               "reference": basis}
        m = model.get(float(level))
        if m:
            row.update(model_us=m[0], model_low_us=m[1], model_high_us=m[2], model_error=m[0] / tpot - 1)
        itl01, itl04 = _engine_itls(lv, captures)
        ran = served.get(float(level))
        if ran:
            itl04 = None  # 04 ran this concurrency full, 01 at `ran`: two batches, no drift to read
        row.update(engine_itl_us=itl01, profile_engine_itl_us=itl04,
                   window_noise=ProfileCapture.of(captures, level).window_noise)
        if itl01 and itl04:
            row["host_drift"] = itl04 / itl01 - 1
        if m and itl04:
            row["model_error_same_server"] = m[0] / itl04 - 1
        q = quarters.get(level)
        if q:
            row.update(tpot_first_quarter_us=q[0], tpot_last_quarter_us=q[1], in_level_drift=q[1] / q[0] - 1)
        if summaries:
            conc = min(summaries, key=lambda c: (abs(c - level), c))
            ps = summaries[conc].per_step
            ref = ps.period_us_median or ps.wall_us_median
            if ref:
                residual = tpot - ref
                ok = abs(residual) <= LEVEL_TOLERANCE * ref
                causes = []
                if ps.period_us_median is None and ps.idle_us_median and ps.idle_us_median > 0.1 * ref:
                    causes.append(f"scheduler/host time between kernels: {ps.idle_us_median:,.0f} us idle per step (04)")
                coalesced = float(getattr(lv, "itl_coalesced_frac", 0.0) or 0.0)
                if coalesced > 0.1:
                    causes.append(f"stream delivery: {100 * coalesced:.0f}% of token gaps coalesced (01)")
                if ran:
                    causes.append(f"the level ran at batch {ran:g} at most: {ran:g} requests for {level} slots "
                                  "(workload.requests_per_level)")
                if conc != level:
                    causes.append(f"batch {level} vs the nearest profiled level {conc}")
                if abs(row.get("host_drift") or 0.0) > LEVEL_TOLERANCE:
                    causes.append(f"the host's step drifted {100 * row['host_drift']:+.0f}% between 01 and 04 (engine "
                                  f"inter-token latency {itl01:,.0f} vs {itl04:,.0f} us)")
                if not causes:
                    causes.append("the profiler's own cost inflates the profiled step" if residual < 0 else
                                  "client and stream overhead beyond the server's step")
                row.update(profile_batch=conc, profile_wall_us=ps.wall_us_median, profile_period_us=ps.period_us_median,
                           residual_us=residual, within_tolerance=ok, attributed_to="; ".join(causes) if not ok else "")
        rows.append(row)
    return leveldrift.with_model_misses(rows, leveldrift.level_stalls(levels))


def verdict(run_dir: Path, params) -> Verdict:
    run_dir = Path(run_dir)
    summary = _profile_summary(run_dir)
    levels = _read_parquet(run_dir, SERVING_LEVELS)
    out = Verdict()
    if summary and summary.per_step_categories:
        per_step = frame(summary.per_step_categories, StepCategoryRow)
        att = step_attribution(per_step)
        cls, share = bottleneck(att)
        wall = summary.per_step.wall_us_median
        out.attribution = [AttributionRow.model_validate(r) for r in att.to_dict("records")]
        out.bottleneck = Bottleneck(cls=cls, share=share)
        out.wall_us = wall
        out.sources["attribution"] = "profile_summary.json (04_profile)"
        ar_share = summary.allreduce_share_of_time
        out.verdict = (f"{cls} is the largest share of a decode step ({100 * share:.0f}% of op time on the median "
                       f"rank); all-reduce alone is " + ", ".join(f"rank {r} {100 * v:.0f}%" for r, v in ar_share.items())
                       + ".")
    profile_batch = (summary.concurrency or 1) if summary else 1
    out.reconcile = [ReconcileRow.model_validate(r) for r in
                     reconcile(run_dir, profile_batch, summary,
                               archmod.normalize_config(params.model_config_dict()),
                               params.server.tensor_parallel, params.model.weight_dtype).to_dict("records")]
    summaries = profile_summaries(run_dir, params)
    captures = profile_captures(run_dir)
    inp = model_inputs(run_dir, params, summaries, captures)
    sources = drafter_sources(run_dir, params) if params.experiments else {}
    model: dict[float, tuple[float, float, float]] = {}
    if inp is not None:
        drafters = measured_drafters(run_dir, params, sources)
        curve_rows, comp_rows, proj_rows = curves(inp, params, levels, captures,
                                                  more_fixes=lambda b, scale: measured_spec_fixes(inp, b, drafters,
                                                                                                  scale))
        out.spec_k = [SpecKRow.model_validate(r) for r in unprofiled_k_rows(run_dir, params, inp, levels, captures)]
        out.curves = [CurveRow.model_validate(r) for r in curve_rows]
        out.step_model = comp_rows
        out.projections = [ProjectionRow.model_validate(r) for r in proj_rows]
        model = {r["batch"]: (r["tpot_us"], r["tpot_low_us"], r["tpot_high_us"]) for r in curve_rows
                 if r["fix"] == "step model"}
        out.sources["projections"] = ("the step model: gemm.parquet (02), collectives.parquet (03), "
                                      "profile/c*/profile_summary.json (04); calibrated by serving_levels.parquet (01)")
    else:
        out.sources["projections"] = NO_STEP_MODEL
    if levels is not None and not levels.empty:
        out.levels = [LevelReconcileRow.model_validate(r) for r in level_reconcile(
            levels, summaries, model, captures, _read_parquet(run_dir, SERVING_REQUESTS))]
    if params.experiments:
        loo = loo_rows(run_dir, params, inp, levels, captures) if inp is not None else []
        out.variants = [VariantRow.model_validate(r) for r in variant_rows(run_dir, params, inp, levels, captures,
                                                                                      sources, loo)]
    out.replay = [ReplayRow.model_validate(r) for r in replay_rows(run_dir, params, inp)]
    modes = last_engine_modes(Path(run_dir) / "logs" / "server.log")
    out.engine = modes.describe() if modes else ""
    paths = critical_path_records(run_dir)
    out.critical_path = fix_rows(paths, out.projections)
    if inp is not None and out.projections:
        at = int(min(float(p.batch or 1) for p in out.projections))
        out.projections = rank_projections(out.projections, ranked_fixes(run_dir, params, inp, levels, captures, at),
                                           out.critical_path)
    like_for_like = transfer_reconcile_row(out.reconcile, paths, profile_batch)
    if like_for_like is not None:
        out.reconcile.append(like_for_like)
    path_first = _answer_from_path(out, paths, summary)
    out.findings = [Finding.model_validate(f) for f in path_first + findings(out, summary, params.server.tensor_parallel)
                    + critical_path_findings(paths, out.critical_path)]
    if levels is not None and not levels.empty:
        lv = [ServingLevel.model_validate(r) for r in levels.sort_values("level").to_dict("records")]
        out.serving = ServingHeadline(lowest_level=lv[0].level, tpot_p50_us=lv[0].tpot_p50_us,
                                      max_output_tok_s=max((x.output_throughput_tok_s for x in lv
                                                            if x.output_throughput_tok_s == x.output_throughput_tok_s),
                                                           default=float("nan")),
                                      source="serving_levels.parquet (01_serving)")
    return out


def _answer_from_path(out: Verdict, paths: dict, summary: Optional[ProfileSummary]) -> list[dict]:
    """The headline from the wall-clock step where 04 walked its critical path: out.bottleneck and
    out.verdict say what holds the path, the summed op share beside it as context; returns the sentence
    saying which view holds where the two disagree (none where they agree or there is no path)."""
    summed = out.bottleneck
    b = path_bottleneck(paths, summed.cls if summed else None, summed.share if summed else None)
    if b is None:
        return []
    out.bottleneck = b
    context = (f" By summed op time, which overlaps streams and leaves gaps out, {summed.cls} comes first "
               f"({100 * summed.share:.0f}% on the median rank)." if summed else "")
    out.verdict = headline(paths, b) + context
    out.sources["bottleneck"] = f"profile/c{b.level}/critical_path.json (04_profile)"
    ps = summary.per_step if summary else None
    said = disagreement(b, ps.summed_us_median if ps else None, ps.wall_us_median if ps else None)
    files = [f"data/profile/c{b.level}/critical_path.json", "data/profile_summary.json"]
    return [{"topic": "bottleneck", "figure": "profile-critical-path", "files": files, "text": said}] if said else []


def verdict_for_phase(ctx: PhaseContext) -> Verdict:
    """05_verdict's work: the verdict from the run's files, written to data/verdict.json and returned."""
    out = verdict(ctx.run_dir, ctx.params)
    write_record(ctx.run.file(VERDICT), out)
    return out


__all__ = ["allreduce_reconcile_row", "baseline_tpot", "bottleneck", "gpu_host_split", "level_reconcile",
           "LEVEL_TOLERANCE", "ModelInputs", "nearest", "NO_HELP_PCT", "NO_STEP_MODEL", "reconcile",
           "RECONCILE_TOLERANCE", "step_attribution", "verdict", "verdict_for_phase"]
