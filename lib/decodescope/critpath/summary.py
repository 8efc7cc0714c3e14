"""The wall step attributed by its critical path, beside the summed shares; collective waits named by the
rank and work waited for; and what each category's fix could buy at most."""
from __future__ import annotations

import numpy as np
import pandas as pd

from decodescope.critpath.table import CriticalPaths, steps_of_kind
from decodescope.trace.categorize import class_of
from decodescope.critpath.pieces import instance_codes
from decodescope.critpath.whatif import Fix, fix_walls

MAX_REPLAY_STEPS = 32  # steps replayed per category for the bounds, spread evenly over the steps of the kind
STEPS_AT_ONCE = 256  # steps whose shares are summed at once: the sums' scratch a slice of the table's size


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
    w = steps_of_kind(cp, kind)
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
    w = steps_of_kind(cp, kind)
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


HOST_CATEGORIES = ("host", "launch")  # the path's host-side categories (critpath_pieces: HOST_, LAUNCH_CATEGORY)


def path_fixes(cp: CriticalPaths) -> tuple[list[Fix], dict]:
    """The fixes a path can be replayed under, and the per-piece code arrays they read: each category on the
    path free (a collective's category: its instances' transfer, waits included, the skew kept); each
    verdict class with several categories on the path free at once; the host free (host and launch calls,
    and the delay before every CPU piece); and no arrival skew (every rank going on as if the others had
    entered with it)."""
    lab = cp.labelled
    seg = cp.segments
    on_ops = seg["segment"].isin(["op"]).to_numpy()
    on_tr = seg["segment"].isin(["transfer"]).to_numpy()
    op_cats = {str(c) for c in seg.loc[on_ops, "category"].unique()} - set(HOST_CATEGORIES)
    tr_cats = {str(c) for c in seg.loc[on_tr, "category"].unique()}
    code_of = {str(c): k for k, c in enumerate(lab.category_labels)}
    fields = {"category": lab.category_code, "instance": instance_codes(lab)}
    fixes = [Fix(name=c, kind="category", codes=(code_of.get(c, -1),)) for c in sorted(op_cats - tr_cats)]
    fixes += [Fix(name=f"{c} transfer", kind="transfer", field="instance", codes=(code_of.get(c, -1),))
              for c in sorted(tr_cats)]
    by_class: dict[str, list[str]] = {}
    for c in sorted(op_cats - tr_cats):
        by_class.setdefault(class_of(c), []).append(c)
    fixes += [Fix(name=f"{cls} (all)", kind="class", codes=tuple(code_of[c] for c in cs if c in code_of))
              for cls, cs in sorted(by_class.items()) if len(cs) > 1]
    host = tuple(code_of[c] for c in HOST_CATEGORIES if c in code_of)
    fixes.append(Fix(name="host", kind="host", codes=host, host=True))
    if (lab.pieces.group >= 0).any():
        fixes.append(Fix(name="arrival skew", kind="skew", skew_free=True))
    return fixes, fields


def fix_bounds(cp: CriticalPaths, kind: str = "decode", speedup: float = float("inf"),
               categories: list[str] | None = None, max_steps: int = MAX_REPLAY_STEPS) -> pd.DataFrame:
    """Per fix (path_fixes; `categories`: only those categories, each freed alone): the step's wall time with
    what it frees `speedup` times faster (inf: free), median over up to max_steps steps of `kind`, and the
    most the fix could gain (share of the wall step)."""
    w = steps_of_kind(cp, kind)
    if len(w) > max_steps:
        w = w.iloc[np.linspace(0, len(w) - 1, max_steps).round().astype(int)]
    lab = cp.labelled
    if categories is not None:
        code_of = {str(c): k for k, c in enumerate(lab.category_labels)}
        fixes = [Fix(name=c, kind="category", codes=(code_of.get(c, -1 - k),)) for k, c in enumerate(categories)]
        fields = {"category": lab.category_code}
    else:
        fixes, fields = path_fixes(cp)
    walls = w["wall_us"].to_numpy()
    got = fix_walls(lab.pieces, cp.links, w["start_us"].to_numpy(), w["end_us"].to_numpy(), fields, fixes, speedup)
    rows = [{"category": f.name, "kind": f.kind,
             "wall_us_median": float(np.median(walls)) if len(walls) else float("nan"),
             "bound_wall_us_median": float(np.median(v)) if len(v) else float("nan"),
             "gain_share_median": float(np.median(1 - v / walls)) if len(v) else float("nan"),
             "steps": int(len(v)), "speedup": speedup} for f, v in ((f, got[f.name]) for f in fixes)]
    return pd.DataFrame(rows).sort_values("gain_share_median", ascending=False).reset_index(drop=True)
