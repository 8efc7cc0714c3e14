"""A decode step as measured components: GEMMs (02), collectives (03), and what the profile (04) adds.

The step model prices one decode step at batch b from the micro-benchmarks, component by component,
each with the file it came from and a band from its measured spread:

- GEMMs: sum over the step's GEMM shapes at b of count x time: 02's cold-weights time when the probe
  measured it (CUDA graph cycling through weight copies: every layer reads its own weights from memory,
  the activations stay in L2, as in a decode step), else its graph time with L2 flushed before each call
  (which also evicts the activations: ~10% slower at decode sizes on an H200); a batch 02 did not
  measure is interpolated between the two nearest;
- collectives: per call, the latency at its message size read off 03's curve for one communicator and
  one timing (cuda_graph on GPUs, back_to_back on CPUs: how a step issues them), interpolated in log-log
  between measured sizes; sizes outside the sweep use the alpha-beta fit and are labelled extrapolated.

`predict_replay` prices the step replay probe (probes/step.py: the same GEMMs and collectives in model
order, nothing else), the check of these two components against a measured whole step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from decodescope import arch as archmod


@dataclass
class Component:
    name: str
    us: float
    low_us: float
    high_us: float
    source: str
    notes: list[str] = field(default_factory=list)


def _interp_batch(g: pd.DataFrame, batch: int, col: str) -> float:
    """A value at `batch` from one op's rows: exact, else linear between the nearest measured batches,
    else the nearest one scaled linearly (GEMM time at decode sizes is flat to linear in the batch)."""
    g = g.sort_values("batch")
    xs, ys = g["batch"].to_numpy(float), g[col].to_numpy(float)
    if batch in xs:
        return float(ys[xs == batch][0])
    if xs[0] < batch < xs[-1]:
        return float(np.interp(batch, xs, ys))
    edge = 0 if batch < xs[0] else -1
    return float(ys[edge] * max(1.0, batch / xs[edge]))


def gemm_component(gemm: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int, dtype: str = "bf16",
                   ep: int = 1, skew: float = 0.0, source: str = "gemm.parquet") -> Component:
    ok = gemm[(gemm["status"] == "ok") & (gemm["dtype"] == dtype)]
    # cold weights with warm activations is how a decode step meets each GEMM (every layer its own
    # weights); 02's graph time flushes L2 before each call, activations included
    timed = "cold_weights" if "cold_weights_time_us" in ok and ok["cold_weights_time_us"].notna().all() else "graph"
    mid_col = f"{timed}_time_us" if timed == "cold_weights" else "time_us"
    lo_col = f"{timed}_p10_us" if f"{timed}_p10_us" in ok and ok[f"{timed}_p10_us"].notna().all() else mid_col
    hi_col = f"{timed}_p90_us" if f"{timed}_p90_us" in ok and ok[f"{timed}_p90_us"].notna().all() else mid_col
    total = low = high = 0.0
    missing = []
    for s in archmod.gemm_shapes(arch, tp, batch, ep, skew):
        g = ok[ok["op"] == s.op]
        if g.empty:
            missing.append(s.op)
            continue
        total += s.count * _interp_batch(g, batch, mid_col)
        low += s.count * _interp_batch(g, batch, lo_col)
        high += s.count * _interp_batch(g, batch, hi_col)
    notes = [f"not measured, left out: {missing}"] if missing else []
    what = "cold weights, warm activations" if timed == "cold_weights" else "graph time, L2 flushed"
    return Component("gemm", total, low, high, f"{source} ({dtype}, {what})", notes)


def latency_curve(coll: pd.DataFrame, communicator: str, timing: str, op: str = "all_reduce") -> pd.DataFrame:
    """Rank-0 latency vs message size for one communicator and timing: bytes, time_us, p10_us, p90_us."""
    from decodescope.microbench import with_timing_columns

    s = with_timing_columns(coll[(coll["part"] == "sweep") & (coll["status"] == "ok") & (coll["op"] == op)])
    s = s[(s["communicator"] == communicator) & (s["timing"] == timing) & (s["inplace"].astype(bool))]
    s = s[s["rank"] == s["rank"].min()] if not s.empty else s
    return s.sort_values("bytes")[["bytes", "time_us", "p10_us", "p90_us"]].reset_index(drop=True)


def latency_at(curve: pd.DataFrame, nbytes: float, col: str = "time_us") -> tuple[float, bool]:
    """(latency, extrapolated): log-log interpolation inside the measured sizes; outside, the
    alpha-beta line through the two nearest end points."""
    xs, ys = curve["bytes"].to_numpy(float), curve[col].to_numpy(float)
    if xs[0] <= nbytes <= xs[-1]:
        return float(np.exp(np.interp(np.log(nbytes), np.log(xs), np.log(ys)))), False
    i = (0, 1) if nbytes < xs[0] else (-2, -1)
    slope = (ys[i[1]] - ys[i[0]]) / (xs[i[1]] - xs[i[0]])
    return float(max(ys[i[0]] + slope * (nbytes - xs[i[0]]), min(ys))), True


def collective_component(coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int, communicator: str,
                         timing: str, dtype: str = "bf16", source: str = "collectives.parquet") -> Component:
    curve = latency_curve(coll, communicator, timing)
    if curve.empty:
        raise ValueError(f"{source} has no {communicator} all-reduce timed {timing}; measured: "
                         f"{sorted(set(coll.get('communicator', pd.Series(dtype=str)).dropna()))}")
    total = low = high = 0.0
    notes = []
    for c in archmod.collective_schedule(arch, tp, batch, dtype):
        # the logits all-gather moves msg_bytes per rank: priced as an all-reduce of that size (one call
        # per step; 03 does not sweep all-gather)
        t, extra = latency_at(curve, c.msg_bytes)
        total += c.count * t
        low += c.count * latency_at(curve, c.msg_bytes, "p10_us")[0]
        high += c.count * latency_at(curve, c.msg_bytes, "p90_us")[0]
        if extra:
            notes.append(f"{c.where} at {c.msg_bytes} B: extrapolated past the sweep")
        if c.op != "all_reduce":
            notes.append(f"{c.where} ({c.op}) priced as an all-reduce of {c.msg_bytes} B")
    return Component("collectives", total, low, high, f"{source} ({communicator}, {timing})", notes)


def predict_replay(gemm: pd.DataFrame, coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batches: list[int],
                   communicator: str, timing: str, dtype: str = "bf16") -> pd.DataFrame:
    """The replayed step (GEMMs + collectives in series) per batch, with its band and components."""
    rows = []
    for b in batches:
        g = gemm_component(gemm, arch, tp, b, dtype)
        c = collective_component(coll, arch, tp, b, communicator, timing, dtype)
        rows.append({"batch": b, "predicted_us": g.us + c.us, "low_us": g.low_us + c.low_us,
                     "high_us": g.high_us + c.high_us, "gemm_us": g.us, "collectives_us": c.us,
                     "sources": f"{g.source}; {c.source}", "notes": "; ".join(g.notes + c.notes)})
    return pd.DataFrame(rows)


def replay_table(step_rows: list[dict]) -> pd.DataFrame:
    """probes/step.py output (all ranks) -> one row per (batch, variant, mode): the slowest rank's median,
    since a step ends when its last rank does."""
    df = pd.DataFrame([r for r in step_rows if r.get("status") == "ok"])
    return (df.groupby(["batch", "variant", "mode"]).agg(time_us=("time_us", "max"), p10_us=("p10_us", "max"),
                                                           p90_us=("p90_us", "max"), ops=("ops", "first"))
            .reset_index())


def compare_with_replay(predicted: pd.DataFrame, replay: pd.DataFrame, mode: str = "cuda_graph",
                        variant: str = "full") -> pd.DataFrame:
    r = replay[(replay["mode"] == mode) & (replay["variant"] == variant)][["batch", "time_us"]]
    out = predicted.merge(r.rename(columns={"time_us": "replay_us"}), on="batch")
    out["error"] = out["predicted_us"] / out["replay_us"] - 1.0
    return out
