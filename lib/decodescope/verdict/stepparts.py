"""A decode step's components the micro-benchmarks price: GEMMs (02) and collectives (03).

The step model prices one decode step at batch b from the micro-benchmarks, component by component.
Each component carries the file it came from and a band from its measured spread.

- GEMMs: the sum over the step's GEMM shapes at b of count x time.
  The time is 02's cold-weights time where the probe measured it.
  That probe runs a CUDA graph that cycles through weight copies.
  So every layer reads its own weights from memory and the activations stay in L2, as in a decode step.
  Otherwise the time is 02's graph time with L2 flushed before each call.
  That flush also evicts the activations: ~10% slower at decode sizes on an H200.
  A batch 02 did not measure is interpolated between the two nearest.
- Collectives: per call, the latency at its message size, read off 03's curve.
  The curve is for one communicator and one timing, the one a step issues them with.
  That timing is cuda_graph on GPUs and back_to_back on CPUs.
  Between measured sizes the curve is interpolated in log-log.
  Sizes outside the sweep use the alpha-beta fit and are labelled extrapolated.

`predict_replay` prices the step replay probe (probes/step.py: the same GEMMs and collectives in model
order, nothing else), the check of these two components against a measured whole step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.model import arch as archmod
from decodescope.probes.timing import HOST_AFTER_GEMM, HOST_ISSUE
from decodescope.schema.records import StepCategoryRow, frame
from decodescope.micro.bench import with_timing_columns

# Which of 03's timings prices a step's collectives, first measured wins: in a CUDA graph on GPUs; on
# CPUs the late rank's own time (the profile's wait for the last rank is its own component), else back
# to back.
STEP_TIMINGS = ("cuda_graph", "late_rank", "back_to_back")
# Some communicators wait for the other ranks in an op of their own.
# Gloo on CPUs is one: its c10d wait is booked to collective_wait, and its `allreduce` op only hands the tensor over.
# There a step pays both ops per call, so the step model prices the calls back to back, waits included.
# On a CPU 03 times each call by itself, so the median is a typical call.
# The reconcile sets that median against the profile's median call.
WAIT_INCLUDED_TIMINGS = ("cuda_graph", "back_to_back")


def step_timings(wait_in_own_op: bool) -> tuple[str, ...]:
    """03's timings, in order of preference, that price a step's all-reduces like for like."""
    return WAIT_INCLUDED_TIMINGS if wait_in_own_op else STEP_TIMINGS


class Kind(Enum):
    """How a component adds up in a step (stepmodel.StepPrediction)."""

    WORK = "work on the critical rank"          # summed, then x the lanes' overlap (busy / summed)
    HOST_IN_STEP = "host time in the step"      # added after the overlap: in the step's wall and its period
    HOST_BETWEEN = "host time between steps"    # in the period (what TPOT measures), not in a profiled wall
    DEDUCTED = "deducted"                       # a cost taken off the period (the profiler's own)


@dataclass
class Component:
    name: str
    us: float
    low_us: float
    high_us: float
    source: str
    notes: list[str] = field(default_factory=list)
    kind: Kind = Kind.WORK


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


def _gemm_time_columns(ok: pd.DataFrame) -> tuple[str, tuple[str, str, str]]:
    """(which timing, its median / p10 / p90 columns) that prices a GEMM in a decode step.

    On a CPU it is the step's GEMMs timed in step order after a pause (step_order), where 02 measured them.
    On a GPU it is cold weights with warm activations, where 02 measured them: every layer reads its own weights.
    Otherwise it is the graph time with L2 flushed before each call, which evicts the activations too.
    A spread column 02 did not fill falls back to the median."""
    timed = next((t for t in ("step_order", "cold_weights")
                  if f"{t}_time_us" in ok and ok[f"{t}_time_us"].notna().all()), "graph")
    mid_col = f"{timed}_time_us" if timed != "graph" else "time_us"
    lo_col = f"{timed}_p10_us" if f"{timed}_p10_us" in ok and ok[f"{timed}_p10_us"].notna().all() else mid_col
    hi_col = f"{timed}_p90_us" if f"{timed}_p90_us" in ok and ok[f"{timed}_p90_us"].notna().all() else mid_col
    return timed, (mid_col, lo_col, hi_col)


def gemm_rows_as_served(gemm: pd.DataFrame, dtype: str = "bf16", weight_dtype: Optional[str] = None) -> pd.DataFrame:
    """02's measured rows in the dtype each op is served in: `weight_dtype` (model.weight_dtype) for the
    quantized layer kinds where 02 measured them there, `dtype` for every other op."""
    ok = gemm[gemm["status"] == "ok"]
    base = ok[ok["dtype"] == dtype]
    if not weight_dtype or weight_dtype == dtype or "layer_kind" not in ok:
        return base
    quant = ok[(ok["dtype"] == weight_dtype) & ok["layer_kind"].isin(archmod.QUANTIZED_KINDS)]
    return pd.concat([base[~base["op"].isin(set(quant["op"]))], quant], ignore_index=True)


def recorded_unbatched(gemm: pd.DataFrame, shapes: list) -> set[str]:
    """The ops the step runs as one batched GEMM (groups > 1) whose 02 rows are all single GEMMs: runs
    recorded before MLA's per-head products became one batched GEMM per layer. Not that shape's timing."""
    if "groups" not in gemm:
        return set()
    single = gemm.groupby("op")["groups"].apply(lambda g: bool((g.fillna(1) == 1).all()))
    return {s.op for s in shapes if s.groups > 1 and bool(single.get(s.op, False))}


def hits_few_experts(batch: int, top_k: int, experts: int) -> bool:
    """Whether uniform routing at `batch` hits under 1.5x top-k experts: too few beyond top-k for a skew to
    show in the expert time."""
    return archmod.active_experts(batch, top_k, experts) < 1.5 * min(top_k, experts)


def routing_skew(moe_profile_us: float, moe_uniform_us: float, batch: int, top_k: int, experts: int) -> float:
    """The routing skew (arch.active_experts) under which the experts a step hits match what 04 measured.

    02 prices the routed experts under uniform routing (moe_uniform_us at this batch).
    A profiled expert time below that price means fewer experts hit.
    Expert time is about linear in experts hit, because each expert reads its own weights.
    0 where the profile is at or above the uniform price, or where the batch hits few experts anyway."""
    uniform = archmod.active_experts(batch, top_k, experts)
    floor = float(min(top_k, experts))
    if moe_uniform_us <= 0 or moe_profile_us >= moe_uniform_us or hits_few_experts(batch, top_k, experts):
        return 0.0
    hit = max(floor, uniform * moe_profile_us / moe_uniform_us)
    return float(min(0.99, (uniform - hit) / (uniform - floor)))


def measured_routing_skews(gemm: pd.DataFrame, arch: archmod.ArchConfig, tp: int, summaries: dict,
                           dtype: str = "bf16", weight_dtype: Optional[str] = None) -> tuple[tuple[float, float], ...]:
    """(batch, routing_skew) at each profiled level whose batch hits more experts than top-k under uniform
    routing, from 04's routed-expert time on the median rank against 02's price of the same step's
    experts. One skew for every batch does not hold: with dummy weights the Kimi-shaped engine's expert
    time on the H200 was the same at batch 4 as at 1 (the tokens routed alike) and x 6 at 64, so a skew
    read at 64 (0.82) priced batch 16's experts at 1.5x what 04 measured there. GPU profiles only: there
    a decode step's expert GEMMs are bound by reading each hit expert's weights; on a CPU the fused MoE
    kernel is bound by its routed rows' arithmetic, the same for any experts hit."""
    if not arch.moe_layers or not summaries:
        return ()
    out = []
    for conc, summary in sorted(summaries.items()):
        if summary.device != "gpu" or not summary.per_step_categories:
            continue
        cats = frame(summary.per_step_categories, StepCategoryRow)
        moe = cats[cats["category"].astype(str) == "moe_experts"].groupby("rank")["time_per_step_us"].sum()
        batch = int(round(summary.per_step.batch_median or conc))
        if moe.empty or batch < 1 or hits_few_experts(batch, arch.top_k, arch.num_experts):
            continue
        uniform = gemm_component(gemm, arch, tp, batch, dtype, weight_dtype=weight_dtype, layer_kinds=("moe_expert",))
        out.append((float(batch), routing_skew(float(moe.median()), uniform.us, batch, arch.top_k, arch.num_experts)))
    return tuple(out)


