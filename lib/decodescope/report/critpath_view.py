"""04's critical-path section: one median step's path drawn across ranks and lanes, and the wall step's
shares on the path beside the summed shares (data/profile/c<N>/critical_path.json)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from decodescope.schema.records import frame, read_record
from decodescope.schema.records_critpath import (CRITICAL_PATH_RECORD, CriticalPathSummary, CritPathShareRow,
                                                 SkewCalibration, SkewCalibrationRow)
from decodescope.schema.rundata import level_dir_name
from decodescope.show.display import show_note, show_table
from decodescope.critpath.table import CriticalPaths
from decodescope.profiling.levels import ProfiledLevel

PATH_COLOURS = {"host": "#b0b0b0", "launch": "#f2a65a", "idle": "#e0e0e0"}


def median_step(cp: CriticalPaths, kind: str) -> Optional[int]:
    """The step of `kind` (all steps where kind is 'all') whose wall time is nearest the median."""
    w = cp.windows if kind == "all" else cp.windows[cp.windows["kind"] == kind]
    if w.empty:
        return None
    return int(w.iloc[int((w["wall_us"] - w["wall_us"].median()).abs().to_numpy().argmin())]["step"])


def _lane_label(rank: np.ndarray, lane: np.ndarray, on_cpu: np.ndarray) -> list[str]:
    return [f"rank {r} · {'thread' if c else 'stream'} {ln}" if r >= 0 else "path gap (no lane)"
            for r, ln, c in zip(rank, lane, on_cpu)]


def critical_path_figure(cp: CriticalPaths, step: int) -> go.Figure:
    """The step's pieces on every rank and lane in grey, its critical path's segments over them in colour
    by category (gaps: host, launch, idle)."""
    w = cp.windows.set_index("step").loc[step]
    w0, w1 = float(w["start_us"]), float(w["end_us"])
    lab, p = cp.labelled, cp.labelled.pieces
    rows = np.flatnonzero((p.end > w0) & (p.start < w1))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=(np.minimum(p.end[rows], w1) - np.maximum(p.start[rows], w0)) / 1e3,
                         base=(np.maximum(p.start[rows], w0) - w0) / 1e3,
                         y=_lane_label(p.rank[rows], lab.lane_tid[p.lane[rows]], p.on_cpu[rows]), orientation="h",
                         name="off the path", marker_color="rgba(160,160,160,0.35)",
                         customdata=lab.name_labels[lab.name_code[rows]].astype(str),
                         hovertemplate="%{customdata}<br>start %{base:.3f} ms, %{x:.4f} ms<extra></extra>"))
    seg = cp.segments[cp.segments["step"] == step]
    for cat, g in seg.groupby(seg["category"].astype(str), observed=True):
        fig.add_trace(go.Bar(x=g["dur_us"] / 1e3, base=(g["start_us"] - w0) / 1e3,
                             y=_lane_label(g["rank"].to_numpy(), g["lane"].to_numpy(), g["on_cpu"].to_numpy()),
                             orientation="h", name=f"path: {cat}", marker_color=PATH_COLOURS.get(cat),
                             marker_line_width=1.5, marker_line_color="black",
                             customdata=np.c_[g["name"].astype(str), g["segment"].astype(str)],
                             hovertemplate="%{customdata[0]} (%{customdata[1]})<br>start %{base:.3f} ms, "
                                           "%{x:.4f} ms<extra></extra>"))
    lanes = len(set(_lane_label(p.rank[rows], lab.lane_tid[p.lane[rows]], p.on_cpu[rows])) | {"path gap (no lane)"})
    fig.update_layout(barmode="overlay", height=280 + 28 * lanes, xaxis_title="ms from the step's start",
                      title=f"Step {step}'s critical path ({(w1 - w0) / 1e3:.3f} ms wall): outlined bars are the path")
    return fig


def shares_table(rec: CriticalPathSummary) -> pd.DataFrame:
    """Per category: its share of the wall step on the path (median, p10-p90) beside its summed share, in %."""
    df = frame(rec.shares, CritPathShareRow)
    out = pd.DataFrame({"category": df["category"],
                        "wall share on the path %": 100 * df["path_share_median"],
                        "p10-p90 %": [f"{100 * a:.1f}-{100 * b:.1f}" for a, b in
                                      zip(df["path_share_p10"], df["path_share_p90"])],
                        "on the path per step (us)": df["path_us_median"],
                        "summed share of op time %": 100 * df["summed_share_median"]})
    return out.round(1)


def critical_path_view(cp: Optional[CriticalPaths], rec: CriticalPathSummary) -> tuple[str, Optional[go.Figure],
                                                                                          pd.DataFrame]:
    """(sentence, figure of the median step's path or None, shares table) for 04's critical-path section."""
    step = median_step(cp, rec.step_kind) if cp is not None else None
    if cp is None or step is None:
        return f"No {rec.step_kind} step found on every rank: no critical path to draw.", None, shares_table(rec)
    why = (f"The {rec.step_kind} step nearest the median wall time ({rec.steps} steps, median "
           f"{(rec.wall_us_median or 0.0) / 1e3:.3f} ms), walked back from its end across ranks and lanes: the "
           "path's segments sum to the wall step; a category's summed share counts overlapped and waiting time "
           "that the wall step does not pay.")
    return why, critical_path_figure(cp, step), shares_table(rec)


def level_critical_path(level: ProfiledLevel, data_dir: Path) -> tuple[str, Optional[go.Figure], pd.DataFrame]:
    """critical_path_view for one profiled level: its paths as 04 found them, its record as 04 wrote it
    (data/profile/c<N>/critical_path.json)."""
    rec = read_record(Path(data_dir) / "profile" / level_dir_name(level.capture.concurrency) / CRITICAL_PATH_RECORD,
                      CriticalPathSummary)
    return critical_path_view(level.critical_path, rec)


def skew_calibration_table(rec: SkewCalibration) -> pd.DataFrame:
    """One row per delay: what the path attributed against what the rank ran."""
    rows = frame(rec.settings, SkewCalibrationRow)
    cols = ["communicator", "injected_us", "delivered_us", "skew_us_median", "skew_us_p10", "skew_us_p90",
            "delivered_error_us", "recovered", "late_rank_share", "raw_skew_us_median", "transfer_us_median",
            "instances"]
    return rows[cols].rename(columns={"injected_us": "delay asked (us)", "delivered_us": "delay ran (us)",
                                      "skew_us_median": "attributed skew (us)", "delivered_error_us": "error (us)",
                                      "late_rank_share": "late rank named", "raw_skew_us_median": "entry skew off the ops (us)"})


def attribution_agrees(r: SkewCalibrationRow) -> bool:
    """The path's median skew is the one read off the ops without it (within 10% or 20 us); NaN: not known."""
    return math.isnan(r.raw_abs_skew_us_median) or \
        abs(r.skew_us_median - r.raw_abs_skew_us_median) <= max(0.1 * r.raw_abs_skew_us_median, 20.0)


def skew_calibration_sentence(rec: Optional[SkewCalibration]) -> str:
    """Whether this run's arrival-skew figures hold, from 03's calibration, in one sentence."""
    if rec is None:
        return ("*The critical path's arrival skew was not checked against a known delay in this run (03 did not "
                "run, or ran before the check existed).*")
    if not rec.ran:
        return f"*The critical path's arrival skew was not checked against a known delay: {rec.why_not}.*"
    if not rec.settings:
        return "*The check of the arrival skew against a known delay started but no setting finished (see 03's log).*"
    skewed = [r for r in rec.settings if r.injected_us > 0] or rec.settings
    worst = max(skewed, key=lambda r: abs(r.delivered_error_us))
    parts = "; ".join(f"{r.delivered_us:,.0f} us ran ({r.injected_us:,.0f} asked): {r.skew_us_median:,.0f} attributed"
                      for r in skewed)
    if all(r.recovered for r in rec.settings):
        verdict = f"the arrival skew figures of this report hold within {abs(worst.delivered_error_us):,.0f} us an instance"
    elif all(attribution_agrees(r) for r in rec.settings):
        # the path read the entries as they were; the host's own lateness, not the delay, set them
        verdict = (f"the path read the ranks' entries as they were ({worst.raw_abs_skew_us_median:,.0f} us off the ops, "
                   f"rank {worst.skew_rank} named late in {worst.late_rank_share:.0%} of the instances), but the "
                   "host's own lateness outgrew the delay (a busy host: ranks preempted for longer than it), so the "
                   "delay was not recovered and this run's skew figures carry that host's noise")
    else:
        verdict = (f"**the arrival skew figures of this report are off by up to {abs(worst.delivered_error_us):,.0f} us "
                   "an instance: read the skew/transfer split with that margin**")
    return (f"Checked here against a known delay (03's step replay through {worst.communicator}, rank {worst.skew_rank} "
            f"late before every collective, {rec.steps} steps each, read back through the same critical path): "
            f"{parts}; {verdict} (recovered: within 10% or 20 us of the delay the rank ran).")


def show_skew_calibration(rec: Optional[SkewCalibration], source: str) -> None:
    show_note(skew_calibration_sentence(rec))
    if rec is not None and rec.settings:
        show_table(skew_calibration_table(rec), caption="arrival skew against a known delay - " + source)
