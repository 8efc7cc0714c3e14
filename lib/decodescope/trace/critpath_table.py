"""A trace's steps -> their critical paths as a table of segments (rank, lane, op, category, or a gap),
each step's segments summing to its wall time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from decodescope.trace.critpath import SEGMENT_KINDS, Links, Walk, segments, walk_all
from decodescope.trace.critpath_pieces import Labelled, pieces_of

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
    seg = segments(lab.pieces, walks)
    return CriticalPaths(windows=windows, segments=_label(seg, lab, windows), labelled=lab, links=ln, walks=walks)


def _label(seg: dict, lab: Labelled, windows: pd.DataFrame) -> pd.DataFrame:
    """The segments labelled, in (step, start) order: each column made in that order at once (no sorted
    copy of the table)."""
    step_pos = seg["step"].astype(np.int64)
    step = windows["step"].to_numpy()[step_pos] if len(step_pos) else np.empty(0, np.int64)
    order = np.lexsort((seg["start_us"], step))
    piece, kind, step_pos, step = seg["piece"].astype(np.int64)[order], seg["kind"].astype(np.int64)[order], \
        step_pos[order], step[order]
    safe = np.clip(piece, 0, None)
    p = lab.pieces
    names = np.array(SEGMENT_KINDS, dtype=object)[kind]
    is_op = (kind <= 1) & (piece >= 0)
    return pd.DataFrame({
        "step": step,
        "step_kind": _categorical(windows["kind"].to_numpy()[step_pos] if len(step_pos) else np.empty(0, object)),
        "rank": np.where(piece >= 0, p.rank[safe], -1) if len(p) else -1,
        "lane": np.where(piece >= 0, lab.lane_id[safe], -1) if len(p) else -1,
        "on_cpu": p.on_cpu[safe] if len(p) else False,
        "name": _categorical(np.where(is_op, lab.name[safe] if len(p) else "", "")),
        "category": _categorical(np.where(is_op, lab.category[safe] if len(p) else "", names)),
        "segment": _categorical(names),
        "start_us": seg["start_us"][order],
        "dur_us": (seg["end_us"] - seg["start_us"])[order],
        "piece": piece,
    }, copy=False)


def _categorical(values: np.ndarray) -> pd.Categorical:
    """An object array of str as the categorical .astype("category") makes of a str column (its categories
    sorted, of str dtype), factorized from the objects as they are: no str column made on the way."""
    if not len(values):
        return pd.Categorical(values)
    codes, uniques = pd.factorize(values, sort=True)
    return pd.Categorical.from_codes(codes, categories=pd.Index(uniques, dtype="str"))
