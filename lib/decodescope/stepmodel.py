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
from typing import Optional

import numpy as np
import pandas as pd

from decodescope import arch as archmod
from decodescope.probes.timing import HOST_AFTER_GEMM, HOST_ISSUE
from decodescope.microbench import with_timing_columns


# Which of 03's timings prices a step's collectives, first measured wins: in a CUDA graph on GPUs; on
# CPUs the late rank's own time (the profile's wait for the last rank is its own component), else back
# to back.
STEP_TIMINGS = ("cuda_graph", "late_rank", "back_to_back")
# Where a communicator's wait for the other ranks is an op of its own (gloo on CPUs: its c10d wait, booked
# to collective_wait, beside an `allreduce` op that only hands the tensor over), what a step pays per call
# is both ops, and the micro-benchmark that matches it is the calls back to back, waits included: the
# late rank's own op time (late_rank) is the hand-over alone.
WAIT_INCLUDED_TIMINGS = ("cuda_graph", "back_to_back")


def step_timings(wait_in_own_op: bool) -> tuple[str, ...]:
    """03's timings, in order of preference, that price a step's all-reduces like for like."""
    return WAIT_INCLUDED_TIMINGS if wait_in_own_op else STEP_TIMINGS


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


def _gemm_time_columns(ok: pd.DataFrame) -> tuple[str, tuple[str, str, str]]:
    """(which timing, its median / p10 / p90 columns) that prices a GEMM in a decode step: on a CPU the
    step's GEMMs timed in its order after a pause (step_order), on a GPU cold weights with warm
    activations (every layer reads its own weights), when 02 measured them; else the graph time with L2
    flushed before each call (activations evicted too). A spread column 02 did not fill falls back to
    the median."""
    timed = next((t for t in ("step_order", "cold_weights")
                  if f"{t}_time_us" in ok and ok[f"{t}_time_us"].notna().all()), "graph")
    mid_col = f"{timed}_time_us" if timed != "graph" else "time_us"
    lo_col = f"{timed}_p10_us" if f"{timed}_p10_us" in ok and ok[f"{timed}_p10_us"].notna().all() else mid_col
    hi_col = f"{timed}_p90_us" if f"{timed}_p90_us" in ok and ok[f"{timed}_p90_us"].notna().all() else mid_col
    return timed, (mid_col, lo_col, hi_col)


def gemm_component(gemm: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int, dtype: str = "bf16",
                   ep: int = 1, skew: float = 0.0, source: str = "gemm.parquet") -> Component:
    ok = gemm[(gemm["status"] == "ok") & (gemm["dtype"] == dtype)]
    timed, (mid_col, lo_col, hi_col) = _gemm_time_columns(ok)
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
    what = {"cold_weights": "cold weights, warm activations", "step_order": "in step order after a pause"}.get(
        timed, "graph time, L2 flushed")
    return Component("gemm", total, low, high, f"{source} ({dtype}, {what})", notes)


def latency_curve(coll: pd.DataFrame, communicator: str, timing: str, op: str = "all_reduce") -> pd.DataFrame:
    """Rank-0 latency vs message size for one communicator and timing: bytes, time_us, p10_us, p90_us
    (and host_ref_us where the probe sampled the host's speed beside a host timing)."""
    s = with_timing_columns(coll[(coll["part"] == "sweep") & (coll["status"] == "ok") & (coll["op"] == op)])
    s = s[(s["communicator"] == communicator) & (s["timing"] == timing) & (s["inplace"].astype(bool))]
    s = s[s["rank"] == s["rank"].min()] if not s.empty else s
    cols = ["bytes", "time_us", "p10_us", "p90_us"] + (["host_ref_us"] if "host_ref_us" in s else [])
    return s.sort_values("bytes")[cols].reset_index(drop=True)


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
    """The replayed step run eagerly: the host issues the step's ops in model order (arch.step_program)
    at its measured cost per call (02's host column per GEMM; per all-reduce 03's host_after_gemm timing,
    the call issued right after a GEMM as in a step, where 03 measured it, else its host_issue), and
    the GPU runs each once it is issued and the one before it has ended (GEMMs at their cold-weights
    time, collectives at their CUDA-graph latency: the kernels without the host in the way). A host
    slower than its GPU sets the pace; the walk (eager_walk) says by how much, op by op. Band: the
    same walk with the p10s and with the p90s.

    host_ref_us (per batch, the replay's host speed: replay_table's host_ref_us) restates every host
    cost at the speed the replay's hosts ran at (at_host_speed): a VM's cores change speed by up to
    1.8x between 02/03's run and the replay's, and an eager step moves with them.

    variant: the replay's variants (probes/step.py): `gemm_only` walks the GEMMs alone, `comm_only` the
    collectives alone, issued back to back (03's host_issue timing), so that a gap in the full step can
    be placed in one part or in their interleaving."""
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


