"""The verdict: where a decode step's time goes, how the pieces reconcile, and what would move it.

Inputs are the phases' files in the run directory; each figure says which file it came from. The
result is a records.Verdict, written to data/verdict.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.records import (AttributionRow, Bottleneck, CurveRow, Finding, ReplayRow, VariantRow, LevelReconcileRow, ProfileSummary, ProjectionRow, ReconcileRow, ServingHeadline,
                                 ServingLevel, Verdict, read_record)
from decodescope import whatif
from decodescope.enginelog import last_engine_modes
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
    from decodescope import stepmodel as sm

    rows = []
    summary = summary if summary is not None else _profile_summary(run_dir)
    per_step = pd.DataFrame(summary.per_step_categories) if summary else pd.DataFrame()
    observed_ar = observed_gemm = observed_wait = None
    if not per_step.empty:
        att = per_step.assign(cls=per_step["category"].map(class_of))
        by_rank = att.groupby(["rank", "cls"])["time_per_step_us"].sum().unstack(fill_value=0.0)
        # the rank that arrives last at each all-reduce waits least: its time is closest to the transfer
        ar_by_rank = att[att["category"].isin(categorize.ALLREDUCE_CATEGORIES)].groupby("rank")["time_per_step_us"].sum()
        # none in the profile (one GPU: a step issues none): nothing to set 03 against, no row
        observed_ar = float(ar_by_rank.min()) if not ar_by_rank.empty else None
        transfer = summary.allreduce_transfer_us_per_step
        if sm.wait_in_own_op(summary):
            # gloo: each call is an all-reduce op and a wait op; a step pays both (the rank that waits least)
            return _reconcile_wait_in_own_op(run_dir, summary, per_step, ar_by_rank, transfer, profile_batch,
                                             arch, tp, rows, by_rank)
        if transfer is not None:  # per call, the least time over the ranks: no waiting at all
            from decodescope.stepmodel import allreduce_wait_us

            observed_wait = allreduce_wait_us(per_step, ar_by_rank.idxmin(), transfer)
            observed_ar = float(transfer)
        observed_gemm = float(by_rank.get("gemm", pd.Series([0.0])).median())
    coll = _read_parquet(run_dir, "collectives.parquet")
    if coll is not None and not coll.empty and observed_ar is not None:
        rows.append(allreduce_reconcile_row(coll, summary, observed_ar, profile_batch, arch, tp, observed_wait))
    return _with_gemm_row(run_dir, rows, profile_batch, observed_gemm)


def _reconcile_wait_in_own_op(run_dir: Path, summary: ProfileSummary, per_step: pd.DataFrame,
                              ar_by_rank: pd.Series, transfer: Optional[float], profile_batch: int, arch, tp: int,
                              rows: list, by_rank: pd.DataFrame) -> pd.DataFrame:
    """The all-reduce rows where the wait is an op of its own (gloo): a step's calls (all-reduce op plus
    wait op, on the rank that waits least) against 03's calls back to back, waits included; then the
    hand-over alone (each call's least time over the ranks against the late rank's op), named for what it is."""
    from decodescope import stepmodel as sm

    wait = sm.own_op_wait_by_rank(per_step).reindex(ar_by_rank.index, fill_value=0.0)
    paid = ar_by_rank + wait
    rank = paid.idxmin()
    observed_gemm = float(by_rank.get("gemm", pd.Series([0.0])).median())
    coll = _read_parquet(run_dir, "collectives.parquet")
    if coll is not None and not coll.empty:
        row = allreduce_reconcile_row(coll, summary, float(paid.min()), profile_batch, arch, tp,
                                      timings=sm.WAIT_INCLUDED_TIMINGS)
        row["profile_source"] = (f"profile_summary.json per_step_categories, rank {rank} (the one that waits least): "
                                 f"all-reduce {float(ar_by_rank[rank]):,.0f} us + its wait op (collective_wait) "
                                 f"{float(wait[rank]):,.0f} us per step: on this path a call costs both")
        row["note"] = (row.get("note", "") + "; the wait is an op of its own here (gloo), so both sides take the calls "
                       "as a step issues them, waits included").lstrip("; ")
        rows.append(row)
        if transfer is not None:
            t = allreduce_reconcile_row(coll, summary, float(transfer), profile_batch, arch, tp, timings=("late_rank",))
            comm = next(iter(summary.allreduce_communicators), "unknown")
            t["piece"] = f"all-reduce hand-over only ({comm}), without its wait"
            t["profile_source"] = ("profile_summary.json allreduce_transfer_us_per_step (each call's all-reduce op at "
                                   "its least time over the ranks, its wait op left out)")
            t["note"] = "the all-reduce op alone: not what a step pays per call on this path (see the row above)"
            rows.append(t)
    return _with_gemm_row(run_dir, rows, profile_batch, observed_gemm)


def _with_gemm_row(run_dir: Path, rows: list, profile_batch: int, observed_gemm: Optional[float]) -> pd.DataFrame:
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
                            arch=None, tp: int = 1, wait_us: Optional[float] = None,
                            timings: Optional[tuple] = None) -> dict:
    """The step's all-reduces from the micro-benchmark of the communicator the profile saw, like for
    like: calls per step x the latency at the step's message size, timed as a step issues them (CUDA
    graph on GPUs; on CPUs the late rank's own time, set against the profile's per-call least time over
    the ranks, else back to back), from 03's size sweep; the barrier-aligned burst when the sweep
    lacks it. When the probe did not measure that communicator the row says so and divides nothing."""
    from decodescope import arch as archmod
    from decodescope import stepmodel as sm
    from decodescope.microbench import with_timing_columns

    comms = summary.allreduce_communicators if summary else {}
    profile_comm = next(iter(comms), "unknown")
    micro_comm = categorize.micro_communicator_for(profile_comm)
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
    for timing in (timings or sm.STEP_TIMINGS) if calls and "op" in coll else ():
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


def measured_step(summary: ProfileSummary, batch: int) -> "Optional[whatif.MeasuredStep]":
    """The profiled decode step as the what-ifs take it: wall and summed time, and what the step pays
    per all-reduce (median rank, waits included)."""
    ps = summary.per_step
    per_step = pd.DataFrame(summary.per_step_categories)
    if per_step.empty or not ps.wall_us_median or not ps.summed_us_median:
        return None
    ar = per_step[per_step["category"].isin(categorize.ALLREDUCE_CATEGORIES)].groupby("rank")[
        ["calls_per_step", "time_per_step_us"]].sum()
    if ar.empty or ar["calls_per_step"].median() <= 0:
        return None
    from decodescope import stepmodel as sm

    if sm.wait_in_own_op(summary):  # gloo: a call pays its wait op too
        ar["time_per_step_us"] += sm.own_op_wait_by_rank(per_step).reindex(ar.index, fill_value=0.0)
    calls = int(round(ar["calls_per_step"].median()))
    return whatif.MeasuredStep(wall_us=ps.wall_us_median, summed_us=ps.summed_us_median, allreduce_calls=calls,
                               allreduce_us_per_call=float(ar["time_per_step_us"].median()) / calls, batch=batch)


LEVEL_TOLERANCE = 0.20  # client TPOT within 20% of the profiled step counts as agreeing
COALESCED_LIMIT = 0.5   # above this share of coalesced token gaps, client TPOT describes delivery, not steps


def level_tpot(lv) -> tuple[float, str]:
    """A level's TPOT for setting against the step: the client's p50, unless the server released most
    tokens in bursts (01's coalesced gaps), which makes the client's TPOT describe delivery; then the
    engine's own mean TPOT from its metrics (vllm:request_time_per_output_token, 01's telemetry)."""
    coalesced = float(getattr(lv, "itl_coalesced_frac", 0.0) or 0.0)
    server = getattr(lv, "server_tpot_mean_us", None)
    if coalesced > COALESCED_LIMIT and server is not None and server == server and server > 0:
        return float(server), (f"server TPOT (vllm metrics): {100 * coalesced:.0f}% of the client's token gaps "
                               "coalesced, so its TPOT describes stream delivery")
    return float(lv.tpot_p50_us), "client TPOT p50"


def level_reconcile(levels: pd.DataFrame, summaries: dict[int, ProfileSummary],
                    model: dict[float, tuple[float, float, float]],
                    captures: Optional[dict[int, dict]] = None) -> list[dict]:
    """Per serving level: client TPOT p50 against the nearest profiled level's step period (start to
    start: the step plus the host's time between steps) and the step model's period with its band;
    the residual put down to what the measurements show. Where 04 profiled this concurrency, the
    engine's inter-token latency of its unprofiled run (captures: profile_capture.json per concurrency)
    is set against 01's: the host's drift between the two phases, and the model on 04's own server."""
    rows = []
    for lv in levels.sort_values("level").itertuples():
        level = int(lv.level)
        tpot, basis = level_tpot(lv)
        row = {"level": level, "tpot_p50_us": float(lv.tpot_p50_us), "reference_tpot_us": tpot, "reference": basis}
        m = model.get(float(level))
        if m:
            row.update(model_us=m[0], model_low_us=m[1], model_high_us=m[2], model_error=m[0] / tpot - 1)
        itl01, itl04 = _engine_itls(lv, captures)
        row.update(engine_itl_us=itl01, profile_engine_itl_us=itl04,
                   window_noise=(captures or {}).get(level, {}).get("window_noise"))
        if itl01 and itl04:
            row["host_drift"] = itl04 / itl01 - 1
        if m and itl04:
            row["model_error_same_server"] = m[0] / itl04 - 1
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
    return rows