def skew_at(skews: tuple[tuple[float, float], ...], batch: float) -> float:
    """The routing skew at `batch`: linear in batch between the profiled levels' readings, the nearest
    reading beyond them, 0 (uniform) with none."""
    if not skews:
        return 0.0
    batches, values = zip(*sorted(skews))
    return float(np.interp(batch, batches, values))


def gemm_component(gemm: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int, dtype: str = "bf16",
                   ep: int = 1, skew: float = 0.0, source: str = "gemm.parquet",
                   weight_dtype: Optional[str] = None, layer_kinds: Optional[tuple[str, ...]] = None) -> Component:
    ok = gemm_rows_as_served(gemm, dtype, weight_dtype)
    timed, (mid_col, lo_col, hi_col) = _gemm_time_columns(ok)
    total = low = high = 0.0
    missing = []
    shapes = [s for s in archmod.gemm_shapes(arch, tp, batch, ep, skew) if not layer_kinds or s.layer_kind in layer_kinds]
    single = sorted(recorded_unbatched(ok, shapes))
    for s in shapes:
        g = ok[ok["op"] == s.op]
        if g.empty:
            missing.append(s.op)
            continue
        if s.op in single:
            continue
        if skew and s.layer_kind == "moe_expert" and "groups" in g:
            # fewer experts hit than 02's uniform routing: each expert's time (its weights read once, the
            # few rows it gets on top) times the experts this routing hits
            per = g.assign(**{c: g[c] / g["groups"] for c in {mid_col, lo_col, hi_col}})
            g, n = per, s.count * s.groups
        else:
            n = s.count
        total += n * _interp_batch(g, batch, mid_col)
        low += n * _interp_batch(g, batch, lo_col)
        high += n * _interp_batch(g, batch, hi_col)
    notes = [f"not measured, left out: {missing}"] if missing else []
    if skew:
        notes.append(f"routing skew {skew:.2f} (04's expert time against 02's uniform routing): routed experts "
                     "priced per expert hit")
    if single:
        notes.append(f"measured as single GEMMs, not as the batched GEMM the step runs, left out: {single}")
    what = {"cold_weights": "cold weights, warm activations", "step_order": "in step order after a pause"}.get(
        timed, "graph time, L2 flushed")
    served = sorted(set(ok["dtype"])) if not ok.empty else [dtype]
    return Component("gemm", total, low, high, f"{source} ({' + '.join(served) or dtype}, {what})", notes)


