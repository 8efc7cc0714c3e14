"""What the GEMM and collectives notebooks (02, 03) show of the micro-benchmarks' tables: the method
notes, the display tables, the bursts that were skipped and why."""
from __future__ import annotations

import pandas as pd

from decodescope.micro.bench import with_timing_columns

def measured_dtypes(gemm: pd.DataFrame) -> list[str]:
    return sorted(gemm.loc[gemm["status"] == "ok", "dtype"].unique())


def gemm_method_note(gemm: pd.DataFrame) -> str:
    ok = gemm[gemm["status"] == "ok"]
    skipped = gemm[gemm["status"] != "ok"]
    parts = [f"**Method:** {ok['method'].iloc[0]}." if len(ok) else "**No GEMM could be measured.**"]
    if len(ok) and "peak_source" in ok:
        peaks = ok.groupby("dtype").agg(peak=("peak_tflops", "first"), source=("peak_source", "first"))
        parts.append("Compute rooflines: " + "; ".join(
            f"{dt} {p.peak:,.1f} TFLOP/s ({p.source})" if p.peak == p.peak else f"{dt}: none, {p.source}"
            for dt, p in peaks.iterrows()) + ".")
    if len(skipped):
        reasons = "; ".join(f"{dt}: {r}" for dt, r in skipped.groupby("dtype")["skip_reason"].first().items())
        parts.append(f"Skipped ({len(skipped)} rows): {reasons}.")
    if len(ok) and "graph_time_us" in ok and ok["graph_time_us"].notna().any():
        gap = (ok["eager_time_us"] - ok["graph_time_us"]).median()
        parts.append(f"Timed alone between events, a GEMM also carries launch gaps: eager minus graph is {gap:.1f} us "
                     "(median); time_us is the graph time, as in a decode step that vLLM replays as a CUDA graph.")
    if len(ok) and ok["pct_of_peak"].notna().any():
        best = ok.loc[ok["pct_of_peak"].idxmax()]
        parts.append(f"Closest to a peak: {best['op']} at batch {best['batch']} ({best['dtype']}), "
                     f"{best['pct_of_peak']:.0f}% of its roofline.")
    return " ".join(parts)


def gemm_display(gemm: pd.DataFrame) -> pd.DataFrame:
    # cold_weights (GPU) and step_order (CPU): the timings the step model prices a step's GEMMs with
    cols = ["op", "layer_kind", "batch", "dtype", "m", "n", "k", "count", "status", "time_us", "p10", "p90",
            "eager_time_us", "cold_weights_time_us", "step_order_time_us", "tflops", "gbps", "pct_of_compute_peak",
            "pct_of_mem_peak", "skip_reason"]
    timed = "graph" if "graph_time_us" in gemm and gemm["graph_time_us"].notna().any() else "eager"
    g = gemm.rename(columns={f"{timed}_p10_us": "p10", f"{timed}_p90_us": "p90"})  # the spread of time_us
    if timed == "eager":
        g = g.drop(columns=["eager_time_us"], errors="ignore")
    return g[[c for c in cols if c in g]]


def collectives_method_note(coll: pd.DataFrame) -> str:
    metas = coll.attrs.get("meta") or []
    m = metas[0] if metas else {}
    env = ", ".join(f"{k}={v}" for k, v in (m.get("nccl_env") or {}).items()) or "none"
    skipped = "; ".join([f"{k} not measured ({v})" for k, v in (m.get("communicators_skipped") or {}).items()]
                        + burst_skipped(coll))
    return (f"**Method:** backend {m.get('backend')} on {m.get('device')}, world size {m.get('world_size')}, "
            f"{m.get('dtype')}; communicators measured: {', '.join(m.get('communicators') or ['torch'])}"
            f"{'; ' + skipped if skipped else ''}. All-reduce latency is timed **back to back** "
            f"({m.get('back_to_back_calls', '?')} calls between one timer pair, divided; also as one CUDA graph on "
            f"GPUs), the way a decode step issues them, and **isolated** (a barrier before each call, which adds "
            f"wake-up and launch cost); the fits the verdict uses are the back-to-back ones. On GPUs, "
            f"**host_issue** is the host's own time per call of issuing the same calls (GPU drained first): "
            f"what an eager step pays per call when its host, not its GPU, sets the pace; **host_after_gemm** the "
            f"same with each call issued right after a GEMM that writes its input, less that GEMM alone (the "
            f"cost between a step's other launches, which the eager step model uses). {m.get('warmup')} "
            f"warm-up and {m.get('iters')} timed repetitions, median with p10/p90; NCCL "
            f"{m.get('nccl_version') or 'n/a'}, NCCL_* settings: {env}. busbw = algbw x 2(n-1)/n (all-reduce), "
            "x (n-1)/n (all-to-all), as nccl-tests." + tick_stall_note(coll))