def projections(run_dir: Path, params, summary: Optional[ProfileSummary]) -> list[dict]:
    """Each fix priced on the profiled step from what 02/03 measured (decodescope.whatif)."""
    from decodescope import arch as archmod
    if summary is None:
        return []
    step = measured_step(summary, summary.concurrency or 1)
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
        out.sources["attribution"] = "profile_summary.json (04_profile)"
        ar_share = summary.allreduce_share_of_time
        out.verdict = (f"{cls} is the largest share of a decode step ({100 * share:.0f}% of op time on the median "
                       f"rank); all-reduce alone is " + ", ".join(f"rank {r} {100 * v:.0f}%" for r, v in ar_share.items())
                       + ".")
    profile_batch = (summary.concurrency or 1) if summary else 1
    out.reconcile = [ReconcileRow.model_validate(r) for r in
                     reconcile(run_dir, profile_batch, summary,
                               archmod.normalize_config(params.model_config_dict()),
                               params.server.tensor_parallel).to_dict("records")]
    summaries = profile_summaries(run_dir, params)
    captures = profile_captures(run_dir)
    inp = model_inputs(run_dir, params, summaries, captures)
    model: dict[float, tuple[float, float, float]] = {}
    if inp is not None:
        curve_rows, comp_rows, proj_rows = curves(inp, params, levels, captures)
        out.curves = [CurveRow.model_validate(r) for r in curve_rows]
        out.step_model = comp_rows
        out.projections = [ProjectionRow.model_validate(r) for r in proj_rows]
        model = {r["batch"]: (r["tpot_us"], r["tpot_low_us"], r["tpot_high_us"]) for r in curve_rows
                 if r["fix"] == "step model"}
        out.sources["projections"] = ("the step model: gemm.parquet (02), collectives.parquet (03), "
                                      "profile/c*/profile_summary.json (04); calibrated by serving_levels.parquet (01)")
    else:
        out.projections = [ProjectionRow.model_validate(r) for r in projections(run_dir, params, summary)]
        if out.projections:
            out.sources["projections"] = ("profile_summary.json (04) for the measured step; collectives.parquet (03) "
                                          "and gemm.parquet (02) for the changed pieces")
    if levels is not None and not levels.empty:
        out.levels = [LevelReconcileRow.model_validate(r) for r in level_reconcile(levels, summaries, model,
                                                                                      captures)]
    if params.experiments:
        out.variants = [VariantRow.model_validate(r) for r in variant_rows(run_dir, params, inp, levels, captures)]
    out.replay = [ReplayRow.model_validate(r) for r in replay_rows(run_dir, params, inp)]
    modes = last_engine_modes(Path(run_dir) / "logs" / "server.log")
    out.engine = modes.describe() if modes else ""
    out.findings = [Finding.model_validate(f) for f in findings(out, summary, params.server.tensor_parallel)]
    if levels is not None and not levels.empty:
        lv = [ServingLevel.model_validate(r) for r in levels.sort_values("level").to_dict("records")]
        out.serving = ServingHeadline(lowest_level=lv[0].level, tpot_p50_us=lv[0].tpot_p50_us,
                                      max_output_tok_s=max((x.output_throughput_tok_s for x in lv
                                                            if x.output_throughput_tok_s == x.output_throughput_tok_s),
                                                           default=float("nan")),
                                      source="serving_levels.parquet (01_serving)")
    return out


