"""Analyses of the parsed trace table; each is a function of DataFrames that returns a DataFrame.

`ops` holds the timed work: GPU kernels (plus memcpy/memset) on a GPU trace, CPU ops with their
self time on a CPU trace (vLLM's CPU build), with a `time_us` column that sums without double
counting. `steps` holds one row per model step per rank, from vLLM's record_function ranges
(`execute_context_<n>(<tok>)_generation_<n>(<tok>)`) or, without them, from gaps in the work.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from decodescope.core.dtypes import element_bytes
from decodescope.trace.nesting import parents_in_order, prev_in_thread
from decodescope.trace.reader import GPU_WORK
from decodescope.trace.categorize import (ALLGATHER_CATEGORIES, ALLREDUCE_CATEGORIES, OTHER, WAIT_CATEGORIES,
                                         add_categories)
from decodescope.engines import engine

GPU_WORK_CATS = GPU_WORK  # the table counts as GPU work what the streamed breakdown does
STEP_NAME = engine().step_name  # a decode step's annotation, the engine's (decodescope.engines)
STEP_ANY = engine().step_any


def is_gpu_table(events: pd.DataFrame) -> bool:
    return bool((events["cat"] == "kernel").any())


# ---- ops -----------------------------------------------------------------------------------------
def self_times(ops: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Exclusive time of nested CPU ops (same rank and thread): duration minus direct children; and
    each op's parent position (-1 at top level).

    In (rank, thread, start, longest first) order an op's parent is the latest earlier op of its thread
    still open at its start (nesting.parents_in_order)."""
    n = len(ops)
    out = ops["dur_us"].to_numpy(dtype=float).copy()
    parent = np.full(n, -1)
    if not n:
        return out, parent
    order = thread_order(ops["rank"].to_numpy(), ops["tid"].to_numpy(), ops["ts_us"].to_numpy(),
                          ops["dur_us"].to_numpy())
    ts = ops["ts_us"].to_numpy()[order]
    end = ts + ops["dur_us"].to_numpy()[order]
    prev = prev_in_thread(n, ops["tid"].to_numpy()[order], ops["rank"].to_numpy()[order])
    par = parents_in_order(prev, ts, end)
    child = np.flatnonzero(par >= 0)
    p = par[child].astype(np.int64)
    del par
    self_sorted = out[order]
    # subtracted child by child in order, as a stack would: the same float result
    np.subtract.at(self_sorted, p, np.minimum(end[child], end[p]) - ts[child])
    out[order] = self_sorted
    parent[order[child]] = order[p]
    return np.maximum(out, 0.0), parent