# ---- the whole step: what only the profile measures --------------------------------------------------
# Verdict classes the micro-benchmarks price (02: GEMMs, 03: collectives); the profile prices the rest.
MICRO_CLASSES = ("gemm", "communication")


@dataclass(frozen=True)
class StepSample:
    """One profiled level on its critical rank (the one that waits least in its collectives: its time is
    the step's own work): each verdict class's time per step, the host's time inside and between
    steps, and the overlap of its lanes (busy / summed)."""

    batch: float
    context_tokens: float
    classes_us: dict
    idle_us: float
    between_us: float
    overlap: float
    period_us: float
    source: str
    profiler_cost_us: Optional[float] = None
    allreduce_wait_us: float = 0.0
    wait_own_op_us: float = 0.0     # the rank's collective-wait ops per step, where the wait is an op of its own
    profiler_cost_band_us: tuple = ()   # (low, high), set with profiler_cost_us (profiler_cost)
    profiler_cost_how: str = ""
    preempted_us: float = 0.0
    engine_cpu_us: float = 0.0      # the engine core's CPU time per step (04, /proc)
    engine_wait_us: float = 0.0     # its run-queue wait per step: runnable, no core free

    @property
    def rest_us(self) -> float:
        """The profiled period less its parts (work x overlap, idle, between steps): medians of parts do
        not add up to the median period, and the model must reproduce what was measured."""
        return self.period_us - (sum(self.classes_us.values()) * self.overlap + self.idle_us + self.between_us)


def profiler_cost(cap: dict, cats: pd.DataFrame, rank) -> tuple[Optional[float], tuple, str]:
    """What the profiler added to a step at one profiled level (04's profile_capture.json): the engine's
    inter-token latency under the profiler less without it, the same workload on the same server a
    second apart, with a band of the two unprofiled runs' difference; where /metrics had no inter-token
    latency, the critical rank's ops per step x the profiler's cost per recorded op (a floor: it misses
    the trace writers and the profiled front end sharing the host's cores)."""
    step, base = cap.get("profiler_step_cost_us"), cap.get("engine_itl_unprofiled_us")
    if step is not None and base:
        noise_us = float(cap.get("window_noise") or 0.0) * float(base)
        v = max(float(step), 0.0)   # the profiler cannot speed a step up: a negative reading is noise
        return v, (max(v - noise_us, 0.0), v + noise_us), "inter-token latency profiled - unprofiled"
    if cap.get("profiler_event_cost_us") is None:
        return None, (), ""
    v = float(cats[cats["rank"] == rank]["calls_per_step"].sum()) * float(cap["profiler_event_cost_us"])
    return v, (v, v), "ops per step x the profiler's cost per recorded op"


def allreduce_wait_us(cats: pd.DataFrame, rank, transfer_us: Optional[float]) -> float:
    """A rank's all-reduce time per step beyond the collectives' own (transfer, least time over ranks):
    its wait for the last rank to arrive, which a micro-benchmark issuing calls in lock-step never sees."""
    from decodescope.trace.categorize import ALLREDUCE_CATEGORIES

    if transfer_us is None:
        return 0.0
    mine = cats[(cats["rank"] == rank) & cats["category"].isin(ALLREDUCE_CATEGORIES)]["time_per_step_us"].sum()
    return max(0.0, float(mine) - float(transfer_us))