# ---- the step model at every level, and the fixes as curves --------------------------------------------
def profile_summaries(run_dir: Path, params) -> dict[int, ProfileSummary]:
    """Every profiled level's summary (data/profile/c<N>/), or the one in data/ for a run profiled at
    one level before levels existed."""
    from decodescope.params import KNEE

    out = {}
    for p in sorted((Path(run_dir) / "data" / "profile").glob("c*/profile_summary.json")):
        s = read_record(p, ProfileSummary)
        out[int(s.concurrency or p.parent.name[1:])] = s
    if not out:
        s = _profile_summary(run_dir)
        if s is not None:
            first = next((c for c in params.profile.concurrency if c != KNEE), 1)
            out[int(s.concurrency or first)] = s
    return out


def _positive(x) -> Optional[float]:
    return float(x) if x is not None and x == x and x > 0 else None


def _engine_itls(lv, captures: Optional[dict[int, dict]]) -> tuple[Optional[float], Optional[float]]:
    """A serving level's engine inter-token latency on the baseline's two server starts: 01's (its
    telemetry) and 04's unprofiled run at that concurrency (profile_capture.json), each None when absent."""
    cap = (captures or {}).get(int(lv.level), {})
    return _positive(getattr(lv, "server_itl_mean_us", None)), _positive(cap.get("engine_itl_unprofiled_us"))


def host_cores(run_dir: Path) -> Optional[int]:
    """The logical CPU cores of the host the server ran on (host.json), when recorded."""
    from decodescope.records import HostInventory, read_record

    path = Path(run_dir) / "data" / "host.json"
    return read_record(path, HostInventory).cpu.logical_cores if path.is_file() else None


def profile_captures(run_dir: Path) -> dict[int, dict]:
    """Concurrency -> each profiled level's profile_capture.json."""
    out = {}
    for p in sorted((Path(run_dir) / "data" / "profile").glob("c*/profile_capture.json")):
        cap = json.loads(p.read_text())
        out[int(cap.get("concurrency") or p.parent.name[1:])] = cap
    return out


@dataclass
class ModelInputs:
    gemm: pd.DataFrame
    gemm_tp: Optional[pd.DataFrame]
    coll: pd.DataFrame
    arch: object
    tp: int
    communicator: str
    timing: str
    samples: list
    serving_context_tokens: float
    host_cores: Optional[int] = None

    def predict(self, batch: float, **kw):
        from decodescope import stepmodel as sm

        return sm.predict_step(self.gemm, self.coll, self.arch, self.tp, int(round(batch)), self.communicator,
                               self.timing, self.samples, self.serving_context_tokens, **kw)

    def at_tensor_parallel(self, t: int, batch: float) -> Optional["Fix"]:
        """Tensor-parallel t with replicas keeping the rank count: GEMMs at t's shapes (02's what-if
        table), attention x tp / t, collectives extrapolated from 03's world size; None when 02 did not
        measure t's GEMMs."""
        from decodescope import stepmodel as sm

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


