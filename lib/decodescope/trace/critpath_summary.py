"""The wall step attributed by its critical path, beside the summed shares; collective waits named by the
rank and work waited for; and what each category's fix could buy at most."""
from __future__ import annotations

import numpy as np
import pandas as pd

from decodescope.trace.critpath_table import CriticalPaths
from decodescope.trace.critpath_whatif import bounds

MAX_REPLAY_STEPS = 32  # steps replayed per category for the bounds, spread evenly over the steps of the kind


def _chosen(cp: CriticalPaths, kind: str) -> pd.DataFrame:
    w = cp.windows
    return w[w["kind"] == kind] if (w["kind"] == kind).any() else w


def _summed_per_step(ops: pd.DataFrame, w: pd.DataFrame) -> pd.DataFrame:
    """Per step and category: the ops' summed time (all ranks) over all ops' summed time in the step."""
    order = np.argsort(w["start_us"].to_numpy())
    starts, ends = w["start_us"].to_numpy()[order], w["end_us"].to_numpy()[order]
    ts = ops["ts_us"].to_numpy(float)
    pos = np.searchsorted(starts, ts, side="right") - 1
    ok = (pos >= 0) & (ts < ends[np.clip(pos, 0, None)])
    sel = pd.DataFrame({"step": w["step"].to_numpy()[order][pos[ok]], "category": ops["category"].array[ok],
                        "time_us": ops["time_us"].to_numpy()[ok]})  # the three columns, not a copy of the table
    per = sel.groupby(["step", "category"], observed=True)["time_us"].sum().reset_index()
    per["summed_share"] = per["time_us"] / per.groupby("step")["time_us"].transform("sum")
    return per


def attribution(cp: CriticalPaths, ops: pd.DataFrame, kind: str = "decode") -> pd.DataFrame:
    """Per category, over the steps of `kind`: its share of the wall step on the critical path (median,
    p10, p90), its median time on the path, and its summed share of op time (the breakdown's view)."""
    w = _chosen(cp, kind)
    seg = cp.segments.loc[cp.segments["step"].isin(w["step"]).to_numpy(), ["step", "category", "dur_us"]]
    per = seg.groupby(["step", "category"], observed=True)["dur_us"].sum().unstack(fill_value=0.0)
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
    rows = np.flatnonzero(ln.last >= 0)
    cols = ["category", "late_rank", "late_work", "wait_us_per_step", "instances"]
    if not len(rows) or w.empty:
        return pd.DataFrame(columns=cols)
    order = np.argsort(w["start_us"].to_numpy())
    starts, ends = w["start_us"].to_numpy()[order], w["end_us"].to_numpy()[order]
    pos = np.searchsorted(starts, p.start[rows], side="right") - 1
    ok = (pos >= 0) & (p.start[rows] < ends[np.clip(pos, 0, None)])
    rows, pos = rows[ok], pos[ok]
    last = ln.last[rows]
    before = ln.pred[last]
    cat = lab.category_labels
    late_work = np.where(before >= 0, cat[lab.category_code[np.clip(before, 0, None)]], "(step start)")
    df = pd.DataFrame({"step": w["step"].to_numpy()[order][pos], "category": cat[lab.category_code[rows]],
                       "late_rank": p.rank[last].astype(np.int64), "late_work": late_work, "wait_us": ln.entry[rows] - p.start[rows]})
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
