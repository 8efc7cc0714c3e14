"""Every collective instance split into arrival skew and transfer, and where each part sits on the path.

An instance is one collective across the ranks (critpath_pieces: the k-th call of its category on every
rank; a rank's wait op joins the call it waits for). Per instance:
- a rank's entry is its first entering piece's start; its end is its last piece's end (its wait's, where
  it has one);
- arrival skew = last entry - first entry: the time the first rank in could not go on because of the last;
  the late rank is the last one in, and its late work what it ran just before it entered;
- transfer = end - last entry, the end being the earliest rank's end (the data was there for that rank),
  at least the last entry: the time the collective itself took once every rank was in;
- waited = the ranks' summed time blocked in it before the last entry (an async call that returned at
  once waited only in its wait op).
On the path: the transfer of an instance is on it where the step's path holds the instance's transfer
segments; its skew then lies on the path too, as the stretch from the first entry to the last one, since
the path went on from the last rank's entry (critpath.walk_step).

Each instance gets a class (the thresholds in docs/methods.md):
- inconclusive: skew + transfer under INCONCLUSIVE_US (the profiler's timestamps are 1 us apart);
- skew-bound: skew at least DOMINANT x the transfer;
- transfer-bound: the transfer at least DOMINANT x the skew;
- mixed: neither.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from decodescope.critpath.table import CriticalPaths, steps_of_kind

INCONCLUSIVE_US = 2.0  # skew + transfer under this: below what the trace's 1 us timestamps can tell apart
DOMINANT = 2.0  # a part at least this many times the other names the instance's class
CLASSES = ("skew-bound", "transfer-bound", "mixed", "inconclusive")
SPLIT_COLUMNS = ["step", "category", "group", "first_entry_us", "last_entry_us", "end_us", "skew_us",
                 "transfer_us", "waited_us", "late_rank", "late_work", "instance_class", "transfer_on_path_us",
                 "skew_on_path_us"]


def instance_class(skew_us: np.ndarray, transfer_us: np.ndarray) -> np.ndarray:
    """Each instance's class from its two parts (module docstring)."""
    skew_us, transfer_us = np.asarray(skew_us, float), np.asarray(transfer_us, float)
    out = np.full(len(skew_us), "mixed", dtype=object)
    out[transfer_us >= DOMINANT * skew_us] = "transfer-bound"
    out[skew_us >= DOMINANT * transfer_us] = "skew-bound"
    out[skew_us + transfer_us < INCONCLUSIVE_US] = "inconclusive"
    return out


def collective_split(cp: CriticalPaths, kind: str = "decode") -> pd.DataFrame:
    """One row per collective instance whose last entry falls in a step of `kind` (all steps where none is):
    SPLIT_COLUMNS (module docstring)."""
    lab, ln = cp.labelled, cp.links
    p = lab.pieces
    rows = np.flatnonzero(p.group >= 0)
    w = steps_of_kind(cp, kind)
    if not len(rows) or w.empty:
        return pd.DataFrame(columns=SPLIT_COLUMNS)
    waits = p.member_wait[rows] if p.member_wait is not None else np.zeros(len(rows), bool)
    m = pd.DataFrame({"piece": rows, "group": p.group[rows], "rank": p.rank[rows], "start": p.start[rows],
                      "end": p.end[rows], "enters": ~waits})
    per_rank = m.groupby(["group", "rank"]).agg(end=("end", "max"))
    per_rank["entry"] = m[m["enters"]].groupby(["group", "rank"])["start"].min()
    per_rank = per_rank.dropna(subset=["entry"]).reset_index()
    g = per_rank.groupby("group")
    inst = pd.DataFrame({"first_entry_us": g["entry"].min(), "last_entry_us": g["entry"].max(),
                         "end_us": g["end"].min()})
    inst["end_us"] = np.maximum(inst["end_us"], inst["last_entry_us"])
    inst["skew_us"] = inst["last_entry_us"] - inst["first_entry_us"]
    inst["transfer_us"] = inst["end_us"] - inst["last_entry_us"]
    # the time blocked before the last entry: pieces that were waiting on it (critpath.link's late pieces)
    late = ln.late.astype(np.int64)
    blocked = pd.Series(ln.entry_at(late) - p.start[late], index=p.group[late]).groupby(level=0).sum()
    inst["waited_us"] = blocked.reindex(inst.index, fill_value=0.0)
    inst = _late_rank(inst, m, lab, ln)
    # the step each instance belongs to: the window holding its last entry
    order = np.argsort(w["start_us"].to_numpy())
    starts, ends = w["start_us"].to_numpy()[order], w["end_us"].to_numpy()[order]
    t = inst["last_entry_us"].to_numpy()
    pos = np.searchsorted(starts, t, side="right") - 1
    ok = (pos >= 0) & (t < ends[np.clip(pos, 0, None)])
    inst = inst[ok].copy()
    inst["step"] = w["step"].to_numpy()[order][pos[ok]]
    inst["step_start_us"] = starts[pos[ok]]
    inst["instance_class"] = instance_class(inst["skew_us"].to_numpy(), inst["transfer_us"].to_numpy())
    inst = _on_path(inst, cp)
    inst = inst.reset_index().rename(columns={"index": "group"})
    return inst[SPLIT_COLUMNS].sort_values(["step", "last_entry_us"]).reset_index(drop=True)


