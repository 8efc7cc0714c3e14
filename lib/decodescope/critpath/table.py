"""A trace's steps -> their critical paths as a table of segments (rank, lane, op, category, or a gap),
each step's segments summing to its wall time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from decodescope.critpath.path import SEGMENT_KINDS, Links, Walk, ordered_segments, walk_all
from decodescope.critpath.pieces import Labelled, path_category_codes, pieces_of

SEGMENT_COLUMNS = ["step", "step_kind", "rank", "lane", "on_cpu", "name", "category", "segment", "start_us",
                   "dur_us", "piece"]


@dataclass
class CriticalPaths:
    """`windows`: one row per step (step, kind, start_us, end_us, wall_us, ranks); `segments`: the paths
    (SEGMENT_COLUMNS; `category` is the op's, or the gap's kind: host, launch, idle)."""

    windows: pd.DataFrame
    segments: pd.DataFrame
    labelled: Labelled
    links: Links
    walks: list[Walk]


def steps_of_kind(cp: "CriticalPaths", kind: str) -> pd.DataFrame:
    """The step windows of `kind` (decode, prefill, ...); all of them where there is none of that kind."""
    w = cp.windows
    return w[w["kind"] == kind] if (w["kind"] == kind).any() else w


def step_windows(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps matched across ranks by their order: each window from the first rank's start to the last
    rank's end; only steps every rank has."""
    if steps.empty:
        return pd.DataFrame(columns=["step", "kind", "start_us", "end_us", "wall_us", "ranks"])
    n_ranks = steps["rank"].nunique()
    g = steps.groupby("step")
    w = pd.DataFrame({"kind": g["kind"].first(), "start_us": g["start_us"].min(), "end_us": g["end_us"].max(),
                      "ranks": g["rank"].nunique()}).reset_index()
    w = w[w["ranks"] == n_ranks].reset_index(drop=True)
    w["wall_us"] = w["end_us"] - w["start_us"]
    return w[["step", "kind", "start_us", "end_us", "wall_us", "ranks"]]


def critical_paths(events: pd.DataFrame, ops: pd.DataFrame, steps: pd.DataFrame) -> CriticalPaths:
    """The critical path of every step found on all ranks (trace.analyze.find_steps' steps)."""
    lab = pieces_of(events, ops)
    windows = step_windows(steps)
    ln, walks = walk_all(lab.pieces, windows["start_us"].to_numpy(float), windows["end_us"].to_numpy(float))
    seg = ordered_segments(lab.pieces, walks)
    return CriticalPaths(windows=windows, segments=_label(seg, lab, windows), labelled=lab, links=ln, walks=walks)


def _label(seg: dict, lab: Labelled, windows: pd.DataFrame) -> pd.DataFrame:
    """The segments (in the table's order: critpath.ordered_segments) labelled, each column made once from
    codes, and each of `seg`'s columns let go (popped) once used."""
    step_pos, piece, kind = seg.pop("step"), seg.pop("piece"), seg.pop("kind")
    start, dur = seg.pop("start_us"), seg.pop("end_us")
    dur -= start
    p = lab.pieces
    safe = np.clip(piece, 0, None)
    is_op = (kind <= 1) & (piece >= 0)
    kinds = np.array(SEGMENT_KINDS, dtype=object)
    if len(p):  # an op's name and category, a gap's kind: codes into the labels with the kinds after them
        name = _categorical_codes(np.where(is_op, lab.name_code[safe], len(lab.name_labels)),
                                  np.r_[lab.name_labels, np.array([""], dtype=object)])
        gap = kind.astype(np.int32) + len(lab.category_labels)
        cat_code = lab.category_code if p.member_wait is None else path_category_codes(lab)  # a wait: its collective
        category = _categorical_codes(np.where(is_op, cat_code[safe], gap), np.r_[lab.category_labels, kinds])
        del gap
    else:
        name, category = _categorical(np.where(is_op, "", "")), _categorical(kinds[kind])
    return pd.DataFrame({
        "step": windows["step"].to_numpy()[step_pos] if len(step_pos) else np.empty(0, np.int64),
        "step_kind": _categorical_codes(step_pos, windows["kind"].to_numpy()),
        "rank": np.where(piece >= 0, p.rank[safe], np.int64(-1)) if len(p) else -1,  # int64, as the rank held
        "lane": np.where(piece >= 0, lab.lane_tid[p.lane[safe]], -1) if len(p) else -1,
        "on_cpu": p.on_cpu[safe] if len(p) else False,
        "name": name,
        "category": category,
        "segment": _categorical_codes(kind, kinds),
        "start_us": start,
        "dur_us": dur,
        "piece": piece,
    }, copy=False)


def _categorical_codes(codes: np.ndarray, labels: np.ndarray) -> pd.Categorical:
    """_categorical(labels[codes]), made from the codes: only the labels used are factorized (labels may
    repeat: equal ones become one category)."""
    if not len(codes):
        return _categorical(labels[codes])
    used = np.flatnonzero(np.bincount(codes, minlength=len(labels)))
    sub, uniques = pd.factorize(labels[used], sort=True)
    remap = np.full(len(labels), -1, np.int64)
    remap[used] = sub
    return pd.Categorical.from_codes(remap[codes], categories=pd.Index(uniques, dtype="str"))


def _categorical(values: np.ndarray) -> pd.Categorical:
    """An object array of str as the categorical .astype("category") makes of a str column (its categories
    sorted, of str dtype), factorized from the objects as they are: no str column made on the way."""
    if not len(values):
        return pd.Categorical(values)
    codes, uniques = pd.factorize(values, sort=True)
    return pd.Categorical.from_codes(codes, categories=pd.Index(uniques, dtype="str"))
