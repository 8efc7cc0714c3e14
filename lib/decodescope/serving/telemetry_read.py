"""Reading and summarising the serving sweep's telemetry (decodescope.serving.telemetry samples it).

Rows have the columns `records_serving.TELEMETRY_COLUMNS`: level, scrape, t_s, source, metric, labels, value.
A scrape is the sample's number within the level.
t_s is in CLOCK_MONOTONIC seconds, the clock of the request records' *_ns.
A source is `server`, `gpu` or `telemetry`.
A metric is the exposition's sample name, e.g. `vllm:num_preemptions_total` or `vllm:time_to_first_token_seconds_sum`.
On a GPU row it is a GPU field instead, e.g. `power_w`.
Labels are JSON, with sorted keys.
The server samples kept are every `vllm:` sample but histogram buckets and `_created`.
The summary uses a histogram's `_sum` and `_count`.
The API server's `process_cpu_seconds_total` and `process_resident_memory_bytes` are kept too.

`level_telemetry(data_dir, level)` is a level's summary (columns of `records_serving.ServingLevel`).
Gauges are taken over the samples taken while the measured requests ran.
Counters and histogram means are differences between two samples.
Those are the sample at the measured start and the one after the last request.
Server-side TPOT is vLLM's `request_time_per_output_token_seconds`.
That is, per request, (last token - first token) / (tokens - 1) in the engine, as the client's TPOT.
A vLLM without it falls back to the inter-token latency histogram.
That histogram is `inter_token_latency_seconds`, or `time_per_output_token_seconds` in older vLLM.
It gives the same mean when every request has the same output length.
The sweep's `ignore_eos` requests do.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.schema.records_serving import TELEMETRY_COLUMNS
from decodescope.core.rundir import level_file
from decodescope.serving.promtext import HISTOGRAM_MEANS, KV_USAGE
from decodescope.engines import engine

TELEMETRY_DIR = "telemetry"
MEASURED_START = "measured_start"

# NVML's clock event ("throttle") reasons, nvml.h's bit values.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    """The reasons set in an NVML clock-event bitmask, by name (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def level_path(data_dir: Path, level: int, repeat: int = 1) -> Path:
    """data/telemetry/level_<c>.parquet; a repeat after the first: level_<c>_r<n>.parquet."""
    return Path(data_dir) / TELEMETRY_DIR / level_file(level, repeat)


def labels_json(d: dict) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))



def load_level(data_dir: Path, level: int, repeat: int = 1):
    """A level's telemetry rows, or None when the level has no telemetry file."""
    p = level_path(data_dir, level, repeat)
    return pd.read_parquet(p) if p.exists() else None


def load_telemetry(data_dir: Path):
    """Every level's telemetry rows (an empty frame with the columns when there are none)."""
    parts = [pd.read_parquet(p) for p in sorted((Path(data_dir) / TELEMETRY_DIR).glob("level_*.parquet"))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=TELEMETRY_COLUMNS)


def _mark_scrape(df, name: str) -> Optional[int]:
    m = df[(df["source"] == "telemetry") & (df["metric"] == "mark") & (df["labels"] == labels_json({"mark": name}))]
    return int(m["scrape"].iloc[0]) if len(m) else None


def _per_scrape(server, names, agg: str = "sum"):
    """Per scrape, `agg` over label sets (engines) of the first of `names` the server exposes; None if none.
    Counters and request counts add up over engines; a usage fraction takes the fullest one (max)."""
    for name in names:
        s = server[server["metric"] == name]
        if len(s):
            return s.groupby("scrape")["value"].agg(agg)
    return None


def _delta(series, a: Optional[int], b: Optional[int]) -> float:
    """series[b] - series[a]; NaN when either scrape is missing or the counter went back (a restart)."""
    if series is None or a not in series.index or b not in series.index:
        return float("nan")
    d = float(series[b] - series[a])
    return d if d >= 0 else float("nan")


SPEC_PER_POS = engine().metrics.spec_accepted_per_pos