def _late_rank(inst: pd.DataFrame, m: pd.DataFrame, lab, ln) -> pd.DataFrame:
    """The rank that entered last, the instance's category (its entering pieces'), and what the late rank
    ran just before it entered (its entering piece's binding dependency's category; "host" where the gap
    after that is half the skew or more; "(step start)": none)."""
    ent = m[m["enters"]].sort_values(["group", "start"], kind="stable")
    last = ent.groupby("group").tail(1).set_index("group")["piece"].reindex(inst.index).to_numpy(np.int64)
    p = lab.pieces
    inst["late_rank"] = p.rank[last].astype(np.int64)
    cats = lab.category_labels
    inst["category"] = cats[lab.category_code[last]]
    before = ln.pred[last]
    b = np.clip(before, 0, None)
    work = np.where(before >= 0, cats[lab.category_code[b]], "(step start)").astype(object)
    # where the gap between that work and the entry is the larger part of the skew, the host held it
    gap = np.where(before >= 0, p.start[last] - p.end[b], 0.0)
    work[(before >= 0) & (gap >= 0.5 * inst["skew_us"].to_numpy()) & (gap > 0)] = "host"
    inst["late_work"] = work
    return inst


def _on_path(inst: pd.DataFrame, cp: CriticalPaths) -> pd.DataFrame:
    """Each instance's transfer on its step's path (its transfer segments' time there) and, where that is
    any, its skew on the path (first to last entry, within the step)."""
    seg = cp.segments
    tr = seg[(seg["segment"] == "transfer").to_numpy() & (seg["piece"].to_numpy() >= 0)]
    grp = cp.labelled.pieces.group[tr["piece"].to_numpy()]
    on = pd.Series(tr["dur_us"].to_numpy(), index=grp).groupby(level=0).sum()
    inst["transfer_on_path_us"] = on.reindex(inst.index, fill_value=0.0).to_numpy()
    skew_in_step = inst["last_entry_us"] - np.maximum(inst["first_entry_us"], inst["step_start_us"])
    inst["skew_on_path_us"] = np.where(inst["transfer_on_path_us"] > 0, skew_in_step, 0.0)
    return inst


def split_summary(split: pd.DataFrame, steps: int) -> pd.DataFrame:
    """Per instance category: per step (medians over the `steps` steps, a step without an instance of the
    category counting zero) the instances, their skew and transfer summed, on the path and in all; and the
    share of its instances in each class."""
    cols = ["category", "instances_per_step", "skew_us_per_step", "transfer_us_per_step", "waited_us_per_step",
            "skew_on_path_us_per_step", "transfer_on_path_us_per_step"] + [f"share_{c.replace('-', '_')}"
                                                                          for c in CLASSES]
    if split.empty or steps <= 0:
        return pd.DataFrame(columns=cols)
    out = []
    for cat, d in split.groupby("category", observed=True):
        per = d.groupby("step").agg(n=("group", "size"), skew=("skew_us", "sum"), transfer=("transfer_us", "sum"),
                                    waited=("waited_us", "sum"), skew_on=("skew_on_path_us", "sum"),
                                    transfer_on=("transfer_on_path_us", "sum"))
        pad = max(steps - len(per), 0)

        def med(c: str) -> float:
            return float(np.median(np.r_[per[c].to_numpy(float), np.zeros(pad)]))

        row = {"category": str(cat), "instances_per_step": med("n"), "skew_us_per_step": med("skew"),
               "transfer_us_per_step": med("transfer"), "waited_us_per_step": med("waited"),
               "skew_on_path_us_per_step": med("skew_on"), "transfer_on_path_us_per_step": med("transfer_on")}
        share = d["instance_class"].value_counts(normalize=True)
        row.update({f"share_{c.replace('-', '_')}": float(share.get(c, 0.0)) for c in CLASSES})
        out.append(row)
    return pd.DataFrame(out, columns=cols).sort_values("transfer_on_path_us_per_step", ascending=False,
                                                       ignore_index=True)
