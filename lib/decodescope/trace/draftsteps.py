"""The drafter of a speculative step, read from a profiled level's ops on each rank.

vLLM runs a speculative step as one verify pass of the target, then the drafter.
The verify pass is the step's own annotation, `execute_context_...`.
The drafter runs outside that annotation.
It runs the rejection sampler, then one model forward a draft token.
Each forward is one call of the torch.compile'd draft model.
Dynamo's prologue op, `Pregraph bytecode`, opens that call on vLLM CPU and on the GPU engine alike.
A CUDA-graph replay skips Dynamo, so a graphed forward of the target has no such op.
The argmax of the forward's logits closes it.
The drafter ends where the worker's main lane goes idle for the engine's next schedule.
On a GPU trace the column readers keep only CPU ops that communicate, so the two marks are read from the
rank files, beside the runtime calls the readers kept; the steps there are the host's annotations.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.schema.records_spec import DrafterSteps
from decodescope.trace.reader import named_cpu_ops

DRAFTER_STEPS = "drafter_steps.json"  # in data/profile/c<N>/, where the level's steps had a drafter
FORWARD = "Pregraph bytecode"   # Dynamo's prologue, one per call of a compiled model
LOGITS = "aten::argmax"         # the draft token from a forward's logits
# the host calls a GPU trace keeps (reader.name_rule): the drafter's launches and waits between its marks
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
# The idle gap that ends the drafter. On the embedded default (vLLM CPU, TP=2, 2 cores) the ops after the
# last draft forward were at most 40 us apart, then the lane sat idle 920-1,480 us until the next step.
DRAFTER_END_GAP_US = 200.0


def _top_level(ops: pd.DataFrame) -> pd.DataFrame:
    """The ops no other op on the same lane contains, in start order."""
    o = ops.sort_values("ts_us")
    end = (o["ts_us"] + o["dur_us"]).to_numpy()
    reach = np.maximum.accumulate(np.concatenate([[-np.inf], end[:-1]]))
    return o[o["ts_us"].to_numpy() >= reach]


def _step_drafter(ts: np.ndarray, dur: np.ndarray, fwd: np.ndarray, logit: np.ndarray, end_us: float,
                  next_us: float) -> Optional[dict]:
    """One step's drafter from its lane's top-level ops (start order: ts, dur, whether each opens a forward,
    whether each is a logits' argmax) between the step's end and the next step's start."""
    lo, hi = np.searchsorted(ts, [end_us, next_us])
    w_ts, w_dur, w_fwd = ts[lo:hi], dur[lo:hi], fwd[lo:hi]
    if not w_fwd.any():
        return None
    starts = w_ts[w_fwd]
    closes = _forward_ends(starts, starts + w_dur[w_fwd], w_ts[logit[lo:hi]])
    after = w_ts >= closes[-1]
    stop = float(closes[-1])
    for t, d in zip(w_ts[after].tolist(), w_dur[after].tolist()):
        if t - stop > DRAFTER_END_GAP_US:
            break
        stop = max(stop, t + d)
    bounds = np.append(starts, stop)
    return {"passes": len(starts), "lead_us": float(starts[0] - end_us), "pass_us": np.diff(bounds).tolist(),
            "forward_us": (closes - starts).tolist(), "drafter_us": stop - end_us, "between_us": float(next_us - stop)}


def _forward_ends(starts: np.ndarray, own_ends: np.ndarray, logits_ts: np.ndarray) -> np.ndarray:
    """Each forward's end: the first logits' argmax after its start and before the next forward's; without
    one, the next forward's start, or for the last forward the end of the op that opened it."""
    nxt = np.append(starts[1:], np.inf)
    i = np.searchsorted(logits_ts, starts)
    found = logits_ts[np.minimum(i, len(logits_ts) - 1)] if len(logits_ts) else np.full(len(starts), np.inf)
    return np.where((i < len(logits_ts)) & (found < nxt), found, np.where(np.isfinite(nxt), nxt, own_ends))


def drafter_steps(ops: pd.DataFrame, steps: pd.DataFrame, kind: str = "decode",
                  concurrency: Optional[int] = None) -> Optional[DrafterSteps]:
    """The medians of every decode step's drafter, on the rank whose drafter took longest; None where no
    step has a model forward after it (no speculative decoding, or a forward this reader does not know)."""
    if ops.empty or steps.empty:
        return None
    best: Optional[DrafterSteps] = None
    for rank, s in steps.sort_values("start_us").groupby("rank"):
        mine = ops[ops["rank"] == rank]
        is_fwd = (mine["name"] == FORWARD).to_numpy(bool)  # matched once a rank, not once a step
        if not is_fwd.any():
            continue
        lane = mine["lane"][is_fwd].mode().iloc[0]
        on_lane = (mine["lane"] == lane).to_numpy()
        top = _top_level(mine[on_lane].assign(fwd=is_fwd[on_lane]))
        ts, dur, fwd = top["ts_us"].to_numpy(float), top["dur_us"].to_numpy(float), top["fwd"].to_numpy(bool)
        logit = (top["name"] == LOGITS).to_numpy(bool)
        nxt = s["start_us"].shift(-1)
        rows = [r for r in (_step_drafter(ts, dur, fwd, logit, e, n) for e, n, k in zip(s["end_us"], nxt, s["kind"])
                            if k == kind and pd.notna(n)) if r is not None]
        if not rows:
            continue
        rec = _summary(rows, s[s["kind"] == kind]["wall_us"], int(rank), concurrency)
        if best is None or rec.drafter_us > best.drafter_us:
            best = rec
    return best


def _summary(rows: list[dict], verify_us: pd.Series, rank: int, concurrency: Optional[int]) -> DrafterSteps:
    """Medians over a rank's steps; later passes pooled over positions 2..k."""
    later = [p for r in rows for p in r["pass_us"][1:]]
    return DrafterSteps(concurrency=concurrency, rank=rank, steps=len(rows),
                        passes=int(np.median([r["passes"] for r in rows])),
                        verify_us=float(verify_us.median()),
                        lead_us=float(np.median([r["lead_us"] for r in rows])),
                        first_pass_us=float(np.median([r["pass_us"][0] for r in rows])),
                        next_pass_us=float(np.median(later)) if later else None,
                        forward_us=float(np.median([f for r in rows for f in r["forward_us"]])),
                        drafter_us=float(np.median([r["drafter_us"] for r in rows])),
                        between_us=float(np.median([r["between_us"] for r in rows])))


def gpu_drafter_ops(events: pd.DataFrame, rank_files: dict[int, Path]) -> pd.DataFrame:
    """A GPU trace's host lanes for drafter_steps: the forward and logits marks read from each rank's file,
    and the runtime calls the column readers kept (events); the lane is the thread."""
    marks = [pd.DataFrame(named_cpu_ops(path, (FORWARD, LOGITS)), columns=["name", "ts_us", "dur_us", "lane"])
             .assign(rank=rank) for rank, path in rank_files.items()]
    calls = events[events["cat"].isin(RUNTIME_CATS)]
    calls = calls[["rank", "name", "ts_us", "dur_us"]].assign(lane=calls["tid"])
    return pd.concat([*marks, calls], ignore_index=True)