def spec_per_position(server, a: Optional[int], b: Optional[int], drafts: float) -> str:
    """Each draft position's acceptance over the window (accepted at the position / drafts), as
    comma-separated fractions in position order; '' where nothing was drafted or the server has no such
    counter (decodescope.verdict.speculative reads it)."""
    rows = server[server["metric"] == SPEC_PER_POS]
    if not len(rows) or not drafts or drafts != drafts or drafts <= 0:
        return ""
    pos = rows.assign(position=rows["labels"].map(lambda t: json.loads(t).get("position")))
    out = []
    for p, grp in sorted(pos.groupby("position"), key=lambda kv: int(kv[0])):
        d = _delta(grp.groupby("scrape")["value"].sum(), a, b)
        out.append(f"{d / drafts:.4f}" if d == d else "nan")
    return ",".join(out)


def summarize(df) -> dict:
    """A level's summary (module docstring) from its telemetry rows; NaN where nothing was measured."""
    nan = float("nan")
    tel = df[df["source"] == "telemetry"]
    ok = tel[tel["metric"] == "scrape_ok"]
    out: dict = {"telemetry_scrapes": int(len(ok)), "telemetry_scrape_failures": int((ok["value"] == 0).sum())}
    server = df[df["source"] == "server"]
    scrapes = sorted(set(server["scrape"]))
    # The window: from the first successful sample at or after the measured start (the level's first
    # without a mark) to the last one, taken after the last request ended.
    start_mark = _mark_scrape(df, MEASURED_START)
    after = [s for s in scrapes if start_mark is None or s >= start_mark]
    a, b = (after[0], after[-1]) if after else (None, None)
    end_mark = _mark_scrape(df, "level_end")
    # Gauges: the samples strictly inside the window (its ends have no request in flight).
    # (a and b are None together: `b is not None` only tells mypy so)
    inside = [s for s in scrapes
              if a is not None and b is not None and a < s < (end_mark if end_mark is not None else b + 1)]

    def gauge(names, how, scale=1.0, agg="sum"):
        s = _per_scrape(server, names, agg)
        if s is None:
            return nan
        s = s[s.index.isin(inside)]
        return float(getattr(s, how)()) * scale if len(s) else nan

    names = engine().metrics
    out["server_running_mean"] = gauge((names.requests_running,), "mean")
    out["server_running_max"] = gauge((names.requests_running,), "max")
    out["server_waiting_mean"] = gauge((names.requests_waiting,), "mean")
    out["server_waiting_max"] = gauge((names.requests_waiting,), "max")
    out["server_kv_usage_max_pct"] = gauge(KV_USAGE, "max", 100.0, agg="max")
    out["server_preemptions"] = _delta(_per_scrape(server, (names.preemptions,)), a, b)
    for col, bases in HISTOGRAM_MEANS.items():
        out[col] = nan
        for base in bases:
            d_sum = _delta(_per_scrape(server, (f"{base}_sum",)), a, b)
            d_count = _delta(_per_scrape(server, (f"{base}_count",)), a, b)
            if d_count == d_count:      # the histogram is there
                out[col] = d_sum / d_count * 1e6 if d_count > 0 else nan
                break
    names = engine().metrics
    drafts = _delta(_per_scrape(server, (names.spec_drafts,)), a, b)
    draft_tokens = _delta(_per_scrape(server, (names.spec_draft_tokens,)), a, b)
    accepted = _delta(_per_scrape(server, (names.spec_accepted_tokens,)), a, b)
    out["server_spec_acceptance_pct"] = 100.0 * accepted / draft_tokens if draft_tokens > 0 else nan
    out["server_spec_accept_len"] = 1.0 + accepted / drafts if drafts > 0 else nan
    out["server_spec_accepted_per_pos"] = spec_per_position(server, a, b, drafts)
    cpu = _delta(_per_scrape(server, ("process_cpu_seconds_total",)), a, b)
    t = server.groupby("scrape")["t_s"].first()
    span = float(t[b] - t[a]) if a is not None and b != a else nan
    out["server_api_cpu_pct"] = 100.0 * cpu / span if span == span and span > 0 else nan

    gpu = df[df["source"] == "gpu"]
    if len(gpu):
        g = gpu[gpu["scrape"].isin(inside)] if inside else gpu

        def field(name, how, default=nan):
            v = g.loc[g["metric"] == name, "value"]
            return float(getattr(v, how)()) if len(v) else default
        out.update(gpu_power_mean_w=field("power_w", "mean"), gpu_power_max_w=field("power_w", "max"),
                   gpu_sm_clock_mean_mhz=field("sm_clock_mhz", "mean"),
                   gpu_sm_clock_min_mhz=field("sm_clock_mhz", "min"),
                   gpu_util_mean_pct=field("util_pct", "mean"), gpu_mem_used_max_mib=field("mem_used_mib", "max"),
                   gpu_temp_max_c=field("temp_c", "max"))
        masks = g.loc[g["metric"] == "throttle_reasons", "value"].astype("int64")
        mask = int(np.bitwise_or.reduce(masks.to_numpy())) if len(masks) else 0
        out["gpu_throttle_reasons"] = ", ".join(throttle_names(mask))
    return out


