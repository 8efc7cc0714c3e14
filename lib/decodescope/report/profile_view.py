"""Tables and sentences for the profile notebook."""
from __future__ import annotations

from typing import Optional

import pandas as pd

from decodescope.schema.records import ProfileSummary
from decodescope.report import plots
from decodescope.trace.profile import ProfileResult


def headline(result: ProfileResult, summary: ProfileSummary, capture=None) -> str:
    shares = summary.allreduce_share_of_time
    calls = summary.allreduce_calls_per_step
    exp = result.expected
    expected = exp.loc[exp["collective"] == "all_reduce", "expected_per_step"].iloc[0] if not exp.empty else None
    ps = summary.per_step
    parts = [f"**{result.device.upper()} trace, ranks {summary.ranks}, {summary.steps.get(result.step_kind, 0)} "
             f"{result.step_kind} steps.**"]
    parts.append("All-reduce share of " + ("kernel" if result.device == "gpu" else "op self") + " time: " +
                 ", ".join(f"rank {r} {100 * v:.1f}%" for r, v in shares.items()) + ".")
    if calls:
        parts.append("All-reduces per step: " + ", ".join(f"rank {r} {v:g}" for r, v in calls.items()) +
                     (f" (expected {expected} from the architecture)." if expected is not None else "."))
    if ps.summed_us_median is not None:
        # trace.profile sets summed, busy and wall medians together (None formatted failed before)
        assert ps.busy_us_median is not None and ps.wall_us_median is not None
        parts.append(f"Median step: summed {ps.summed_us_median / 1e3:.3f} ms, busy {ps.busy_us_median / 1e3:.3f} ms, "
                     f"wall {ps.wall_us_median / 1e3:.3f} ms.")
    if capture is not None:
        parts.append(f"Capture: {capture.requests_ok} requests profiled ({capture.requests_failed} failed); "
                     f"/stop_profile took {capture.stop_profile_s:.1f} s, files complete {capture.flush_wait_s:.1f} s later.")
    for w in summary.warnings:
        parts.append(f"\n\n*Warning:* {w}")
    return " ".join(parts)


def breakdown_table(result: ProfileResult) -> pd.DataFrame:
    b = result.breakdown.copy()
    b["time_ms"] = b.pop("time_us") / 1e3
    b["share_pct"] = 100 * b.pop("share")
    return b[["rank", "category", "time_ms", "share_pct", "calls", "mean_us"]]


def expected_table(result: ProfileResult) -> pd.DataFrame:
    return result.expected.copy()


def busy_table(result: ProfileResult) -> pd.DataFrame:
    b = result.busy
    if b.empty:
        return b
    med = b.groupby(["rank", "kind"])[["summed_us", "busy_us", "wall_us", "idle_us", "overlap_ratio"]].median()
    return med.reset_index()


def skew_table(result: ProfileResult) -> pd.DataFrame:
    s = result.skew_summary.copy()
    if not s.empty:
        s["wait_pct"] = 100 * s.pop("wait_share")
    return s


def timeline_step(result: ProfileResult) -> tuple[Optional[int], str]:
    """The step to draw on the timeline, and a sentence saying which and why (or why none can be drawn).

    It is a typical step of the analysed kind (decode when the trace has decode steps): one that is of
    that kind on every rank that ran it, whose wall time (median over ranks) is nearest the median of
    all such steps."""
    kind = result.step_kind
    busy = result.busy
    if busy.empty:
        return None, ("**No step timeline:** no step with ops in it was found (the trace has neither vLLM's "
                      "step ranges nor pauses in the work to cut steps at).")
    of_kind = busy.groupby("step")["kind"].agg(lambda k: bool((k == kind).all()))
    rows = busy[busy["step"].isin(of_kind[of_kind].index)]
    if rows.empty:
        seen = ", ".join(sorted(str(k) for k in busy["kind"].dropna().unique())) or "none"
        return None, (f"**No step timeline:** no step with ops is a {kind} step on every rank that ran it "
                      f"(step kinds with ops: {seen}).")
    wall = rows.groupby("step")["wall_us"].median().dropna()
    if wall.empty:  # steps without a recorded span: their busy time stands in
        wall = rows.groupby("step")["busy_us"].median()
    target = float(wall.median())
    step = int((wall - target).abs().idxmin())
    label = "step" if kind == "unknown" else f"{kind} step"
    cut = (" Steps were cut at pauses in the work (the trace has no vLLM step ranges)." if kind == "unknown"
           else "")
    return step, (f"Step {step}: of the {len(wall)} {label}s with ops, the one whose wall time "
                  f"({wall[step] / 1e3:.3f} ms, median over ranks) is nearest the median ({target / 1e3:.3f} ms)."
                  + cut)


def timeline_figure(result: ProfileResult):
    """(sentence, figure) for the profile notebook's timeline: the step `timeline_step` picks, drawn on
    every rank, or None for the figure when no step can be shown (the sentence says why)."""
    step, why = timeline_step(result)
    return why, (plots.step_timeline(result.ops, result.steps, step) if step is not None else None)