def model_inputs(run_dir: Path, params, summaries: dict[int, ProfileSummary],
                 captures: dict[int, dict]) -> Optional[ModelInputs]:
    """What the step model needs from 02, 03 and 04 (captures: profile_captures); None when 02 or 03
    did not run, or 03 did not measure an all-reduce the model can use."""
    from decodescope import arch as archmod
    from decodescope import stepmodel as sm
    from decodescope.microbench import GEMM_WHATIF_TP

    gemm, coll = _read_parquet(run_dir, "gemm.parquet"), _read_parquet(run_dir, "collectives.parquet")
    tp = params.server.tensor_parallel
    if gemm is None or gemm.empty or ((coll is None or coll.empty) and tp > 1):
        return None
    primary = summaries[min(summaries)] if summaries else None
    engine_comm = categorize.micro_communicator_for(next(iter(primary.allreduce_communicators), "")
                                                    if primary else "")
    prof, wl = params.profile, params.workload
    samples = sm.step_samples(summaries, prof.input_tokens + prof.output_tokens / 2, captures)
    comm, timing = engine_comm, "back_to_back"
    if coll is not None and not coll.empty:
        measured = [c for c in sorted(set(coll["communicator"].dropna()))]
        comm = engine_comm if engine_comm in measured else (measured[0] if measured else engine_comm)
        timings = sm.step_timings(sm.wait_in_own_op(primary))
        timing = next((t for t in timings if not sm.latency_curve(coll, comm, t).empty), "")
        if not timing:
            return None
    return ModelInputs(gemm=gemm, gemm_tp=_read_parquet(run_dir, GEMM_WHATIF_TP), coll=coll if coll is not None
                       else pd.DataFrame(), arch=archmod.normalize_config(params.model_config_dict()), tp=tp,
                       communicator=comm, timing=timing, samples=samples,
                       serving_context_tokens=wl.input_tokens + wl.output_tokens / 2, host_cores=host_cores(run_dir))


@dataclass
class Fix:
    name: str
    prediction: object          # stepmodel.StepPrediction
    tokens_per_step: float = 1.0
    gpus_per_replica: int = 1
    assumptions: list = field(default_factory=list)


def fixes_at(inp: ModelInputs, batch: float, params) -> list[Fix]:
    """Every fix the measured inputs price at `batch`, each as a whole predicted step."""
    from decodescope import stepmodel as sm
    from decodescope import arch as archmod

    out = []
    tp = inp.tp
    calls = [c for c in archmod.collective_schedule(inp.arch, tp, int(batch)) if c.op == "all_reduce"]
    n_ar = sum(c.count for c in calls)
    if tp > 1 and not inp.coll.empty:
        for comm in sorted(set(inp.coll["communicator"].dropna()) - {inp.communicator}):
            timing = next((t for t in sm.STEP_TIMINGS if not sm.latency_curve(inp.coll, comm, t).empty), None)
            if timing is None:
                continue
            c = sm.collective_component(inp.coll, inp.arch, tp, int(batch), comm, timing)
            out.append(Fix(f"all-reduce through {comm}", inp.predict(batch, collectives=c), 1.0, tp,
                           [f"every collective priced from 03's {comm} curve ({timing})"]))
        for lat in params.whatif.allreduce_us:
            c = sm.Component("collectives", n_ar * lat, n_ar * lat, n_ar * lat, "whatif.allreduce_us (params)")
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
            tokens = whatif.expected_tokens_per_verify(k, alpha)
            out.append(Fix(f"speculative decoding k={k}, alpha={alpha:g}", verify, tokens, tp, [
                f"verify step = the step model at batch {batch:g} x {k + 1}; {tokens:.2f} tokens per verify step "
                "((1 - a^(k+1)) / (1 - a)); n-gram drafting, cost ~0"]))
    g = inp.predict(batch).components[0]
    half = sm.Component("gemm", g.us / 2, g.low_us / 2, g.high_us / 2, g.source, ["every GEMM twice as fast"])
    out.append(Fix("GEMMs 2x faster", _with_component(inp.predict(batch), half), 1.0, tp,
                   ["every GEMM of the step at half its measured time (02); nothing else changes"]))
    for t in params.projected_tensor_parallel():
        fix = inp.at_tensor_parallel(t, batch) if t != tp else None
        if fix is not None:
            out.append(fix)
    return out


def _with_component(pred, comp):
    """The prediction with one component (by name) replaced."""
    from dataclasses import replace as dc_replace

    return dc_replace(pred, components=[comp if c.name == comp.name else c for c in pred.components])


