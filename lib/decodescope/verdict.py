"""The verdict: where a decode step's time goes, how the pieces reconcile, and what would move it.

Inputs are the phases' files in the run directory; each figure says which file it came from. The
result is a records.Verdict, written to data/verdict.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.records import (AttributionRow, Bottleneck, LevelReconcileRow, ProfileSummary, ProjectionRow, ReconcileRow, ServingHeadline,
                                 ServingLevel, Verdict, WhatIfRow, read_record)
from decodescope.trace import categorize


def class_of(category: str) -> str:
    """A category's verdict class, as params/kernel_categories.yaml names it (`other` for unmatched names)."""
    return categorize.class_of(category)


def _read_parquet(run_dir: Path, name: str) -> Optional[pd.DataFrame]:
    p = Path(run_dir) / "data" / name
    return pd.read_parquet(p) if p.is_file() else None


def _profile_summary(run_dir: Path) -> Optional[ProfileSummary]:
    """04_profile's summary; None when the phase did not run, RecordError when it cannot be read."""
    p = Path(run_dir) / "data" / "profile_summary.json"
    return read_record(p, ProfileSummary) if p.is_file() else None


def step_attribution(per_step_categories: pd.DataFrame) -> pd.DataFrame:
    """Per rank and class: median time per decode step and its share of the summed time."""
    df = per_step_categories.assign(cls=per_step_categories["category"].astype(str).map(class_of))
    g = df.groupby(["rank", "cls"])["time_per_step_us"].sum().reset_index()
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
              tp: int = 1) -> pd.DataFrame:
    """Micro-benchmarks against the profile, per decode step, at the batch the profile ran (the
    profile's summary is read from the run directory unless given)."""
    rows = []
    summary = summary if summary is not None else _profile_summary(run_dir)
    per_step = pd.DataFrame(summary.per_step_categories) if summary else pd.DataFrame()
    observed_ar = observed_gemm = None
    if not per_step.empty:
        att = per_step.assign(cls=per_step["category"].map(class_of))
        by_rank = att.groupby(["rank", "cls"])["time_per_step_us"].sum().unstack(fill_value=0.0)
        # the rank that arrives last at each all-reduce waits least: its time is closest to the transfer
        observed_ar = float(att[att["category"].isin(categorize.ALLREDUCE_CATEGORIES)]
                            .groupby("rank")["time_per_step_us"].sum().min())
        observed_gemm = float(by_rank.get("gemm", pd.Series([0.0])).median())
    coll = _read_parquet(run_dir, "collectives.parquet")
    if coll is not None and not coll.empty and observed_ar is not None:
        rows.append(allreduce_reconcile_row(coll, summary, observed_ar, profile_batch, arch, tp))
    gemm = _read_parquet(run_dir, "gemm.parquet")
    if gemm is not None and not gemm.empty:
        ok = gemm[gemm["status"] == "ok"]
        dtype = "bf16" if "bf16" in set(ok["dtype"]) else ok["dtype"].iloc[0]
        per = ok[ok["dtype"] == dtype].groupby("batch")["step_time_us"].sum().reset_index()
        g = nearest(per, "batch", profile_batch)
        if not g.empty:
            rows.append({"piece": "GEMMs per step", "micro_benchmark_us": float(g["step_time_us"].iloc[0]),
                         "micro_source": f"gemm.parquet, batch {int(g['batch'].iloc[0])}, {dtype}",
                         "profile_us": observed_gemm, "profile_source": "profile_summary.json per_step_categories"})
    df = pd.DataFrame(rows)
    if not df.empty:
        df["profile_over_micro"] = df["profile_us"] / df["micro_benchmark_us"]
        if "note" not in df:
            df["note"] = ""
        df["note"] = df["note"].fillna("")
    return df


