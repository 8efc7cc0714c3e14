"""Tables and sentences for the profile notebook."""
from __future__ import annotations

import pandas as pd

from decodescope.trace.profile import ProfileResult


def headline(result: ProfileResult, summary: dict, capture=None) -> str:
    shares = summary["allreduce_share_of_time"]
    calls = summary["allreduce_calls_per_step"]
    exp = result.expected
    expected = exp.loc[exp["collective"] == "all_reduce", "expected_per_step"].iloc[0] if not exp.empty else None
    ps = summary["per_step"]
    parts = [f"**{result.device.upper()} trace, ranks {summary['ranks']}, {summary['steps'].get(result.step_kind, 0)} "
             f"{result.step_kind} steps.**"]
    parts.append("All-reduce share of " + ("kernel" if result.device == "gpu" else "op self") + " time: " +
                 ", ".join(f"rank {r} {100 * v:.1f}%" for r, v in shares.items()) + ".")
    if calls:
        parts.append("All-reduces per step: " + ", ".join(f"rank {r} {v:g}" for r, v in calls.items()) +
                     (f" (expected {expected} from the architecture)." if expected is not None else "."))
    if ps["summed_us_median"] is not None:
        parts.append(f"Median step: summed {ps['summed_us_median'] / 1e3:.3f} ms, busy {ps['busy_us_median'] / 1e3:.3f} ms, "
                     f"wall {ps['wall_us_median'] / 1e3:.3f} ms.")
    if capture is not None:
        parts.append(f"Capture: {capture.requests_ok} requests profiled ({capture.requests_failed} failed); "
                     f"/stop_profile took {capture.stop_profile_s:.1f} s, files complete {capture.flush_wait_s:.1f} s later.")
    for w in summary.get("warnings", []):
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