def level_telemetry(data_dir: Path, level: int, repeat: int = 1) -> Optional[dict]:
    """The level's summary columns, or None when it has no telemetry file (telemetry off)."""
    df = load_level(data_dir, level, repeat)
    return None if df is None else summarize(df)


def timeseries(df):
    """(server, gpu): the samples over the sweep as two tables for plotting.

    Each table has `sweep_s`, seconds on one axis for the whole sweep.
    Each level counts from its first sample.
    The levels run end to end in the order they were measured, a second apart.
    They are laid out so because levels measured across a restart have unrelated clocks.
    The server table has level, sweep_s, running, waiting, kv_usage_pct.
    The gpu table has level, sweep_s, gpu, and whichever of power_w, sm_clock_mhz, util_pct, mem_used_mib
    were sampled."""
    if df.empty:
        return (pd.DataFrame(columns=["level", "sweep_s", "running", "waiting", "kv_usage_pct"]),
                pd.DataFrame(columns=["level", "sweep_s", "gpu"]))
    t0 = df.groupby("level")["t_s"].min().sort_values()
    span = df.groupby("level")["t_s"].max() - t0
    offset, at = {}, 0.0
    for level in t0.index:
        offset[level] = at
        at += float(span[level]) + 1.0
    d = df.assign(sweep_s=df["t_s"] - df["level"].map(t0) + df["level"].map(offset))
    srv = d[d["source"] == "server"]
    keys = ["level", "scrape"]
    server = srv.groupby(keys)["sweep_s"].first().to_frame()
    m = engine().metrics
    for col, names, agg, scale in (("running", (m.requests_running,), "sum", 1.0),
                                   ("waiting", (m.requests_waiting,), "sum", 1.0),
                                   ("kv_usage_pct", KV_USAGE, "max", 100.0)):
        for name in names:
            s = srv[srv["metric"] == name]
            if len(s):
                server[col] = s.groupby(keys)["value"].agg(agg) * scale
                break
    server = server.reset_index().drop(columns="scrape").sort_values("sweep_s")
    g = d[(d["source"] == "gpu") & (d["metric"] != "throttle_reasons")]
    if g.empty:
        return server, pd.DataFrame(columns=["level", "sweep_s", "gpu"])
    g = g.assign(gpu=[int(json.loads(x)["gpu"]) for x in g["labels"]])
    keys = ["level", "scrape", "gpu"]
    gpu = g.pivot_table(index=keys, columns="metric", values="value", aggfunc="first")
    gpu = gpu.join(g.groupby(keys)["sweep_s"].first()).reset_index().drop(columns="scrape")
    gpu.columns.name = None
    return server, gpu.sort_values(["sweep_s", "gpu"])


def failures(df) -> list[tuple[int, str, int]]:
    """(level, error, count) of the failed scrapes, the most frequent first."""
    bad = df[(df["source"] == "telemetry") & (df["metric"] == "scrape_ok") & (df["value"] == 0)]
    errs = bad.assign(error=[json.loads(x).get("error", "") for x in bad["labels"]])
    counts = errs.groupby(["level", "error"]).size().sort_values(ascending=False)
    return [(int(lv), str(e), int(n)) for (lv, e), n in counts.items()]


def gpu_unavailable(df) -> Optional[str]:
    """Why there are no GPU samples, as the child recorded it; None when there are (or no file says)."""
    r = df[(df["source"] == "telemetry") & (df["metric"] == "gpu_unavailable")]
    return json.loads(r["labels"].iloc[0]).get("reason") if len(r) else None