def latency_curve(coll: pd.DataFrame, communicator: str, timing: str, op: str = "all_reduce") -> pd.DataFrame:
    """Rank-0 latency vs message size for one communicator and timing: bytes, time_us, p10_us, p90_us
    (and host_ref_us where the probe sampled the host's speed beside a host timing; unstalled_us and
    stalled_share where it split a CPU's calls by the scheduler tick)."""
    s = with_timing_columns(coll[(coll["part"] == "sweep") & (coll["status"] == "ok") & (coll["op"] == op)])
    s = s[(s["communicator"] == communicator) & (s["timing"] == timing) & (s["inplace"].astype(bool))]
    s = s[s["rank"] == s["rank"].min()] if not s.empty else s
    cols = ["bytes", "time_us", "p10_us", "p90_us"] + [c for c in ("host_ref_us", "unstalled_us", "stalled_share")
                                                       if c in s]
    return s.sort_values("bytes")[cols].reset_index(drop=True)


def price_column(curve: pd.DataFrame, preferred: str = "unstalled_us") -> str:
    """The curve's column a call is read from: `preferred` where the curve has it at every size (a CPU's
    median unstalled call, where 03 split its calls by the scheduler tick), its median call otherwise."""
    return preferred if preferred in curve and curve[preferred].notna().all() else "time_us"


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
    # where 03 split a CPU's calls by the scheduler tick, a call is its median unstalled call: how often a tick
    # stalls a call is the host's, which 03's quiet cores do not share with the engine's, and the profile
    # prices it (stepsample.collectives_as_paid)
    col = price_column(curve)
    if col == "unstalled_us":
        notes.append(f"each call at 03's median among the calls no scheduler tick stalled ({curve['stalled_share'].min():.0%}"
                     f"-{curve['stalled_share'].max():.0%} of its calls were, by size): the stalls are the host's, "
                     "priced from the profile where it measured them")
    for c in archmod.collective_schedule(arch, tp, batch, dtype):
        # the logits all-gather moves msg_bytes per rank: priced as an all-reduce of that size (one call
        # per step; 03 does not sweep all-gather)
        t, extra = latency_at(curve, c.msg_bytes, col)
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


