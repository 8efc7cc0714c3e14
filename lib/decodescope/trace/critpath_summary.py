"""The wall step attributed by its critical path, beside the summed shares; collective waits named by the
rank and work waited for; and what each category's fix could buy at most."""
from __future__ import annotations

import numpy as np
import pandas as pd

from decodescope.trace.critpath_table import CriticalPaths
from decodescope.trace.critpath_whatif import bounds

MAX_REPLAY_STEPS = 32  # steps replayed per category for the bounds, spread evenly over the steps of the kind
STEPS_AT_ONCE = 256  # steps whose shares are summed at once: the sums' scratch a slice of the table's size


def _chosen(cp: CriticalPaths, kind: str) -> pd.DataFrame:
    w = cp.windows
    return w[w["kind"] == kind] if (w["kind"] == kind).any() else w


def _step_chunks(n: int) -> range:
    """Starts of the chunks of STEPS_AT_ONCE steps (one chunk where there is no step)."""
    return range(0, max(n, 1), STEPS_AT_ONCE)


def _in_rank_then_time_order(ops: pd.DataFrame) -> list[tuple[int, int]] | None:
    """The rows of each rank, (first, end), where the table is in (rank, start) order with no missing start
    (op_table's order); None otherwise."""
    rank, ts = ops["rank"].to_numpy(), ops["ts_us"].to_numpy(float)
    dr = np.diff(rank)
    if (dr < 0).any() or ((np.diff(ts) < 0) & (dr == 0)).any() or np.isnan(ts).any():
        return None
    cuts = np.r_[0, np.flatnonzero(dr) + 1, len(rank)].tolist()
    return list(zip(cuts[:-1], cuts[1:]))


def _summed_per_step(ops: pd.DataFrame, w: pd.DataFrame) -> pd.DataFrame:
    """Per step and category: the ops' summed time (all ranks) over all ops' summed time in the step. Summed
    a chunk of steps at a time (each step's ops whole in one chunk, in the table's order: the same sums)."""
    order = np.argsort(w["start_us"].to_numpy())
    starts, ends = w["start_us"].to_numpy()[order], w["end_us"].to_numpy()[order]
    steps = w["step"].to_numpy()[order]
    ts = ops["ts_us"].to_numpy(float)
    blocks = _in_rank_then_time_order(ops)
    parts = []
    for k0 in _step_chunks(len(starts)) if blocks is not None else [0]:
        if blocks is None:
            rows = np.arange(len(ts))
        else:  # the ops from the chunk's first start to the next chunk's: a run of rows on each rank
            t0 = starts[k0] if len(starts) else np.inf
            t1 = starts[k0 + STEPS_AT_ONCE] if k0 + STEPS_AT_ONCE < len(starts) else np.inf
            rows = np.concatenate([np.arange(a + np.searchsorted(ts[a:b], t0), a + np.searchsorted(ts[a:b], t1))
                                   for a, b in blocks] or [np.arange(0)])
        t = ts[rows]
        pos = np.searchsorted(starts, t, side="right") - 1
        ok = (pos >= 0) & (t < ends[np.clip(pos, 0, None)])
        rows = rows[ok]
        sel = pd.DataFrame({"step": steps[pos[ok]], "category": ops["category"].array[rows],
                            "time_us": ops["time_us"].to_numpy()[rows]})  # the three columns, not a copy of the table
        parts.append(sel.groupby(["step", "category"], observed=True)["time_us"].sum().reset_index())
    per = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    per["summed_share"] = per["time_us"] / per.groupby("step")["time_us"].transform("sum")
    return per


def _path_per_step(cp: CriticalPaths, w: pd.DataFrame) -> pd.Series:
    """Per step of `w` and category: the time on its path, a chunk of steps at a time (the segments come in
    step order: a chunk is a run of rows, each step whole in one)."""
    seg, want = cp.segments, w["step"].to_numpy()
    step = seg["step"].to_numpy()
    cols = ["step", "category", "dur_us"]
    if (np.diff(step) < 0).any() or (np.diff(want) < 0).any():
        chunks = [(0, len(seg), want)]
    else:
        chunks = [(int(np.searchsorted(step, c[0], side="left")) if len(c) else 0,
                   int(np.searchsorted(step, c[-1], side="right")) if len(c) else len(seg), c)
                  for c in (want[k:k + STEPS_AT_ONCE] for k in _step_chunks(len(want)))]
    parts = []
    for a, b, c in chunks:
        part = seg.iloc[a:b]
        part = part.loc[part["step"].isin(c).to_numpy(), cols]
        parts.append(part.groupby(["step", "category"], observed=True)["dur_us"].sum())
    return pd.concat(parts) if len(parts) > 1 else parts[0]