def tick_stall_note(coll: pd.DataFrame) -> str:
    """What share of a CPU's back-to-back calls a scheduler tick stalled, per communicator at its smallest
    message; nothing where the probe did not split its calls."""
    if "stalled_share" not in coll.columns:
        return ""
    s = coll[(coll["part"] == "sweep") & (coll["timing"] == "back_to_back") & coll["stalled_share"].notna()]
    if s.empty:
        return ""
    first = s[s["bytes"] == s.groupby("communicator")["bytes"].transform("min")]
    per = first.groupby("communicator").agg(msg_bytes=("bytes", "first"), share=("stalled_share", "max"),
                                            unstalled_us=("unstalled_us", "median"), all_us=("time_us", "median"))
    tick_us = float(s["tick_us"].iloc[0])
    parts = [f"{c} at {int(r['msg_bytes'])} B: {r['share']:.0%} stalled, median {r['all_us']:,.0f} us over all calls "
             f"and {r['unstalled_us']:,.0f} us over the others" for c, r in per.iterrows()]
    return (f" On a CPU each back-to-back call is timed by itself and those half a scheduler tick ({tick_us:,.0f} "
            f"us) past the fastest tenth count as stalled ({'; '.join(parts)}): gloo's TCP loop spins on a quiet "
            "core until the tick, so the verdict sets the profile's typical call against 03's unstalled one.")


BURST_COLUMNS = ["communicator", "batch", "mode", "calls", "msg_bytes", "step_us_median_over_ranks",
                 "step_us_max_over_ranks", "per_call_us"]


def burst_skipped(coll: pd.DataFrame) -> list[str]:
    """Why the step's burst was not replayed, where it was not (once per reason)."""
    if "skip_reason" not in coll.columns:
        return []
    rows = coll[(coll["part"] == "burst") & (coll["status"] == "skipped")]
    return [f"burst not replayed: {r}" for r in dict.fromkeys(rows["skip_reason"].dropna())]


def burst_table(coll: pd.DataFrame) -> pd.DataFrame:
    """The step's all-reduce burst per (communicator, batch, mode); no rows where nothing was replayed (at
    world size 1 a step issues no all-reduce: burst_skipped says so)."""
    b = with_timing_columns(coll[(coll["part"] == "burst") & (coll["status"] == "ok")])
    if b.empty:
        return pd.DataFrame(columns=BURST_COLUMNS)
    return (b.groupby(["communicator", "batch", "mode"]).agg(calls=("calls", "first"), msg_bytes=("msg_bytes", "first"),
                                             step_us_median_over_ranks=("time_us", "median"),
                                             step_us_max_over_ranks=("time_us", "max"),
                                             per_call_us=("per_call_us", "median")).reset_index())


def sweep_table(coll: pd.DataFrame) -> pd.DataFrame:
    s = with_timing_columns(coll[(coll["part"] == "sweep") & (coll["status"] == "ok")])
    s = s[s["rank"] == s["rank"].min()]
    return s[["op", "communicator", "timing", "inplace", "bytes", "time_us", "p10_us", "p90_us", "algbw_gbps",
              "busbw_gbps"]]