def baseline_tpot(levels: Optional[pd.DataFrame], captures: Optional[dict[int, dict]] = None) -> dict[float, float]:
    """The baseline's TPOT per serving level, as fixes and variants are calibrated by it: 01's
    (level_tpot), and where 04 also ran that concurrency unprofiled, the mean of the two server starts
    (01's TPOT x the mean of 1 and 04's engine ITL / 01's). Each start of one server reads differently
    on a small host (host_drift up to ~30% on two cores), and a projection calibrated by one start
    carries that start's draw."""
    out: dict[float, float] = {}
    if levels is None or levels.empty:
        return out
    for lv in levels.sort_values("level").itertuples():
        tpot = level_tpot(lv)[0]
        itl01, itl04 = _engine_itls(lv, captures)
        out[float(lv.level)] = tpot * (1 + itl04 / itl01) / 2 if itl01 and itl04 else tpot
    return out


def curves(inp: ModelInputs, params, levels: Optional[pd.DataFrame], captures: Optional[dict[int, dict]] = None
           ) -> tuple[list[dict], list[dict], list[dict]]:
    """TPOT vs output tokens/s per GPU: the measured sweep, the step model, and every fix, at each
    serving level (and profiled batch). A fix's TPOT is calibrated where the sweep measured the batch:
    the baseline's TPOT (baseline_tpot: 01's, with 04's start where it ran that level) x fix / base
    model, so the model's own error cancels; elsewhere it is the model's.
    Returns (curve rows, step-model component rows, projection rows at the lowest level)."""
    tp = inp.tp
    measured = {}
    if levels is not None and not levels.empty:
        for lv in levels.sort_values("level").itertuples():
            measured[float(lv.level)] = level_tpot(lv)[0]
    calibration = baseline_tpot(levels, captures)
    batches = sorted(set(measured) | {s.batch for s in inp.samples}) or [1.0]
    rows, comps, proj = [], [], []
    for b, t in measured.items():
        rows.append({"fix": "measured (01)", "batch": b, "tpot_us": t, "tpot_low_us": t, "tpot_high_us": t,
                     "tok_s_per_gpu": b * 1e6 / t / tp})
    lowest = min(measured) if measured else batches[0]
    for b in batches:
        base = inp.predict(b)
        lo, hi = base.band_us
        rows.append({"fix": "step model", "batch": b, "tpot_us": base.period_us, "tpot_low_us": lo, "tpot_high_us": hi,
                     "tok_s_per_gpu": b * 1e6 / base.period_us / tp, "model_us": base.period_us})
        comps += [{"batch": b, **r} for r in base.table().to_dict("records")]
        scale = calibration.get(b, base.period_us) / base.period_us
        for f in fixes_at(inp, b, params):
            flo, fhi = f.prediction.band_us
            tpot = f.prediction.period_us / f.tokens_per_step * scale
            row = {"fix": f.name, "batch": b, "tpot_us": tpot, "tpot_low_us": flo / f.tokens_per_step * scale,
                   "tpot_high_us": fhi / f.tokens_per_step * scale,
                   "tok_s_per_gpu": b * 1e6 / tpot / f.gpus_per_replica, "model_us": f.prediction.period_us,
                   "calibrated": b in measured, "notes": "; ".join(f.assumptions)}
            rows.append(row)
            if b == lowest:
                ref = calibration.get(b, base.period_us)  # the fix against the baseline it is calibrated by
                proj.append({"fix": f.name, "step_us": f.prediction.period_us * scale, "low_us": flo * scale,
                             "high_us": fhi * scale, "tokens_per_step": f.tokens_per_step, "tpot_us": tpot,
                             "tpot_low_us": row["tpot_low_us"], "tpot_high_us": row["tpot_high_us"],
                             "gain_pct": 100 * (tpot / ref - 1), "batch": b, "tok_s_per_gpu": row["tok_s_per_gpu"],
                             "gpus_per_replica": f.gpus_per_replica,
                             "assumptions": "; ".join(f.assumptions + ([f"calibrated: x {scale:.2f} (baseline TPOT / "
                                                                        "base model at this level)"] if b in measured else []))})
    return rows, comps, sorted(proj, key=lambda r: r["gain_pct"])


RECONCILE_TOLERANCE = 0.30  # micro-benchmark vs profile per step: within 30% counts as agreeing
NO_HELP_PCT = -5.0          # a fix projected to gain less than 5% of TPOT "would not help"