def own_op_wait_by_rank(cats: pd.DataFrame) -> pd.Series:
    """Each rank's time per step in collective-wait ops (categorize.WAIT_CATEGORIES: gloo's c10d wait,
    functional collectives' wait_tensor): where a communicator waits for the other ranks in an op of its own."""
    from decodescope.trace.categorize import WAIT_CATEGORIES

    if cats.empty:
        return pd.Series(dtype=float)
    return cats[cats["category"].isin(WAIT_CATEGORIES)].groupby("rank")["time_per_step_us"].sum()


def wait_in_own_op(summary) -> bool:
    """Whether a CPU profile's all-reduces wait in ops of their own on every rank (gloo: vLLM CPU's _C_AVX2
    path), so that a call costs its all-reduce op plus its wait op."""
    if summary is None or summary.device != "cpu":
        return False
    cats = pd.DataFrame(summary.per_step_categories)
    wait = own_op_wait_by_rank(cats)
    ranks = set(cats["rank"]) if not cats.empty else set()
    return bool(ranks) and all(float(wait.get(r, 0.0)) > 0 for r in ranks)


def step_samples(summaries: dict, context_tokens: float, captures: Optional[dict] = None) -> list[StepSample]:
    """ProfileSummary per profiled concurrency -> StepSample per level, sorted by batch. captures
    (concurrency -> 04's profile_capture.json) give the profiler's own cost of a step (profiler_cost)
    and the workers' run-queue wait per step: the time the host's other processes held their cores."""
    from decodescope.trace.categorize import class_of

    out = []
    for conc, s in sorted(summaries.items()):
        cats = pd.DataFrame(s.per_step_categories)
        ps = s.per_step
        if cats.empty or not ps.wall_us_median:
            continue
        cats["cls"] = cats["category"].map(class_of)
        by = cats.groupby(["rank", "cls"])["time_per_step_us"].sum().unstack(fill_value=0.0)
        rank = by["communication"].idxmin() if "communication" in by else by.index[0]
        cap = (captures or {}).get(conc, {})
        cost, band, how = profiler_cost(cap, cats, rank)
        roles = cap.get("host_cpu_per_step") or {}
        worker, engine = roles.get("worker") or {}, roles.get("engine core") or {}
        # with the wait in an op of its own the calls are priced back to back, waits included (03): the
        # wait is not added again on top of them
        own_wait = float(own_op_wait_by_rank(cats).get(rank, 0.0)) if wait_in_own_op(s) else 0.0
        overlap = (ps.busy_us_median / ps.summed_us_median) if ps.summed_us_median and ps.busy_us_median else 1.0
        out.append(StepSample(batch=float(ps.batch_median or conc), context_tokens=context_tokens,
                              classes_us={str(k): float(v) for k, v in by.loc[rank].items()},
                              idle_us=float(ps.idle_us_median or 0.0), between_us=float(ps.between_steps_us_median or 0.0),
                              overlap=min(1.0, overlap), period_us=float(ps.period_us_median or ps.wall_us_median),
                              source=f"profile/c{conc}/profile_summary.json (rank {rank})",
                              profiler_cost_us=cost, profiler_cost_band_us=band, profiler_cost_how=how,
                              preempted_us=float(worker.get("runq_wait_us") or 0.0),
                              engine_cpu_us=float(engine.get("cpu_us") or 0.0),
                              engine_wait_us=float(engine.get("runq_wait_us") or 0.0),
                              allreduce_wait_us=0.0 if own_wait else allreduce_wait_us(
                                  cats, rank, s.allreduce_transfer_us_per_step),
                              wait_own_op_us=own_wait))
    return sorted(out, key=lambda x: x.batch)