HOST_COLUMNS = ("host_time_us", "host_p10_us", "host_p90_us")


def has_host_costs(gemm: pd.DataFrame, coll: pd.DataFrame, communicator: str) -> bool:
    """Whether 02 and 03 measured the host's cost per call (GPU probes), which the eager step needs."""
    ok = gemm[gemm["status"] == "ok"] if "status" in gemm else gemm
    return (all(c in ok for c in HOST_COLUMNS) and not ok.empty and ok["host_time_us"].notna().all()
            and not latency_curve(coll, communicator, HOST_ISSUE).empty)


def eager_walk(ops: list[tuple[float, float]]) -> tuple[float, float]:
    """(step end, host busy) of ops issued one after another by a host and run in order by a GPU: op i
    is issued host_i after the one before it, and starts when issued and when the GPU is free; the step
    ends when the GPU does. ops: (host_us, gpu_us) in program order."""
    issued = gpu_free = 0.0
    for host_us, gpu_us in ops:
        issued += host_us
        gpu_free = max(gpu_free, issued) + gpu_us
    return max(gpu_free, issued), issued


def at_host_speed(df: pd.DataFrame, cols, host_ref_us: Optional[float]) -> tuple[pd.DataFrame, Optional[str]]:
    """Host costs measured beside a host-speed reference (timing.HostRef, column host_ref_us) restated at
    another moment's reference: each cost x host_ref_us / the row's own. Returns the frame, unchanged
    when either reference is missing, and why it was not rescaled (None when it was)."""
    if host_ref_us is None:
        return df, "no host speed sampled beside the replay"
    if "host_ref_us" not in df or df["host_ref_us"].isna().any() or (df["host_ref_us"] <= 0).any():
        return df, "no host speed sampled beside the host costs"
    out = df.copy()
    for c in cols:
        out[c] = out[c] * (host_ref_us / out["host_ref_us"])
    return out, None