def thread_order(rank: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """np.lexsort((-dur, ts, tid, rank)): rows by rank, thread, start, longest first (stable). Rows
    already in (rank, start) order, as op_table hands them over, need only a stable grouping by thread
    and a sort of the rows that start together, much cheaper than four sorts."""
    n = len(ts)
    drank = np.diff(rank)
    if n < 2 or (drank < 0).any() or ((np.diff(ts) < 0) & (drank == 0)).any() or np.isnan(ts).any():
        return np.lexsort((-dur, ts, tid, rank))
    rcode, runiq = pd.factorize(rank, sort=True)
    tcode, tuniq = pd.factorize(tid, sort=True)
    if len(runiq) * len(tuniq) > np.iinfo(np.int16).max:  # too many threads for a radix sort
        return np.lexsort((-dur, ts, tid, rank))
    group = (rcode * len(tuniq) + tcode).astype(np.int16)  # in (rank, thread) order
    order = np.argsort(group, kind="stable")  # by thread, in (rank, start) order within
    g, t = group[order], ts[order]
    tie = np.flatnonzero((g[1:] == g[:-1]) & (t[1:] == t[:-1]))
    if len(tie):  # rows of a thread starting together: longest first, then as they came
        slots = np.unique(np.r_[tie, tie + 1])
        rows = order[slots]
        order[slots] = rows[np.lexsort((rows, -dur[rows], ts[rows], group[rows]))]
    return order


def op_table(events: pd.DataFrame, rules=None) -> pd.DataFrame:
    """The timed work with categories and a `time_us` that sums without double counting."""
    cat = events["cat"]
    device = "gpu" if is_gpu_table(events) else "cpu"
    keep = (cat.isin(GPU_WORK_CATS) if device == "gpu" else cat == "cpu_op").to_numpy()
    # the kept rows in their final order (rank, start; stable), taken in one copy
    rows = np.flatnonzero(keep)
    rows = rows[np.lexsort((events["ts_us"].to_numpy()[rows], events["rank"].to_numpy()[rows]))]
    ops = events.take(rows).reset_index(drop=True)
    if device == "gpu":
        ops["time_us"] = ops["dur_us"]
        ops["lane"] = ops["stream"]
    else:
        self_us, parent = self_times(ops) if len(ops) else (np.array([]), np.array([], dtype=int))
        ops["time_us"] = self_us
        ops["lane"] = ops["tid"]
    ops = add_categories(ops, device, rules) if len(ops) else ops.assign(category=pd.Series(dtype="category"))
    # A call counts once: an op inside another op of its own category (c10d::allreduce_ around
    # gloo:all_reduce) is part of its parent's call.
    if device == "cpu" and len(ops):
        cats = ops["category"].cat.codes.to_numpy()
        ops["counted"] = (parent < 0) | (cats[np.clip(parent, 0, None)] != cats)
    else:
        ops["counted"] = True
    ops["msg_bytes"] = _msg_bytes(ops)
    ops.attrs["device"] = device
    return ops


def _msg_bytes(ops: pd.DataFrame) -> pd.Series:
    if "in_nelems" not in ops or ops.empty:
        return pd.Series(np.nan, index=ops.index)
    names = ops["coll_dtype"]
    elt = names.map({v: element_bytes(v) for v in names.dropna().unique()}).astype(float)
    nelems = ops["in_nelems"].where(ops["in_nelems"] >= 0)
    return nelems * elt


# ---- steps ---------------------------------------------------------------------------------------
def steps_from_annotations(events: pd.DataFrame) -> pd.DataFrame:
    """One row per annotated model step per rank. On GPU traces the GPU-side span
    (gpu_user_annotation) is used when the profiler recorded it."""
    rows = []
    for source in ("gpu_user_annotation", "user_annotation"):
        sel = events[events["cat"] == source]  # few rows: string work only on them
        sel = sel[sel["name"].astype(str).str.contains(STEP_ANY)]
        if sel.empty:
            continue
        if source == "gpu_user_annotation":
            sel = _one_span_per_step(sel)
        for r in sel.itertuples():
            m = STEP_NAME.search(str(r.name))
            ctx_reqs, ctx_tok, gen_reqs, gen_tok = (int(g) for g in m.groups()) if m else (0, 0, 0, 0)
            kind = ("decode" if gen_reqs and not ctx_reqs else "prefill" if ctx_reqs and not gen_reqs
                    else "mixed" if ctx_reqs and gen_reqs else "empty" if m else "unknown")
            rows.append({"rank": r.rank, "start_us": r.ts_us, "end_us": r.ts_us + r.dur_us, "wall_us": r.dur_us,
                         "ctx_reqs": ctx_reqs, "ctx_tokens": ctx_tok, "gen_reqs": gen_reqs, "gen_tokens": gen_tok,
                         "kind": kind, "source": source})
        break
    steps = pd.DataFrame(rows, columns=["rank", "start_us", "end_us", "wall_us", "ctx_reqs", "ctx_tokens",
                                        "gen_reqs", "gen_tokens", "kind", "source"])
    steps = steps.sort_values(["rank", "start_us"]).reset_index(drop=True)
    steps["step"] = steps.groupby("rank").cumcount()
    return steps


def _one_span_per_step(spans: pd.DataFrame) -> pd.DataFrame:
    """The GPU-side spans of one step as one: Kineto writes a step's annotation once per stream its
    kernels ran on (vLLM 0.26's CUDA-graph decode runs on two: a 3 ms span and a 0.5 ms span inside it,
    both with the CPU range's External id), so a step spans from its first start to its last end."""
    if "external_id" not in spans or not (spans["external_id"] >= 0).any():
        return spans
    keyed = spans[spans["external_id"] >= 0]
    end = (keyed["ts_us"] + keyed["dur_us"]).groupby([keyed["rank"], keyed["external_id"]]).transform("max")
    start = keyed.groupby(["rank", "external_id"])["ts_us"].transform("min")
    merged = keyed.assign(ts_us=start, dur_us=end - start).drop_duplicates(["rank", "external_id"])
    return pd.concat([merged, spans[spans["external_id"] < 0]])


def steps_from_gaps(ops: pd.DataFrame, min_gap_us: float = 200.0) -> pd.DataFrame:
    """Without annotations: a step ends where the work pauses for longer than min_gap_us and 5x the
    median gap."""
    rows = []
    for rank, g in ops.groupby("rank"):
        s = g["ts_us"].to_numpy()
        e = s + g["dur_us"].to_numpy()
        order = np.argsort(s)
        s, e = s[order], np.maximum.accumulate(e[order])
        gaps = s[1:] - e[:-1]
        thresh = max(min_gap_us, 5 * float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else min_gap_us)
        cuts = np.where(gaps > thresh)[0]
        starts = np.r_[s[0], s[cuts + 1]]
        ends = np.r_[e[cuts], e[-1]]
        for a, b in zip(starts, ends):
            rows.append({"rank": rank, "start_us": a, "end_us": b, "wall_us": b - a, "ctx_reqs": 0, "ctx_tokens": 0,
                         "gen_reqs": 0, "gen_tokens": 0, "kind": "unknown", "source": "gaps"})
    steps = pd.DataFrame(rows)
    if not steps.empty:
        steps["step"] = steps.groupby("rank").cumcount()
    return steps


def find_steps(events: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    steps = steps_from_annotations(events)
    return steps if not steps.empty else steps_from_gaps(ops)


def launch_times(events: pd.DataFrame) -> pd.Series:
    """correlation id -> CPU launch timestamp, to place GPU kernels in the CPU step that launched them."""
    rt = events[events["cat"].isin(["cuda_runtime", "cuda_driver"]) & (events["correlation"] >= 0)]
    return rt.groupby(["rank", "correlation"])["ts_us"].first()


def assign_steps(ops: pd.DataFrame, steps: pd.DataFrame, events: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """A `step` column (-1 outside any step). GPU kernels are placed by their GPU-side span when steps
    came from gpu_user_annotation, else by the CPU time of their launch."""
    ops = ops.copy()
    ops["step"] = -1
    if steps.empty or ops.empty:
        return ops
    place = ops["ts_us"].to_numpy().copy()
    if ops.attrs.get("device") == "gpu" and steps["source"].iloc[0] == "user_annotation" and events is not None:
        lt = launch_times(events)
        idx = pd.MultiIndex.from_arrays([ops["rank"], ops["correlation"]])
        launch = lt.reindex(idx).to_numpy()
        place = np.where(np.isnan(launch), place, launch)
    out = np.full(len(ops), -1)
    for rank, st in steps.groupby("rank"):
        mask = (ops["rank"] == rank).to_numpy()
        starts, ends = st["start_us"].to_numpy(), st["end_us"].to_numpy()
        pos = np.searchsorted(starts, place[mask], side="right") - 1
        ok = (pos >= 0) & (place[mask] <= ends[np.clip(pos, 0, None)])
        out[np.where(mask)[0][ok]] = st["step"].to_numpy()[pos[ok]]
    ops["step"] = out
    return ops


# ---- breakdowns ------------------------------------------------------------------------------------
def category_breakdown(ops: pd.DataFrame) -> pd.DataFrame:
    """Per rank and category: total time, share of the rank's time, count, mean per call."""
    g = ops.groupby(["rank", "category"], observed=True).agg(time_us=("time_us", "sum"), calls=("counted", "sum"))
    g = g.reset_index()
    g["share"] = g["time_us"] / g.groupby("rank")["time_us"].transform("sum")
    g["mean_us"] = g["time_us"] / g["calls"]
    return g.sort_values(["rank", "time_us"], ascending=[True, False]).reset_index(drop=True)


def calls_per_step(ops: pd.DataFrame, steps: pd.DataFrame, kind: str = "decode") -> pd.DataFrame:
    """Per rank and category: median calls and time per step, over steps of one kind."""
    chosen = steps[steps["kind"] == kind] if kind in set(steps["kind"]) else steps
    keys = set(zip(chosen["rank"], chosen["step"]))
    sel = ops[[k in keys for k in zip(ops["rank"], ops["step"])]]
    per = sel.groupby(["rank", "step", "category"], observed=True).agg(calls=("counted", "sum"),
                                                                        time_us=("time_us", "sum")).reset_index()
    # steps with no call of a category count as 0
    full = (pd.MultiIndex.from_frame(chosen[["rank", "step"]]).to_frame(index=False)
            .merge(pd.DataFrame({"category": per["category"].unique()}), how="cross"))
    per = full.merge(per, on=["rank", "step", "category"], how="left").fillna({"calls": 0, "time_us": 0.0})
    out = per.groupby(["rank", "category"], observed=True).agg(
        calls_per_step=("calls", "median"), calls_min=("calls", "min"), calls_max=("calls", "max"),
        time_per_step_us=("time_us", "median"), steps=("step", "nunique")).reset_index()
    return out.sort_values(["rank", "time_per_step_us"], ascending=[True, False]).reset_index(drop=True)


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts)
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > run_end[:-1]]
    group = np.cumsum(new) - 1
    seg_start = s[new]
    seg_end = pd.Series(run_end).groupby(group).max().to_numpy()
    return float((seg_end - seg_start).sum())


def busy_vs_sum(ops: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per step: summed op time, union of busy intervals over all streams/threads, and the wall span.
    Summed > busy when streams overlap (the mission's 21.7 vs 12.1 ms); wall - busy is idle time."""
    rows = []
    ops = ops[ops["step"] >= 0]
    for (rank, step), g in ops.groupby(["rank", "step"]):
        # CPU ops nest: their union comes from the raw spans, their sum from self times
        s = g["ts_us"].to_numpy()
        e = s + g["dur_us"].to_numpy()
        busy = _union_length(s, e)
        rows.append({"rank": rank, "step": step, "summed_us": float(g["time_us"].sum()), "busy_us": busy,
                     "first_us": float(s.min()), "last_us": float(e.max()), "lanes": g["lane"].nunique()})
    df = pd.DataFrame(rows, columns=["rank", "step", "summed_us", "busy_us", "first_us", "last_us", "lanes"])
    if df.empty:
        return df
    df = df.merge(steps[["rank", "step", "wall_us", "kind"]], on=["rank", "step"], how="left")
    df["span_us"] = df["last_us"] - df["first_us"]
    df["idle_us"] = (df[["wall_us", "span_us"]].max(axis=1) - df["busy_us"]).clip(lower=0)
    df["overlap_ratio"] = df["summed_us"] / df["busy_us"].where(df["busy_us"] > 0)
    return df


def idle_gaps(ops: pd.DataFrame, lane_filter: Optional[str] = None) -> pd.DataFrame:
    """Gaps between consecutive pieces of work per rank (all lanes merged), in-step only."""
    rows = []
    for (rank, step), g in ops[ops["step"] >= 0].groupby(["rank", "step"]):
        s = g["ts_us"].to_numpy()
        e = s + g["dur_us"].to_numpy()
        order = np.argsort(s)
        s, e = s[order], np.maximum.accumulate(e[order])
        gaps = s[1:] - e[:-1]
        gaps = gaps[gaps > 0]
        rows.append({"rank": rank, "step": step, "gaps": len(gaps), "gap_total_us": float(gaps.sum()),
                     "gap_p50_us": float(np.median(gaps)) if len(gaps) else 0.0,
                     "gap_max_us": float(gaps.max()) if len(gaps) else 0.0})
    return pd.DataFrame(rows)


def collective_skew(ops: pd.DataFrame, categories=ALLREDUCE_CATEGORIES) -> pd.DataFrame:
    """Each collective instance matched across ranks (the k-th call of a category on every rank is the
    same instance: collectives are issued in program order). Its minimum duration is the transfer;
    the excess on the other ranks is time spent waiting for the slowest rank to arrive."""
    coll = ops[ops["category"].isin(categories) & ops["counted"]].copy()
    if coll.empty or coll["rank"].nunique() < 2:
        return pd.DataFrame(columns=["category", "instance", "rank", "dur_us", "transfer_us", "wait_us"])
    coll = coll.sort_values(["rank", "ts_us"])
    coll["instance"] = coll.groupby(["rank", "category"], observed=True).cumcount()
    n_ranks = coll["rank"].nunique()
    complete = coll.groupby(["category", "instance"], observed=True)["rank"].transform("nunique") == n_ranks
    coll = coll[complete]
    coll["transfer_us"] = coll.groupby(["category", "instance"], observed=True)["dur_us"].transform("min")
    coll["wait_us"] = coll["dur_us"] - coll["transfer_us"]
    return coll[["category", "instance", "rank", "step", "ts_us", "dur_us", "transfer_us", "wait_us", "msg_bytes"]]


def calls_with_wait(ops: pd.DataFrame, categories=ALLREDUCE_CATEGORIES,
                    wait_categories=WAIT_CATEGORIES) -> pd.DataFrame:
    """Where a collective waits in an op of its own (gloo through the functional collectives: the
    all-reduce op, then its wait_tensor), each call as a step pays it: its op plus the wait ops that
    follow it on the rank's thread before the next call. Instances are matched across ranks as in
    collective_skew; `least_us` is the call at its least time over the ranks (the rank that arrived last
    waited for no one). Empty where no wait op follows the calls."""
    cols = ["instance", "rank", "step", "call_us", "least_us"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    sel = ops[ops["counted"].astype(bool)]
    calls = sel[sel["category"].isin(categories)].sort_values(["rank", "ts_us"])
    waits = sel[sel["category"].isin(wait_categories)].sort_values("ts_us")
    if calls.empty or waits.empty or calls["rank"].nunique() < 2:
        return pd.DataFrame(columns=cols)
    calls = calls[["rank", "step", "ts_us", "dur_us"]].reset_index(drop=True)
    calls["instance"] = calls.groupby("rank").cumcount()
    owner = pd.merge_asof(waits[["rank", "ts_us", "dur_us"]].rename(columns={"dur_us": "wait_us"}),
                          calls[["rank", "ts_us", "instance"]].sort_values("ts_us"), on="ts_us", by="rank",
                          direction="backward")
    wait = owner.dropna(subset=["instance"]).groupby(["rank", "instance"])["wait_us"].sum()
    calls = calls.join(wait, on=["rank", "instance"])
    calls["call_us"] = calls["dur_us"] + calls["wait_us"].fillna(0.0)
    complete = calls.groupby("instance")["rank"].transform("nunique") == calls["rank"].nunique()
    calls = calls[complete].copy()
    calls["least_us"] = calls.groupby("instance")["call_us"].transform("min")
    return calls[cols].reset_index(drop=True)


def skew_summary(skew: pd.DataFrame) -> pd.DataFrame:
    if skew.empty:
        return pd.DataFrame(columns=["rank", "category", "instances", "time_us", "transfer_us", "wait_us", "wait_share"])
    g = skew.groupby(["rank", "category"], observed=True).agg(instances=("instance", "size"), time_us=("dur_us", "sum"),
                                                              transfer_us=("transfer_us", "sum"),
                                                              wait_us=("wait_us", "sum")).reset_index()
    g["wait_share"] = g["wait_us"] / g["time_us"].where(g["time_us"] > 0)
    return g


def per_call_latency(ops: pd.DataFrame, categories=ALLREDUCE_CATEGORIES) -> pd.DataFrame:
    """Collective calls with their duration and message size (bytes when the trace recorded them)."""
    sel = ops[ops["category"].isin(categories) & ops["counted"]]
    return sel[["rank", "step", "category", "name", "dur_us", "msg_bytes"]].reset_index(drop=True)


def top_ops(ops: pd.DataFrame, n: int = 20) -> pd.DataFrame:
    g = ops.groupby(["name", "category"], observed=True).agg(time_us=("time_us", "sum"), calls=("counted", "sum"),
                                                             ranks=("rank", "nunique")).reset_index()
    g["mean_us"] = g["time_us"] / g["calls"]
    g["share"] = g["time_us"] / g["time_us"].sum()
    return g.sort_values("time_us", ascending=False).head(n).reset_index(drop=True)


def unknown_ops(ops: pd.DataFrame, n: int = 20) -> pd.DataFrame:
    """The largest names left in `other`: candidates for a new rule."""
    return top_ops(ops[ops["category"] == OTHER], n)


def expected_vs_observed(per_step: pd.DataFrame, expected_allreduce: Optional[int],
                         expected_allgather: Optional[int] = None) -> pd.DataFrame:
    """Per rank: all-reduce calls per decode step observed against what arch expects."""
    rows = []
    for rank, g in per_step.groupby("rank"):
        ar = g[g["category"].astype(str).isin(ALLREDUCE_CATEGORIES)]
        ag = g[g["category"].astype(str).isin(ALLGATHER_CATEGORIES)]
        rows.append({"rank": rank, "collective": "all_reduce", "expected_per_step": expected_allreduce,
                     "observed_per_step": float(ar["calls_per_step"].sum()),
                     "time_per_step_us": float(ar["time_per_step_us"].sum())})
        if expected_allgather is not None:
            rows.append({"rank": rank, "collective": "all_gather", "expected_per_step": expected_allgather,
                         "observed_per_step": float(ag["calls_per_step"].sum()),
                         "time_per_step_us": float(ag["time_per_step_us"].sum())})
    df = pd.DataFrame(rows)
    if not df.empty:
        df["matches"] = df["observed_per_step"] == df["expected_per_step"]
    return df