def findings(v: Verdict, summary: Optional[ProfileSummary], tp: int) -> list[dict]:
    """The campaign's reasoning, sentence by sentence, each with the figure and files it reads."""
    out = []
    prof = ["data/profile_summary.json"]
    if v.bottleneck and summary:
        ar = ", ".join(f"rank {r} {100 * x:.0f}%" for r, x in summary.allreduce_share_of_time.items())
        out.append({"topic": "bottleneck", "figure": "profile-breakdown", "files": prof, "text":
                    f"The largest share of a decode step is {v.bottleneck.cls}: {100 * v.bottleneck.share:.0f}% of op time "
                    f"on the median rank; all-reduce alone takes {ar} of all op time."})
        exp = pd.DataFrame(summary.expected_vs_observed)
        if not exp.empty and "observed_per_step" in exp:
            for r in exp[exp["rank"] == exp["rank"].min()].itertuples():
                op, observed, expected = r.collective, r.observed_per_step, r.expected_per_step
                if expected is not None and expected == expected:
                    per_call = summary.allreduce_mean_us.get(str(getattr(r, "rank", 0)))
                    out.append({"topic": "bottleneck", "figure": "profile-expected", "files": prof, "text":
                                f"{op}: {observed:g} calls per step against {expected:g} the architecture issues at "
                                f"tensor-parallel {tp}" + (f"; {per_call:.1f} us per call in the step" if per_call and
                                                            op == "all_reduce" else "") + "."})
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
    for r in v.reconcile:
        ratio = r.profile_over_micro
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
    if v.replay:
        ok = [r for r in v.replay if abs(r.error) <= REPLAY_TOLERANCE]
        worst = max(v.replay, key=lambda r: abs(r.error))
        out.append({"topic": "consistency", "figure": "verdict-replay", "files": [
            "data/step_replay.parquet", "data/gemm.parquet", "data/collectives.parquet"],
            "text": f"The step replayed without the framework (03) against the step model's GEMMs + collectives: "
                    f"within {100 * REPLAY_TOLERANCE:.0f}% at {len(ok)} of {len(v.replay)} (batch, mode); the "
                    f"worst, batch {worst.batch} {worst.mode}: {worst.predicted_us / 1e3:.2f} ms predicted vs "
                    f"{worst.replay_us / 1e3:.2f} ms replayed ({100 * worst.error:+.0f}%)."})
    if v.levels:
        with_model = [lv for lv in v.levels if lv.model_error is not None]
        if with_model:
            ok = [lv for lv in with_model if abs(lv.model_error) <= LEVEL_TOLERANCE]
            first = with_model[0]
            out.append({"topic": "consistency", "figure": "verdict-levels", "files": [
                "data/serving_levels.parquet", "data/gemm.parquet", "data/collectives.parquet", "data/profile/"],
                "text": f"The step model is within {100 * LEVEL_TOLERANCE:.0f}% of the measured TPOT at {len(ok)} of "
                        f"{len(with_model)} serving levels; at concurrency {first.level}: {first.model_us / 1e3:.2f} ms "
                        f"predicted vs {(first.reference_tpot_us or first.tpot_p50_us) / 1e3:.2f} ms measured "
                        f"({100 * first.model_error:+.0f}%; {first.reference or 'client TPOT p50'})"
                        + (f"; against the engine's step on 04's own server, where the model's profile inputs were "
                           f"measured ({first.profile_engine_itl_us / 1e3:.2f} ms): {100 * first.model_error_same_server:+.0f}%, "
                           f"the host's step having drifted {100 * first.host_drift:+.0f}% between 01 and 04"
                           if first.model_error_same_server is not None and first.host_drift is not None else "")
                        + "."})
    from decodescope.stepmodel import PREEMPTED

    pre = [c for c in v.step_model if c["component"] == PREEMPTED and c["us"] > 0]
    if pre:
        c = pre[0]
        step = sum(x["us"] for x in v.step_model if x["batch"] == c["batch"] and x["us"] > 0)
        out.append({"topic": "host", "figure": "verdict-levels", "files": [
            f"data/{c['source'].split(';')[0].split(' ')[0]}"],
            "text": f"At batch {c['batch']:g} the workers waited {c['us']:,.0f} us per step for a core the host's "
                    f"other processes (engine core, API server) held: {100 * c['us'] / step:.0f}% of the modelled "
                    "step (/proc schedstat over 04's unprofiled run); a configuration that leaves them a core "
                    "sheds it."})
    measured = {}
    for r in v.variants:
        if r.status != "ok" or r.measured_gain_pct is None:
            continue
        if r.variant not in measured or (r.level or 0) < (measured[r.variant].level or 0):
            measured[r.variant] = r  # the lowest level each variant shares with the baseline
    for r in sorted(measured.values(), key=lambda r: r.measured_gain_pct):
        proj = (f"; projected {r.projected_tpot_us / 1e3:.2f} ms ({r.projection}), {r.projection_error_pct:+.0f}% off"
                if r.projected_tpot_us else f"; no projection ({r.notes})" if r.notes else "")
        out.append({"topic": "measured", "figure": "verdict-variants", "files": [f"variants/{r.variant}/data/serving_levels.parquet"],
                    "text": f"Variant {r.variant}{' (' + r.engine_modes + ')' if r.engine_modes else ''}, measured: "
                            f"TPOT {r.measured_gain_pct:+.0f}% at concurrency {r.level} "
                            f"({r.tpot_p50_us / 1e3:.2f} ms vs {r.baseline_tpot_p50_us / 1e3:.2f} ms){proj}"
                            f"{'. ' + r.gpu_host_split[0].upper() + r.gpu_host_split[1:] if r.gpu_host_split else ''}."})
    for r in [r for r in v.variants if r.status != "ok" and r.level is None]:
        out.append({"topic": "measured", "figure": "verdict-variants", "files": ["manifest.json"],
                    "text": f"Variant {r.variant} {r.status}: {r.error}"})
    helps = [p for p in v.projections if p.gain_pct < NO_HELP_PCT]
    for p in helps[:3]:
        out.append({"topic": "fix", "figure": "verdict-fixes", "files": ["data/verdict.json"], "text":
                    f"{p.fix}: TPOT {p.gain_pct:+.0f}% ({p.tpot_low_us / 1e3:.2f}-{p.tpot_high_us / 1e3:.2f} ms) at "
                    f"batch {p.batch or 1:g}."})
    for p in [p for p in v.projections if p.gain_pct >= NO_HELP_PCT]:
        out.append({"topic": "no_help", "figure": "verdict-fixes", "files": ["data/verdict.json"],
                    "text": f"Would not help: {p.fix}: {p.gain_pct:+.0f}%."})
    return out