def allreduce_reconcile_row(coll: pd.DataFrame, summary: ProfileSummary, observed_us: float, batch: int,
                            arch=None, tp: int = 1) -> dict:
    """The step's all-reduces from the micro-benchmark of the communicator the profile saw, like for
    like: calls per step x the latency at the step's message size, timed as a step issues them (CUDA
    graph on GPUs, back to back on CPUs), from 03's size sweep; the barrier-aligned burst when the sweep
    lacks it. When the probe did not measure that communicator the row says so and divides nothing."""
    from decodescope import arch as archmod
    from decodescope import stepmodel as sm
    from decodescope.microbench import with_timing_columns

    comms = summary.allreduce_communicators if summary else {}
    profile_comm = next(iter(comms), "unknown")
    micro_comm = categorize.micro_communicator_for(profile_comm)
    row = {"piece": f"all-reduces per step ({profile_comm})", "profile_us": observed_us,
           "profile_source": "profile_summary.json per_step_categories (fastest rank: transfer, least wait)"}
    measured = sorted(set(with_timing_columns(coll)["communicator"].dropna()))
    if micro_comm not in measured:
        return {**row, "micro_benchmark_us": float("nan"), "micro_source": "collectives.parquet",
                "note": f"the profile ran {profile_comm}; the probe measured {measured}, not it: not compared"}
    calls = [c for c in archmod.collective_schedule(arch, tp, batch) if c.op == "all_reduce"] if arch else []
    for timing in ("cuda_graph", "back_to_back") if calls and "op" in coll else ():
        curve = sm.latency_curve(coll, micro_comm, timing)
        if not curve.empty:
            us = sum(c.count * sm.latency_at(curve, c.msg_bytes)[0] for c in calls)
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


def what_if(wall_us: float, attribution: pd.DataFrame, comm_speedup: float = 2.0) -> pd.DataFrame:
    """Projected decode step if a class got faster, assuming the rest stays serial with it (an upper
    bound on the gain when work overlaps)."""
    med = attribution.groupby("cls")["time_per_step_us"].median()
    rows = []
    for cls, factor, label in (("communication", comm_speedup, f"communication {comm_speedup:g}x faster"),
                               ("communication", np.inf, "communication removed (e.g. one GPU per replica)"),
                               ("gemm", 2.0, "GEMMs 2x faster"), ("attention", 2.0, "attention 2x faster")):
        t = float(med.get(cls, 0.0))
        saved = t - (0.0 if factor == np.inf else t / factor)
        new = max(wall_us - saved, 1e-9)
        rows.append({"what_if": label, "step_us": new, "saved_us": saved, "speedup_x": wall_us / new,
                     "tok_s_per_sequence": 1e6 / new})
    return pd.DataFrame(rows)


def measured_step(summary: ProfileSummary, batch: int) -> Optional["whatif.MeasuredStep"]:
    """The profiled decode step as the what-ifs take it: wall and summed time, and what the step pays
    per all-reduce (median rank, waits included)."""
    from decodescope import whatif

    ps = summary.per_step
    per_step = pd.DataFrame(summary.per_step_categories)
    if per_step.empty or not ps.wall_us_median or not ps.summed_us_median:
        return None
    ar = per_step[per_step["category"].isin(categorize.ALLREDUCE_CATEGORIES)].groupby("rank")[
        ["calls_per_step", "time_per_step_us"]].sum()
    if ar.empty or ar["calls_per_step"].median() <= 0:
        return None
    calls = int(round(ar["calls_per_step"].median()))
    return whatif.MeasuredStep(wall_us=ps.wall_us_median, summed_us=ps.summed_us_median, allreduce_calls=calls,
                               allreduce_us_per_call=float(ar["time_per_step_us"].median()) / calls, batch=batch)


LEVEL_TOLERANCE = 0.20  # client TPOT within 20% of the profiled step counts as agreeing


def level_reconcile(levels: pd.DataFrame, summary: Optional[ProfileSummary], profile_batch: int,
                    model_us: dict[int, float]) -> list[dict]:
    """Per serving level: client TPOT p50 against the profiled step at the nearest profiled batch and
    the step model; the residual put down to what the measurements show (the profile's idle time per
    step: scheduler and host; 01's coalesced gaps: the server holding output back)."""
    rows = []
    wall = summary.per_step.wall_us_median if summary else None
    idle = summary.per_step.idle_us_median if summary else None
    for lv in levels.sort_values("level").itertuples():
        row = {"level": int(lv.level), "tpot_p50_us": float(lv.tpot_p50_us), "model_us": model_us.get(int(lv.level))}
        if wall:
            residual = float(lv.tpot_p50_us) - wall
            ok = abs(residual) <= LEVEL_TOLERANCE * wall
            causes = []
            if idle and idle > 0.1 * wall:
                causes.append(f"scheduler/host time between kernels: {idle:,.0f} us idle per profiled step (04)")
            coalesced = float(getattr(lv, "itl_coalesced_frac", 0.0) or 0.0)
            if coalesced > 0.1:
                causes.append(f"stream delivery: {100 * coalesced:.0f}% of token gaps coalesced (01)")
            if int(lv.level) != profile_batch:
                causes.append(f"batch {int(lv.level)} vs the profiled batch {profile_batch}")
            row.update(profile_batch=profile_batch, profile_wall_us=wall, residual_us=residual, within_tolerance=ok,
                       attributed_to="; ".join(causes) if not ok else "")
        rows.append(row)
    return rows


