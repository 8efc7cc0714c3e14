"""How much a serving level's step moved while it was measured, and what the step model's miss at a level is
put down to.

The real vLLM GPU engine at small batch runs a host-bound step.
Its GPU is busy a third of the step; the rest is the engine's Python.
On such a step the engine's step speed moves with the host.
On the H200 a Qwen3-MoE level of 64 requests at concurrency 1 read 1.48 ms per token in its first quarter.
It read 2.25 ms in its last, with the same kernels per step.
The step model is priced from 04's window.
Set against 01's window a minute away, it carries that movement.
These are the measurements that say so, one per level.
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

MIN_REQUESTS = 8          # a quarter of fewer than 2 requests has no median worth reading
MODEL_TARGET = 0.10       # the step model's error beyond which its miss is put down to something
MOVED = 0.10              # a step that moved more than 10% between two windows is named as a cause


def tpot_quarters(requests: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """Level -> (median TPOT of the first quarter, of the last quarter) of its timed requests in the order
    they were sent (serving_requests.parquet: warm-up and failed requests left out); levels of fewer than
    MIN_REQUESTS timed requests are left out."""
    need = {"level", "send_ns", "tpot_us"}
    if requests is None or requests.empty or not need <= set(requests.columns):
        return {}
    timed = requests
    if "warmup" in timed:
        timed = timed[~timed["warmup"].astype(bool)]
    if "ok" in timed:
        timed = timed[timed["ok"].astype(bool)]
    timed = timed[timed["tpot_us"].notna()]
    out = {}
    for level, g in timed.groupby("level"):
        g = g.sort_values("send_ns")
        n = len(g) // 4
        if len(g) < MIN_REQUESTS:
            continue
        out[int(level)] = (float(g["tpot_us"].iloc[:n].median()), float(g["tpot_us"].iloc[-n:].median()))
    return out


def bracketing_drift(drifts: dict[int, float], level: int) -> Optional[tuple[list[int], float]]:
    """For a level 04 did not profile: the profiled levels just below and above it (one where it lies
    outside them) and their 01-to-04 drift weighed as the step model weighs their inputs, linear between
    the two (stepmodel._across_batches), the nearest one's alone outside them; None for a profiled level or
    when no level has a drift."""
    if level in drifts or not drifts:
        return None
    below = [c for c in drifts if c < level]
    above = [c for c in drifts if c > level]
    if not below or not above:
        nearest = max(below) if below else min(above)
        return [nearest], drifts[nearest]
    lo, hi = max(below), min(above)
    w = (level - lo) / (hi - lo)
    return [lo, hi], (1 - w) * drifts[lo] + w * drifts[hi]


def model_miss_causes(model_error: Optional[float], host_drift: Optional[float], in_level_drift: Optional[float],
                      window_noise: Optional[float], model_error_same_server: Optional[float],
                      first_last_us: Optional[tuple[float, float]] = None,
                      around: Optional[tuple[list[int], float]] = None, stall_ms: Optional[float] = None) -> str:
    """What a level's step-model error beyond MODEL_TARGET is put down to, from the measured movement of
    the step; "" within the target; a sentence saying none was measured otherwise. `around`: the
    profiled levels the model's inputs came from at an unprofiled level, and their mean drift; `stall_ms`:
    the level's engine stall (serving_levels' engine_stall_ms)."""
    if model_error is None or abs(model_error) <= MODEL_TARGET:
        return ""
    causes = []
    if stall_ms is not None:
        causes.append(f"an engine stall inside the level's window: every stream stood still for "
                      f"{stall_ms / 1e3:.1f} s at once (a compile or a pause, not the decode step)")
    if host_drift is not None and abs(host_drift) > MOVED:
        same = (f"; against that step the model is {100 * model_error_same_server:+.1f}%"
                if model_error_same_server is not None else "")
        causes.append(f"the engine's step moved {100 * host_drift:+.0f}% between 01 and 04{same}")
    if around is not None and abs(around[1]) > MOVED:
        names = " and ".join(str(c) for c in around[0])
        weighed = " (weighed as the model weighs them)" if len(around[0]) > 1 else ""
        causes.append(f"the model's inputs come from 04 at concurrency {names}, where the engine's step moved "
                      f"{100 * around[1]:+.0f}%{weighed} from 01; against 01's step moved so, the model is "
                      f"{100 * ((1 + model_error) / (1 + around[1]) - 1):+.1f}%")
    if in_level_drift is not None and abs(in_level_drift) > MOVED and first_last_us:
        causes.append(f"the level's own TPOT moved {100 * in_level_drift:+.0f}% while it ran "
                      f"({first_last_us[0] / 1e3:.2f} ms in its first quarter, {first_last_us[1] / 1e3:.2f} ms "
                      "in its last)")
    if window_noise is not None and window_noise > MOVED:
        causes.append(f"04's two unprofiled runs a second apart differ by {100 * window_noise:.0f}%")
    if not causes:
        return "no movement of the step measured: the model misses"
    return "; ".join(causes)


def with_model_misses(rows: list[dict[str, Any]], stalls: Optional[dict[int, float]] = None) -> list[dict[str, Any]]:
    """The verdict's level rows (verdict.level_reconcile), each with its model_miss: an unprofiled level
    reads the drift of the profiled levels around it; `stalls`: level -> its engine stall (ms)."""
    drifts = {int(r["level"]): float(r["host_drift"]) for r in rows if r.get("host_drift") is not None}
    stalls = stalls or {}
    return [{**r, "model_miss": model_miss_causes(
        r.get("model_error"), r.get("host_drift"), r.get("in_level_drift"), r.get("window_noise"),
        r.get("model_error_same_server"), _quarters_of(r), bracketing_drift(drifts, int(r["level"])),
        stalls.get(int(r["level"])))}
        for r in rows]


def level_stalls(levels: pd.DataFrame) -> dict[int, float]:
    """level -> its engine stall (ms) from serving_levels' engine_stall_ms; none for runs written before it."""
    if "engine_stall_ms" not in levels.columns:
        return {}
    stalled = levels.dropna(subset=["engine_stall_ms"])
    return {int(r.level): float(r.engine_stall_ms) for r in stalled.itertuples()}


def _quarters_of(row: dict[str, Any]) -> Optional[tuple[float, float]]:
    first, last = row.get("tpot_first_quarter_us"), row.get("tpot_last_quarter_us")
    return (first, last) if first is not None and last is not None else None