# ---- the variants (params.experiments), measured against their projections ----------------------------
def _spec_config(engine_args: dict) -> Optional[dict]:
    import json as _json

    raw = engine_args.get("speculative-config") or engine_args.get("speculative_config")
    if raw is None:
        return None
    try:
        return raw if isinstance(raw, dict) else _json.loads(raw)
    except ValueError:
        return None


def _acceptance(levels: pd.DataFrame) -> tuple[Optional[float], bool]:
    """(per drafted token acceptance, anything drafted) from the variant's server telemetry (01):
    vllm:spec_decode_num_accepted_tokens / num_draft_tokens over each level, median over levels."""
    col = "server_spec_acceptance_pct"
    if col not in levels:
        return None, False
    v = levels[col].dropna()
    return (float(v.median()) / 100.0, True) if len(v) else (None, False)


def variant_fix(inp: ModelInputs, params, vparams, exp, batch: float, acceptance: tuple) -> tuple[Optional[Fix], str]:
    """The verdict's projection of what this variant changes, at `batch`; (None, why) when there is none."""
    from decodescope import stepmodel as sm
    ea = vparams.server.engine_args
    tp, vtp = inp.tp, vparams.server.tensor_parallel
    if vtp != tp:
        fix = inp.at_tensor_parallel(vtp, batch)
        return (fix, "") if fix is not None else (None, f"02 did not measure the GEMMs at tensor-parallel {vtp}")
    spec = _spec_config(ea)
    if spec is not None:
        k = int(spec.get("num_speculative_tokens", 1))
        alpha, drafted = acceptance
        if alpha is None:
            # nothing was drafted (e.g. n-gram on text that never repeats): every step is a plain step
            return Fix(f"speculative decoding k={k}, nothing drafted (measured)", inp.predict(batch), 1.0, tp,
                       ["the server's vllm:spec_decode_* metrics show no draft tokens: the step is the base step"]), ""
        tokens = whatif.expected_tokens_per_verify(k, min(alpha, 0.999))
        return Fix(f"speculative decoding k={k}, alpha={alpha:.2f} (measured)", inp.predict(batch * (k + 1)),
                   tokens, tp, ["acceptance i.i.d. per drafted token; a draft at every step"]), ""
    if ea.get("enable-expert-parallel") or ea.get("enable_expert_parallel"):
        if inp.coll.empty or inp.coll[(inp.coll["part"] == "all_to_all") & (inp.coll["status"] == "ok")].empty:
            return None, "03 measured no all-to-all"
        c = sm.expert_parallel_collectives(inp.coll, inp.arch, tp, int(batch), inp.communicator, inp.timing)
        return Fix("expert parallelism", inp.predict(batch, collectives=c), 1.0, tp), ""
    return None, "no projection for this change"