def step_model_by_level(run_dir: Path, params, levels: pd.DataFrame,
                        summary: Optional[ProfileSummary]) -> dict[int, float]:
    """GEMMs (02) + collectives (03, the engine's communicator if measured) at each level's batch."""
    from decodescope import arch as archmod
    from decodescope import stepmodel as sm

    gemm, coll = _read_parquet(run_dir, "gemm.parquet"), _read_parquet(run_dir, "collectives.parquet")
    if gemm is None or coll is None or gemm.empty or coll.empty:
        return {}
    arch = archmod.normalize_config(params.model_config_dict())
    comm = categorize.micro_communicator_for(next(iter(summary.allreduce_communicators), "") if summary else "")
    out = {}
    for level in levels["level"]:
        for timing in ("cuda_graph", "back_to_back"):
            try:
                g = sm.gemm_component(gemm, arch, params.server.tensor_parallel, int(level))
                c = sm.collective_component(coll, arch, params.server.tensor_parallel, int(level), comm, timing)
            except (ValueError, KeyError):
                continue
            out[int(level)] = g.us + c.us
            break
    return out


def projections(run_dir: Path, params, summary: Optional[ProfileSummary]) -> list[dict]:
    """Each fix priced on the profiled step from what 02/03 measured (decodescope.whatif)."""
    from decodescope import arch as archmod
    from decodescope import whatif

    if summary is None:
        return []
    step = measured_step(summary, params.profile.concurrency)
    coll = _read_parquet(run_dir, "collectives.parquet")
    if step is None or coll is None or coll.empty:
        return []
    gemm = _read_parquet(run_dir, "gemm.parquet")
    arch = archmod.normalize_config(params.model_config_dict())
    profile_comm = next(iter(summary.allreduce_communicators), "unknown")
    return whatif.projection_rows(whatif.measured_projections(step, coll, gemm, arch, params.server.tensor_parallel,
                                                              profile_comm))


def verdict(run_dir: Path, params) -> Verdict:
    from decodescope import arch as archmod

    run_dir = Path(run_dir)
    summary = _profile_summary(run_dir)
    levels = _read_parquet(run_dir, "serving_levels.parquet")
    out = Verdict()
    if summary and summary.per_step_categories:
        per_step = pd.DataFrame(summary.per_step_categories)
        att = step_attribution(per_step)
        cls, share = bottleneck(att)
        wall = summary.per_step.wall_us_median
        out.attribution = [AttributionRow.model_validate(r) for r in att.to_dict("records")]
        out.bottleneck = Bottleneck(cls=cls, share=share)
        out.wall_us = wall
        out.what_if = [WhatIfRow.model_validate(r) for r in what_if(wall, att).to_dict("records")]
        out.sources["attribution"] = "profile_summary.json (04_profile)"
        ar_share = summary.allreduce_share_of_time
        out.verdict = (f"{cls} is the largest share of a decode step ({100 * share:.0f}% of op time on the median "
                       f"rank); all-reduce alone is " + ", ".join(f"rank {r} {100 * v:.0f}%" for r, v in ar_share.items())
                       + ".")
    out.reconcile = [ReconcileRow.model_validate(r) for r in
                     reconcile(run_dir, params.profile.concurrency, summary,
                               archmod.normalize_config(params.model_config_dict()),
                               params.server.tensor_parallel).to_dict("records")]
    out.projections = [ProjectionRow.model_validate(r) for r in projections(run_dir, params, summary)]
    if levels is not None and not levels.empty:
        out.levels = [LevelReconcileRow.model_validate(r) for r in
                      level_reconcile(levels, summary, params.profile.concurrency,
                                      step_model_by_level(run_dir, params, levels, summary))]
    if out.projections:
        out.sources["projections"] = ("profile_summary.json (04) for the measured step; collectives.parquet (03) "
                                      "and gemm.parquet (02) for the changed pieces")
    if levels is not None and not levels.empty:
        lv = [ServingLevel.model_validate(r) for r in levels.sort_values("level").to_dict("records")]
        out.serving = ServingHeadline(lowest_level=lv[0].level, tpot_p50_us=lv[0].tpot_p50_us,
                                      max_output_tok_s=max((x.output_throughput_tok_s for x in lv
                                                            if x.output_throughput_tok_s == x.output_throughput_tok_s),
                                                           default=float("nan")),
                                      source="serving_levels.parquet (01_serving)")
    return out