def _across_batches(samples: list[StepSample], batch: float, value) -> tuple[float, float, float, list[str]]:
    """A profile-sourced value at `batch`: linear between the profiled batches, held at the nearest one
    outside them (and said so). Band: the smallest and largest value at the profiled batches around it."""
    xs = np.array([s.batch for s in samples])
    ys = np.array([value(s) for s in samples])
    notes = []
    if len(xs) == 1 or batch <= xs[0] or batch >= xs[-1]:
        if not (xs[0] <= batch <= xs[-1]):
            notes.append(f"held at the nearest profiled batch ({xs[0] if batch < xs[0] else xs[-1]:g})")
        v = float(ys[0] if batch <= xs[0] else ys[-1])
        return v, float(ys.min()), float(ys.max()), notes
    v = float(np.interp(batch, xs, ys))
    i = int(np.searchsorted(xs, batch))
    return v, float(min(ys[i - 1], ys[i])), float(max(ys[i - 1], ys[i])), notes


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
        work = sum(getattr(c, attr) for c in self.components if c.name not in HOST_PARTS)
        gaps = sum(getattr(c, attr) for c in self.components if c.name in HOST_PARTS and (host or c.name in IN_STEP))
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
PREEMPTED = "workers preempted by the host's processes"
IN_STEP = ("idle in step", PREEMPTED)
# Host parts are added after the lanes' overlap; the profiler's cost (negative) and the rest of the profiled
# period count in the period (TPOT, measured without a profiler) but not in the wall of a profiled step.
HOST_PARTS = IN_STEP + ("between steps", PROFILER_COST, REST)


def between_steps_at_freed_core(s: StepSample) -> float:
    """The host's time between steps once the engine core has a core of its own: the profiled time
    less the engine core's wait for a core, never below the engine core's own CPU time per step (what
    it needs to take a step's output and schedule the next). With the workers holding every core (on
    2 cores at TP=2: engine core 0.7 ms of CPU and 3.3 ms of run-queue wait per step), the gap between
    steps is mostly that wait: 1.45 ms at TP=2, 0.62 ms measured at TP=1 on the same host."""
    if not s.engine_cpu_us:
        return s.between_us
    return min(s.between_us, max(s.between_us - s.engine_wait_us, s.engine_cpu_us))


def host_processes_get_a_core(tp: int, measured_tp: int, host_cores: Optional[int]) -> bool:
    """Whether the workers' preemption measured at measured_tp goes away at tp: the workers held every
    core there (one each, as the CPU build binds them) and at tp they leave one to the engine core and
    the API server."""
    return bool(host_cores) and measured_tp >= host_cores > tp


