"""The host's own cost of the ops a CUDA graph hides, from 04's un-graphed capture (capture.capture_host_ops).

A decode step on a GPU replays CUDA graphs.
There the attention and MoE custom ops (`vllm::*`) and the Python around them never run on the host.
Without graphs (`--enforce-eager`), they do, each at the cost of its Python and launches.
They do too with piecewise graphs only, which leave the attention ops outside.
A speculative step that drafted nothing runs that way.
A prefill longer than the largest captured graph runs them all on the host, in the baseline's own engine.
Each outermost `vllm::` op's host cost is its wall time on its thread, less what it spent waiting for the GPU.
That wait is its synchronizing CUDA calls.
The verdict takes the profiler's own cost off by the events the profiler recorded inside the op.
Each event is priced at its measured cost per event.
That cost is the level's profiled step less its unprofiled one, over the events a profiled decode step records.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.engines.vllm_log import EngineModes
from decodescope.schema.records_profile import HostOpRow, HostOps
from decodescope.trace.analyze import steps_from_annotations
from decodescope.trace.nesting import parents_in_order, prev_in_thread
from decodescope.engines import engine

HOST_OPS_RECORD = Path("profile") / "host_ops.json"   # under the run's data/: written by 04, read by 05
CUSTOM_OP_PREFIX = engine().custom_op_prefix
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
# CUDA calls whose duration is the host waiting for the device, not its own work
WAIT_CALL = re.compile(r"Synchronize|^cudaMemcpy$|^cudaMemcpyAsync$|^cuMemcpyDtoH")
LAUNCH_CALL = re.compile(r"LaunchKernel|GraphLaunch|^cuLaunch")


def host_ops_wanted(asked: bool, modes: Optional[EngineModes]) -> tuple[bool, str]:
    """Whether 04 takes the un-graphed capture, and why not.

    It is taken where the engine runs CUDA graphs, as its log says.
    It is taken where the engine's modes are unknown (None: no log, an attached server).
    It is taken where profile.host_ops_tokens was set in the params (`asked`).
    An engine without graphs (vLLM CPU, --enforce-eager) hides no op from the host.
    Its level traces hold every op's host cost already."""
    if asked or modes is None or modes.cudagraph_mode not in (None, "NONE"):
        return True, ""
    return False, ("the engine runs no CUDA graphs (its log): no op is hidden from the host, so 04 takes no "
                   "un-graphed capture (set profile.host_ops_tokens to take it anyway)")


def read_host_events(path: Path) -> pd.DataFrame:
    """The complete ('X') host events and step annotations of one rank's trace file (.json or .json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    rows = [(e.get("cat"), str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("tid")))
            for e in raw.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    ev = pd.DataFrame(rows, columns=["cat", "name", "ts_us", "dur_us", "tid"])
    ev["rank"] = 0
    return ev


def outer_custom_ops(ev: pd.DataFrame, prefix: str = CUSTOM_OP_PREFIX) -> pd.DataFrame:
    """Each outermost custom-op call (a `prefix` op no other `prefix` op of its thread encloses): its
    thread, name, start, wall time, the time its synchronizing CUDA calls waited, and the host events and
    kernel launches recorded inside it."""
    cols = ["tid", "name", "ts_us", "dur_us", "wait_us", "events", "launches"]
    ops = ev[(ev["cat"] == "cpu_op") & ev["name"].str.startswith(prefix)]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    ops = ops.sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False]).reset_index(drop=True)
    thread = pd.factorize(ops["tid"])[0]
    ts, end = ops["ts_us"].to_numpy(), (ops["ts_us"] + ops["dur_us"]).to_numpy()
    outer = ops[parents_in_order(prev_in_thread(len(ops), thread), ts, end) < 0].reset_index(drop=True)
    host = ev[ev["cat"].isin(("cpu_op", "cuda_runtime", "cuda_driver"))]
    rows = []
    for tid, calls in outer.groupby("tid", sort=False):
        mine = host[host["tid"] == tid].sort_values("ts_us")
        t = mine["ts_us"].to_numpy()
        waits = np.where(mine["name"].str.contains(WAIT_CALL), mine["dur_us"].to_numpy(), 0.0)
        launches = mine["name"].str.contains(LAUNCH_CALL).to_numpy().astype(np.int64)
        cum_wait, cum_launch = np.concatenate([[0.0], np.cumsum(waits)]), np.concatenate([[0], np.cumsum(launches)])
        # events strictly inside the call: from just after its own start to its end
        lo = np.searchsorted(t, calls["ts_us"].to_numpy(), side="right")
        hi = np.searchsorted(t, (calls["ts_us"] + calls["dur_us"]).to_numpy(), side="left")
        rows.append(pd.DataFrame({"tid": tid, "name": calls["name"].to_numpy(), "ts_us": calls["ts_us"].to_numpy(),
                                  "dur_us": calls["dur_us"].to_numpy(), "wait_us": cum_wait[hi] - cum_wait[lo],
                                  "events": hi - lo, "launches": cum_launch[hi] - cum_launch[lo]}))
    return pd.concat(rows, ignore_index=True)[cols]


def events_per_period(ev: pd.DataFrame, steps: pd.DataFrame) -> Optional[float]:
    """Median over the steps another step follows: the host events recorded from one step's start to the
    next's, every thread of the file (what the profiler records while a decode step runs)."""
    s = steps.sort_values("start_us")
    starts = s["start_us"].to_numpy()
    if len(starts) < 2:
        return None
    t = np.sort(ev.loc[ev["cat"] != "user_annotation", "ts_us"].to_numpy())
    counts = np.searchsorted(t, starts[1:]) - np.searchsorted(t, starts[:-1])
    return float(np.median(counts))


def host_op_costs(ev: pd.DataFrame, prompt_tokens: int = 0) -> HostOps:
    """The un-graphed capture's figures: per custom op, in the longest prefill step (the one past the graphs),
    its calls in that step and its host cost per call (median wall less waits), with the events and launches
    recorded inside it; and the decode steps' events per step."""
    steps = steps_from_annotations(ev)
    prefill = steps[steps["kind"] == "prefill"]
    decode = steps[steps["kind"] == "decode"]
    rows: list[HostOpRow] = []
    tokens = 0
    if not prefill.empty:
        longest = prefill.loc[prefill["ctx_tokens"].idxmax()]
        tokens = int(longest["ctx_tokens"])
        calls = outer_custom_ops(ev)
        calls = calls[(calls["ts_us"] >= longest["start_us"]) & (calls["ts_us"] < longest["end_us"])]
        host_us = (calls["dur_us"] - calls["wait_us"]).clip(lower=0.0)
        for name, g in calls.assign(host_us=host_us).groupby("name", sort=True):
            rows.append(HostOpRow(name=str(name), calls_per_step=int(len(g)),
                                  host_us_per_call=float(g["host_us"].median()),
                                  wait_us_per_call=float(g["wait_us"].median()),
                                  events_per_call=float(g["events"].median()),
                                  launches_per_call=float(g["launches"].median())))
    return HostOps(prompt_tokens=prompt_tokens, step_tokens=tokens, prefill_steps=int(len(prefill)),
                   decode_steps=int(len(decode)),
                   decode_events_per_step=events_per_period(ev, decode) if len(decode) > 1 else None, ops=rows)