def predict_replay_eager(gemm: pd.DataFrame, coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int,
                         batches: list[int], communicator: str, dtype: str = "bf16",
                         host_ref_us: Optional[dict] = None, variant: str = "full") -> pd.DataFrame:
    """The replayed step run eagerly.

    The host issues the step's ops in model order (arch.step_program) at its measured cost per call.
    Per GEMM that cost is 02's host column.
    Per all-reduce it is 03's host_after_gemm timing where 03 measured it, else its host_issue.
    host_after_gemm is the call issued right after a GEMM, as in a step.
    The GPU runs each op once it is issued and the one before it has ended.
    GEMMs run at their cold-weights time and collectives at their CUDA-graph latency.
    Those are the kernels without the host in the way.
    A host slower than its GPU sets the pace; the walk (eager_walk) says by how much, op by op.
    Band: the same walk with the p10s and with the p90s.

    host_ref_us is the replay's host speed per batch (replay_table's host_ref_us).
    It restates every host cost at the speed the replay's hosts ran at (at_host_speed).
    A VM's cores change speed by up to 1.8x between 02/03's run and the replay's, and an eager step moves with them.

    variant picks one of the replay's variants (probes/step.py).
    `gemm_only` walks the GEMMs alone.
    `comm_only` walks the collectives alone, issued back to back (03's host_issue timing).
    So a gap in the full step can be placed in one part or in their interleaving."""
    if variant not in ("full", "gemm_only", "comm_only"):
        raise ValueError(f"variant {variant!r}: expected full, gemm_only or comm_only")
    ok = gemm[(gemm["status"] == "ok") & (gemm["dtype"] == dtype)]
    _, gpu_cols = _gemm_time_columns(ok)
    coll_gpu = latency_curve(coll, communicator, "cuda_graph")
    host_timing, coll_host = HOST_AFTER_GEMM, latency_curve(coll, communicator, HOST_AFTER_GEMM)
    if coll_host.empty or variant == "comm_only":
        host_timing, coll_host = HOST_ISSUE, latency_curve(coll, communicator, HOST_ISSUE)
    if coll_gpu.empty or coll_host.empty:
        raise ValueError(f"collectives.parquet has no {communicator} all-reduce timed cuda_graph and {HOST_ISSUE}")
    rows = []
    for b in batches:
        ref_b = (host_ref_us or {}).get(b)
        ok_b, why_gemm = at_host_speed(ok, HOST_COLUMNS, ref_b)
        coll_host_b, why_coll = at_host_speed(coll_host, ("time_us", "p10_us", "p90_us"), ref_b)
        rescaled = why_gemm is None and why_coll is None
        if not rescaled:  # both or neither: one set of costs at another host speed than the other is worse
            ok_b, coll_host_b = ok, coll_host
        by_op = {op: g for op, g in ok_b.groupby("op")}
        program = [x for x in archmod.step_program(arch, tp, b, dtype=dtype)
                   if variant == "full" or (x["kind"] == "gemm") == (variant == "gemm_only")]
        missing = sorted({x["op"] for x in program if x["kind"] == "gemm" and x["op"] not in by_op})
        walks = []  # (step end, host busy, GPU busy) at the medians, the p10s, the p90s
        for host_col, gpu_col, coll_col in zip(HOST_COLUMNS, gpu_cols, ("time_us", "p10_us", "p90_us")):
            per_gemm = {op: (_interp_batch(g, b, host_col), _interp_batch(g, b, gpu_col)) for op, g in by_op.items()}
            # the logits all-gather priced as an all-reduce of its size, as collective_component does
            ops = [per_gemm[x["op"]] if x["kind"] == "gemm" else
                   (latency_at(coll_host_b, x["msg_bytes"], coll_col)[0], latency_at(coll_gpu, x["msg_bytes"], coll_col)[0])
                   for x in program if x["kind"] != "gemm" or x["op"] in per_gemm]
            walks.append((*eager_walk(ops), sum(g for _, g in ops)))
        mid, host_us, gpu_us = walks[0]
        notes = [f"not measured, left out: {missing}"] if missing else []
        notes.append(f"host costs at the replay's host speed ({ref_b:.2f} us per reference launch)" if rescaled
                     else f"host costs as measured: {why_gemm or why_coll}")
        rows.append({"batch": b, "predicted_us": mid, "low_us": min(w[0] for w in walks),
                     "high_us": max(w[0] for w in walks), "host_us": host_us, "gpu_us": gpu_us,
                     "host_bound": host_us >= gpu_us, "host_rescaled": rescaled,
                     "sources": f"gemm.parquet (host per call; {gpu_cols[0]}); collectives.parquet "
                                f"({communicator}, {host_timing} and cuda_graph)",
                     "notes": "; ".join(notes)})
    return pd.DataFrame(rows)


def replay_host_refs(replay: pd.DataFrame, mode: str = "eager", variant: str = "full") -> dict:
    """Per batch, the host speed the replay's steps ran at (replay_table's host_ref_us), where sampled."""
    if "host_ref_us" not in replay:
        return {}
    r = replay[(replay["mode"] == mode) & (replay["variant"] == variant)].dropna(subset=["host_ref_us"])
    return {int(b): float(v) for b, v in zip(r["batch"], r["host_ref_us"])}


def compare_with_replay(predicted: pd.DataFrame, replay: pd.DataFrame, mode: str = "cuda_graph",
                        variant: str = "full") -> pd.DataFrame:
    r = replay[(replay["mode"] == mode) & (replay["variant"] == variant)][["batch", "time_us"]]
    out = predicted.merge(r.rename(columns={"time_us": "replay_us"}), on="batch")
    out["error"] = out["predicted_us"] / out["replay_us"] - 1.0
    return out