def _gist(error: str) -> str:
    """An error's first line and, when it quotes a log tail, the tail's last line (where vLLM says why)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    if not lines:
        return ""
    return (lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}")[:400]


def variant_rows(run_dir: Path, params, inp: Optional[ModelInputs], levels: Optional[pd.DataFrame],
                 captures: Optional[dict[int, dict]] = None) -> list[dict]:
    """Per variant and serving level: its TPOT against the baseline's (01) and against its projection
    (calibrated like the fixes: the baseline's TPOT, baseline_tpot, x fix / base model)."""
    from decodescope.io import read_json
    from decodescope.params import with_experiment
    from decodescope.rundir import VARIANTS

    manifest_path = Path(run_dir) / "manifest.json"
    states = (read_json(manifest_path).get("variants", {}) if manifest_path.is_file() else {})
    base = {int(r.level): level_tpot(r)[0] for r in levels.itertuples()} if levels is not None else {}
    calibration = {int(k): v for k, v in baseline_tpot(levels, captures).items()}
    utils = ({int(r.level): r.gpu_util_mean_pct for r in levels.itertuples()}
             if levels is not None and "gpu_util_mean_pct" in levels.columns else {})
    rows = []
    for exp in params.experiments:
        state = states.get(exp.name, {})
        vlev = _read_parquet(Path(run_dir) / VARIANTS / exp.name, "serving_levels.parquet")
        status = state.get("status", "not run")
        if vlev is None or vlev.empty:
            rows.append({"variant": exp.name, "status": status if status != "ok" else "failed",
                         "error": _gist(state.get("error") or "no serving levels measured")})
            continue
        vparams = with_experiment(params, exp.name)
        acceptance = _acceptance(vlev)
        modes = last_engine_modes(Path(run_dir) / VARIANTS / exp.name / "logs" / "server.log")
        for lv in vlev.sort_values("level").itertuples():
            b, (tpot, basis) = float(lv.level), level_tpot(lv)
            row = {"variant": exp.name, "status": status, "error": (state.get("error") or "").splitlines()[0][:300]
                   if state.get("error") else "", "level": int(lv.level), "tpot_p50_us": tpot, "reference": basis,
                   "tok_s_per_gpu": float(lv.output_throughput_tok_s) / vparams.server.tensor_parallel}
            if int(lv.level) in base:
                row.update(baseline_tpot_p50_us=base[int(lv.level)], measured_gain_pct=100 * (tpot / base[int(lv.level)] - 1))
                split = gpu_host_split(base[int(lv.level)], utils.get(int(lv.level)), tpot,
                                       getattr(lv, "gpu_util_mean_pct", None))
            else:
                split = None
            if inp is not None:
                fix, why = variant_fix(inp, params, vparams, exp, b, acceptance)
                if fix is None:
                    row["notes"] = why
                else:
                    model = inp.predict(b).period_us
                    scale = calibration.get(int(lv.level), model) / model
                    lo, hi = fix.prediction.band_us
                    proj = fix.prediction.period_us / fix.tokens_per_step * scale
                    row.update(projection=fix.name, projected_tpot_us=proj,
                               projected_low_us=lo / fix.tokens_per_step * scale,
                               projected_high_us=hi / fix.tokens_per_step * scale,
                               projection_error_pct=100 * (proj / tpot - 1),
                               notes=("calibrated by the baseline's TPOT at this level"
                                      + (" (the mean of its 01 and 04 server starts)"
                                         if calibration.get(int(lv.level)) != base.get(int(lv.level)) else "")
                                      if int(lv.level) in base else
                                      "the model's own value (the baseline did not measure this level)"))
            if split:
                row["gpu_host_split"] = split
            if modes:
                row["engine_modes"] = modes.describe()
            rows.append(row)
    return rows


def gpu_host_split(base_tpot_us: float, base_util_pct: Optional[float], tpot_us: float,
                   util_pct: Optional[float]) -> str:
    """Where a variant's TPOT change went, from the GPU's busy share over each level (NVML utilization: the
    share of time a kernel ran): GPU time per token = busy share x TPOT, the rest is time the GPU waited on
    the host (launches, drafting, scheduling). '' where either level has no GPU telemetry."""
    if base_util_pct is None or util_pct is None or pd.isna(base_util_pct) or pd.isna(util_pct):
        return ""
    gpu_base, gpu_var = base_util_pct / 100 * base_tpot_us, util_pct / 100 * tpot_us
    host_base, host_var = base_tpot_us - gpu_base, tpot_us - gpu_var
    return (f"GPU busy {util_pct:.0f}% of the level against {base_util_pct:.0f}% in the baseline: GPU time per "
            f"token {gpu_var / 1e3:.2f} ms vs {gpu_base / 1e3:.2f} ms, the GPU waiting on the host "
            f"{host_var / 1e3:.2f} ms vs {host_base / 1e3:.2f} ms")


REPLAY_TOLERANCE = 0.10  # the step model's GEMMs + collectives against the replayed step


def replay_rows(run_dir: Path, params, inp: Optional[ModelInputs]) -> list[dict]:
    """03's step replay (GEMMs and collectives in model order, nothing else) against the step model's
    GEMMs (02) + collectives (03, the communicator the replay ran: the engine's shm all-reduce on a CPU
    with vLLM, else torch's)."""
    from decodescope import stepmodel as sm
    from decodescope.microbench import STEP_REPLAY

    replay = _read_parquet(run_dir, STEP_REPLAY)
    if inp is None or replay is None or replay.empty:
        return []
    rows = []
    for mode in sorted(set(replay["mode"])):
        comm, timing = (("torch_nccl", "cuda_graph") if mode == "cuda_graph" else
                        ("torch_nccl", "back_to_back") if inp.timing == "cuda_graph" else ("torch_gloo", "back_to_back"))
        ran = replay.loc[replay["mode"] == mode, "communicator"].dropna() if "communicator" in replay else ()
        comm = str(ran.iloc[0]) if len(ran) else comm
        batches = sorted(int(b) for b in replay.loc[replay["mode"] == mode, "batch"].unique())
        # an eager GPU step is issued op by op by its host: priced by the host's measured cost per call
        # when 02 and 03 measured it, else as GEMMs + collectives in series
        eager_gpu = mode == "eager" and inp.timing == "cuda_graph" and sm.has_host_costs(inp.gemm, inp.coll, comm)
        try:
            pred = (sm.predict_replay_eager(inp.gemm, inp.coll, inp.arch, inp.tp, batches, comm,
                                            host_ref_us=sm.replay_host_refs(replay)) if eager_gpu else
                    sm.predict_replay(inp.gemm, inp.coll, inp.arch, inp.tp, batches, comm, timing))
        except (ValueError, KeyError):
            continue
        for r in sm.compare_with_replay(pred, replay, mode=mode).itertuples():
            rows.append({"batch": int(r.batch), "mode": mode, "replay_us": float(r.replay_us),
                         "predicted_us": float(r.predicted_us), "low_us": float(r.low_us), "high_us": float(r.high_us),
                         "error": float(r.error), "communicator": comm,
                         "model": "host_paced" if eager_gpu else "serial"})
    return rows