def attribution(cp: CriticalPaths, ops: pd.DataFrame, kind: str = "decode") -> pd.DataFrame:
    """Per category, over the steps of `kind`: its share of the wall step on the critical path (median,
    p10, p90), its median time on the path, and its summed share of op time (the breakdown's view)."""
    w = _chosen(cp, kind)
    per = _path_per_step(cp, w).unstack(fill_value=0.0)
    per = per.reindex(w["step"], fill_value=0.0)
    share = per.div(w.set_index("step")["wall_us"], axis=0)
    summed = _summed_per_step(ops, w).pivot(index="step", columns="category", values="summed_share")
    summed = summed.reindex(index=w["step"], fill_value=0.0).fillna(0.0)
    cats = sorted(set(share.columns.astype(str)) | set(summed.columns.astype(str)))
    rows = []
    for c in cats:
        sh = share[c].to_numpy() if c in share else np.zeros(len(w))
        rows.append({"category": c, "path_share_median": float(np.median(sh)) if len(sh) else 0.0,
                     "path_share_p10": float(np.percentile(sh, 10)) if len(sh) else 0.0,
                     "path_share_p90": float(np.percentile(sh, 90)) if len(sh) else 0.0,
                     "path_us_median": float(np.median(per[c])) if c in per and len(per) else 0.0,
                     "summed_share_median": float(np.median(summed[c])) if c in summed and len(summed) else 0.0})
    out = pd.DataFrame(rows)
    return out.sort_values("path_share_median", ascending=False).reset_index(drop=True)


def collective_waits(cp: CriticalPaths, kind: str = "decode") -> pd.DataFrame:
    """Per collective category and the rank waited for: the waiting per step (median over the steps of
    `kind`, summed over the waiting ranks) and the work that rank ran just before it entered."""
    p, ln, lab = cp.labelled.pieces, cp.links, cp.labelled
    w = _chosen(cp, kind)
    rows, last = ln.late.astype(np.int64), ln.late_last.astype(np.int64)
    cols = ["category", "late_rank", "late_work", "wait_us_per_step", "instances"]
    if not len(rows) or w.empty:
        return pd.DataFrame(columns=cols)
    order = np.argsort(w["start_us"].to_numpy())
    starts, ends = w["start_us"].to_numpy()[order], w["end_us"].to_numpy()[order]
    pos = np.searchsorted(starts, p.start[rows], side="right") - 1
    ok = (pos >= 0) & (p.start[rows] < ends[np.clip(pos, 0, None)])
    rows, pos, last = rows[ok], pos[ok], last[ok]
    before = ln.pred[last]
    cat = lab.category_labels
    late_work = np.where(before >= 0, cat[lab.category_code[np.clip(before, 0, None)]], "(step start)")
    df = pd.DataFrame({"step": w["step"].to_numpy()[order][pos], "category": cat[lab.category_code[rows]],
                       "late_rank": p.rank[last].astype(np.int64), "late_work": late_work,
                       "wait_us": ln.entry_at(rows) - p.start[rows]})
    g = df.groupby(["category", "late_rank", "late_work", "step"])["wait_us"].agg(["sum", "size"]).reset_index()
    out = g.groupby(["category", "late_rank", "late_work"]).agg(
        wait_us_per_step=("sum", lambda s: float(np.median(np.r_[s.to_numpy(), np.zeros(len(w) - len(s))]))),
        instances=("size", "sum")).reset_index()
    return out.sort_values("wait_us_per_step", ascending=False).reset_index(drop=True)[cols]


def fix_bounds(cp: CriticalPaths, kind: str = "decode", speedup: float = float("inf"),
               categories: list[str] | None = None, max_steps: int = MAX_REPLAY_STEPS) -> pd.DataFrame:
    """Per category: the step's wall time with it `speedup` times faster (inf: free), median over up to
    max_steps steps of `kind`, and the most a fix of it could gain (share of the wall step)."""
    w = _chosen(cp, kind)
    if len(w) > max_steps:
        w = w.iloc[np.linspace(0, len(w) - 1, max_steps).round().astype(int)]
    lab = cp.labelled
    on_ops = cp.segments["segment"].isin(["op", "transfer"]).to_numpy()
    on_path = {str(c) for c in cp.segments.loc[on_ops, "category"].unique()}  # not a str per segment
    cats = categories if categories is not None else sorted(on_path - {"launch", "host"})
    walls = w["wall_us"].to_numpy()
    code_of = {str(c): k for k, c in enumerate(lab.category_labels)}
    want = [code_of.get(c, -1 - k) for k, c in enumerate(cats)]  # a category no piece has: a code none has
    got = bounds(lab.pieces, cp.links, w["start_us"].to_numpy(), w["end_us"].to_numpy(), lab.category_code, want,
                 speedup)
    rows = [{"category": c, "wall_us_median": float(np.median(walls)) if len(walls) else float("nan"),
             "bound_wall_us_median": float(np.median(v)) if len(v) else float("nan"),
             "gain_share_median": float(np.median(1 - v / walls)) if len(v) else float("nan"),
             "steps": int(len(v)), "speedup": speedup} for c, v in zip(cats, got.values())]
    return pd.DataFrame(rows).sort_values("gain_share_median", ascending=False).reset_index(drop=True)