def predict_step(gemm: pd.DataFrame, coll: pd.DataFrame, arch: archmod.ArchConfig, tp: int, batch: int,
                 communicator: str, timing: str, samples: list[StepSample], context_tokens: float,
                 dtype: str = "bf16", gemm_source: str = "gemm.parquet", measured_world: Optional[int] = None,
                 attention_scale: float = 1.0, collectives: Optional[Component] = None,
                 host_cores: Optional[int] = None) -> StepPrediction:
    """The decode step at `batch`: GEMMs (02) + collectives (03) + the ranks' wait for each other in
    the all-reduces + attention, small ops and framework time (04, across the profiled levels) on the
    critical rank, times its lane overlap (busy / summed), plus the host's time inside the step and
    between steps (04), less what the profiler itself cost the step (04, measured).

    At another tensor-parallel size than 03 measured (measured_world), the collectives are the measured
    ones scaled by (tp - 1) / (world - 1), a ring's latency term, and labelled extrapolated; attention is
    scaled by attention_scale (heads per rank). `collectives` replaces the priced collectives (a fix).
    The workers' run-queue wait (04: the host's other processes holding their cores mid-step) is taken
    out of the idle in the step as its own part; at a tensor-parallel size whose workers leave the host
    (host_cores) a core, it is priced at zero."""
    comps = [gemm_component(gemm, arch, tp, batch, dtype, source=gemm_source)]
    if collectives is not None:
        comps.append(collectives)
    elif tp > 1:
        world = measured_world or tp
        c = collective_component(coll, arch, tp, batch, communicator, timing, dtype)
        if world != tp:
            f = (tp - 1) / max(world - 1, 1)
            c = Component(c.name, c.us * f, c.low_us * f, c.high_us * f, c.source, c.notes + [
                f"extrapolated from world size {world} to {tp}: x {f:.2f} ((n - 1) / (world - 1))"])
        comps.append(c)
    if samples and tp > 1 and any(s.allreduce_wait_us for s in samples):
        v, lo, hi, notes = _across_batches(samples, batch, lambda s: s.allreduce_wait_us)
        comps.append(Component(WAIT, v, lo, hi, "; ".join(s.source for s in samples) + " (all-reduce time on the rank "
                               "minus the transfer: least time over ranks per call)", notes))
    if samples:
        a = attention_component(samples, batch, context_tokens)
        if attention_scale != 1.0:
            a = Component(a.name, a.us * attention_scale, a.low_us * attention_scale, a.high_us * attention_scale,
                          a.source, a.notes + [f"x {attention_scale:g}: heads per rank at this tensor-parallel size"])
        comps.append(a)
        src = "; ".join(s.source for s in samples)
        others = sorted({c for s in samples for c in s.classes_us} - set(MICRO_CLASSES) - {"attention"})
        for cls in others:
            v, lo, hi, notes = _across_batches(samples, batch, lambda s, c=cls: s.classes_us.get(c, 0.0))
            comps.append(Component(cls, v, lo, hi, src, notes))

        def preempted(s):
            return min(s.preempted_us, s.idle_us)

        freed = host_processes_get_a_core(tp, measured_world or tp, host_cores)
        if any(s.preempted_us for s in samples):
            v, lo, hi, notes = _across_batches(samples, batch, preempted)
            if any(s.preempted_us > s.idle_us for s in samples):
                notes.append("capped at the idle in the step")
            if freed:
                notes.append(f"0 at tensor-parallel {tp}: its workers leave {host_cores - tp} of the host's "
                             f"{host_cores} cores to the engine core and the API server")
                v = lo = hi = 0.0
            comps.append(Component(PREEMPTED, v, lo, hi, _capture_sources(samples) +
                                   " (workers' run-queue wait per step, /proc schedstat)", notes))
        for name, get in (("idle in step", lambda s: s.idle_us - preempted(s)),
                          ("between steps", between_steps_at_freed_core if freed else lambda s: s.between_us),
                          (REST, lambda s: s.rest_us)):
            v, lo, hi, notes = _across_batches(samples, batch, get)
            if freed and name == "between steps" and any(s.engine_cpu_us for s in samples):
                notes.append(f"at tensor-parallel {tp} the engine core has a core of its own: between steps is "
                             "its own CPU time per step, not its wait for a core (04, /proc), where that is less")
            comps.append(Component(name, v, lo, hi, src, notes))
        overlap = _across_batches(samples, batch, lambda s: s.overlap)[0]
        comps += _profiler_cost(samples, batch, comps, overlap)
    else:
        overlap = 1.0
    return StepPrediction(float(batch), comps, overlap)


def _profiler_cost(samples: list[StepSample], batch: float, comps: list[Component], overlap: float) -> list[Component]:
    """The profiler's measured cost at `batch` (across the profiled levels that measured it), as a share
    of the profile-sourced parts it inflated, taken off these parts in that share and never more than
    they add up to."""
    parts_us = {id(s): _profiled_parts_us(s) for s in samples}
    measured = [s for s in samples if s.profiler_cost_us is not None and parts_us[id(s)] > 0]
    if not measured:
        return []
    profiled = sum(c.us * (1.0 if c.name in HOST_PARTS else overlap) for c in comps
                   if c.name not in ("gemm", "collectives", WAIT))
    # the cost as a share of what the profiler inflated, applied to these parts: where a fix shrinks
    # them (another tensor-parallel size), the profiler would have cost that step less too
    share, _, _, notes = _across_batches(measured, batch, lambda s: s.profiler_cost_us / parts_us[id(s)])
    lo_share = _across_batches(measured, batch, lambda s: s.profiler_cost_band_us[0] / parts_us[id(s)])[1]
    hi_share = _across_batches(measured, batch, lambda s: s.profiler_cost_band_us[1] / parts_us[id(s)])[2]
    v, lo, hi = share * profiled, lo_share * profiled, hi_share * profiled
    if v > profiled:
        notes.append(f"capped at the profile-sourced parts ({profiled:.0f} us of {v:.0f})")
        v, lo, hi = profiled, min(lo, profiled), min(hi, profiled)
    how = sorted({s.profiler_cost_how for s in measured})
    return [Component(PROFILER_COST, -v, -hi, -lo, f"{_capture_sources(measured)} ({'; '.join(how)})", notes)]


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
