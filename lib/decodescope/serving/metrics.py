"""Serving metrics, defined as `vllm bench serve` defines them so the numbers compare.

TTFT = first content chunk - send; E2E = end of stream - send; TPOT = (E2E - TTFT) / (n_out - 1) when
n_out > 1; ITL = gaps between consecutive content chunks; n_out from the server's usage record.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from decodescope.schema.records_serving import ServingLevel

PERCENTILES = (50, 90, 99)
# A level whose client event loop lagged this much (p99) or used this much CPU may have distorted
# the latencies it measured.
LOOP_LAG_P99_LIMIT_MS = 5.0
CLIENT_CPU_LIMIT_PCT = 85.0
# Two chunks of one stream closer than this were produced by different decode steps but delivered
# together: the server held output back (a starved output thread, a busy API server, Nagle).
COALESCED_GAP_US = 100.0
# A level where more than this share of a stream's gaps is coalesced has its TTFT/ITL/TPOT shaped
# by the server's delivery, not by its decode speed.
COALESCED_FRAC_LIMIT = 0.10
# Sampled in-flight count (L) and throughput x mean latency (λW) should agree; beyond this the level's
# figures are suspect (too short for a steady state, or requests the client lost track of).
LITTLES_LIMIT_PCT = 20.0
# An engine stall: every stream that had started was silent at once for this long, and this many times
# the level's median ITL. On the H200 a level of 64 held one of 2.0 s (a kernel compiled for a batch
# shape the warm-up had not run) and read TPOT 20.9 ms against 5.7-6.0 ms in its unstalled requests.
STALL_MIN_MS = 500.0
STALL_ITL_FACTOR = 50.0


def tpot(e2e_us, ttft_us, n_out):
    """Time per output token after the first, as `vllm bench serve` defines it: (E2E - TTFT) / (n_out - 1)
    when n_out > 1, else NaN (vLLM leaves such requests out of its TPOT). Scalars or arrays/Series; a
    Series in gives a Series (same index) out."""
    n = np.asarray(n_out, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(n > 1, (np.asarray(e2e_us, dtype=float) - np.asarray(ttft_us, dtype=float)) / (n - 1), np.nan)
    if isinstance(n_out, pd.Series):
        return pd.Series(out, index=n_out.index)
    return float(out) if out.ndim == 0 else out


def per_request(records: pd.DataFrame) -> pd.DataFrame:
    """Adds ttft_us, e2e_us, tpot_us, itl_us (list), n_out to the raw records."""
    df = records.copy()
    df["n_out"] = df["n_out_usage"].fillna(df["n_out_chunks"]).astype("int64")
    df["ttft_us"] = (df["first_chunk_ns"] - df["send_ns"]) / 1e3
    df["e2e_us"] = (df["end_ns"] - df["send_ns"]) / 1e3
    df["tpot_us"] = tpot(df["e2e_us"], df["ttft_us"], df["n_out"])
    df["itl_us"] = [list(np.diff(np.asarray(c, dtype="int64")) / 1e3) if c is not None and len(c) > 1 else []
                    for c in df["chunk_ns"]]
    df.loc[~df["ok"], ["ttft_us", "tpot_us"]] = np.nan
    return df


def engine_silence(records: pd.DataFrame) -> tuple[float, int, int]:
    """The longest time during which at least one measured request was streaming (past its first chunk,
    before its end) and no measured request received a chunk: the engine, not one stream, stood still.
    (ms, its first ns, its last ns): the chunks either side; (0.0, 0, 0) when there is no such gap.
    records: a level's raw records (send/first_chunk/end_ns, chunk_ns)."""
    measured = records[(~records["warmup"]) & records["ok"]]
    chunks = [np.asarray(c, dtype="int64") for c in measured["chunk_ns"] if c is not None and len(c)]
    if not chunks:
        return 0.0, 0, 0
    times = np.sort(np.concatenate(chunks))
    gaps = np.diff(times)
    if not gaps.size:
        return 0.0, 0, 0
    order = np.argsort(measured["first_chunk_ns"].to_numpy(dtype="int64"))
    first = measured["first_chunk_ns"].to_numpy(dtype="int64")[order]
    latest_end = np.maximum.accumulate(measured["end_ns"].to_numpy(dtype="int64")[order])
    # a gap counts when some stream spans it whole: started by its start, ended after its end (the
    # latest end among the streams started by then; O(n log n) for a level of 1,024 streams too)
    started = np.searchsorted(first, times[:-1], side="right")
    spanned = (started > 0) & (latest_end[np.maximum(started - 1, 0)] >= times[1:])
    if not spanned.any():
        return 0.0, 0, 0
    i = int(np.flatnonzero(spanned)[np.argmax(gaps[spanned])])
    return float(gaps[i] / 1e6), int(times[i]), int(times[i + 1])


def engine_silence_ms(records: pd.DataFrame) -> float:
    """engine_silence's length (ms)."""
    return engine_silence(records)[0]


def unstalled_tpot_us(ok: pd.DataFrame, silence: tuple[float, int, int]) -> pd.Series:
    """Each request's TPOT with the engine's silence taken out: a request whose stream spans it (one of its
    token gaps holds the silence whole) counts that gap as one of the level's median gaps, the step it would
    have been without the stall; the others keep theirs. ok: per_request's rows of the level's measured,
    successful requests (chunk_ns, itl_us, e2e_us, ttft_us, n_out)."""
    _, start_ns, end_ns = silence
    gaps = [g for itl in ok["itl_us"] for g in itl]
    if not gaps or end_ns <= start_ns:
        return ok["tpot_us"].copy()
    median_gap_us = float(np.median(gaps))
    out = []
    for chunk_ns, tpot_us, e2e_us, ttft_us, n in zip(ok["chunk_ns"], ok["tpot_us"], ok["e2e_us"], ok["ttft_us"],
                                                      ok["n_out"]):
        times = np.asarray(chunk_ns if chunk_ns is not None else [], dtype="int64")
        held = np.flatnonzero((times[:-1] <= start_ns) & (times[1:] >= end_ns))
        if held.size and n > 1:
            gap_us = (times[held[0] + 1] - times[held[0]]) / 1e3
            out.append((e2e_us - ttft_us - gap_us + median_gap_us) / (n - 1))
        else:
            out.append(tpot_us)
    return pd.Series(out, index=ok.index, dtype=float)


def is_engine_stall(silence_ms: float, itl_p50_us: float) -> bool:
    """A silence long enough, absolutely and against the level's own ITL, to be a stall of the engine
    (a compile, a pause) rather than its decode speed."""
    return bool(silence_ms >= STALL_MIN_MS and (not itl_p50_us == itl_p50_us or  # NaN ITL: the floor alone
                                                 silence_ms * 1e3 >= STALL_ITL_FACTOR * itl_p50_us))


def level_stall_ms(records: pd.DataFrame, silence_ms: Optional[float] = None) -> Optional[float]:
    """The level's engine silence (ms) when it is a stall (is_engine_stall against the level's ITL p50),
    else None. silence_ms: engine_silence_ms(records) where the caller has it already."""
    silence_ms = engine_silence_ms(records) if silence_ms is None else silence_ms
    if silence_ms < STALL_MIN_MS:
        return None
    ok = per_request(records[(~records["warmup"]) & records["ok"]])
    gaps = [g for itl in ok["itl_us"] for g in itl]
    return silence_ms if is_engine_stall(silence_ms, float(np.median(gaps)) if gaps else float("nan")) else None


def _pcts(values, prefix: str) -> dict:
    arr = np.asarray([v for v in values if v == v], dtype=float)
    out = {f"{prefix}_mean_us": float(arr.mean()) if arr.size else np.nan}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}_us"] = float(np.percentile(arr, p)) if arr.size else np.nan
    return out


def level_summary(req: pd.DataFrame, level: int, slo: Optional[dict] = None, health: Optional[dict] = None,
                  repeat: Optional[int] = None, telemetry: Optional[dict] = None) -> dict:
    """One row of serving_levels (a records_serving.ServingLevel, as the table's row): counts, throughputs,
    percentiles, goodput, client health. With `repeat`, the row of that repeat of the level (from the
    requests whose `repeat` column holds it). With `telemetry`, the level's server/GPU telemetry summary
    (serving.telemetry.summarize) as columns too."""
    measured = req[(req["level"] == level) & (~req["warmup"])]
    if repeat is not None:
        measured = measured[measured["repeat"] == repeat]
    ok = measured[measured["ok"]]
    t0 = measured["send_ns"].min()
    t1 = measured["end_ns"].max()
    duration_s = (t1 - t0) / 1e9 if len(measured) else np.nan
    n_out = ok["n_out"].sum()
    n_in = ok["n_in_usage"].fillna(ok["n_in_sent"]).sum()
    row = {
        "level": level, "requests": len(measured), "ok": len(ok), "failed": len(measured) - len(ok),
        "duration_s": duration_s,
        "request_throughput_rps": len(ok) / duration_s if duration_s else np.nan,
        "output_throughput_tok_s": n_out / duration_s if duration_s else np.nan,
        "total_throughput_tok_s": (n_out + n_in) / duration_s if duration_s else np.nan,
        **_pcts(ok["ttft_us"], "ttft"), **_pcts(ok["tpot_us"], "tpot"),
        **_pcts([x for l in ok["itl_us"] for x in l], "itl"), **_pcts(ok["e2e_us"], "e2e"),
        "itl_coalesced_frac": coalesced_fraction(ok["itl_us"]),
        "failure_reasons": "; ".join(f"{k}: {v}" for k, v in
                                     measured.loc[~measured["ok"], "error_class"].value_counts().items()),
    }
    if repeat is not None:
        row["repeat"] = int(repeat)
    row.update(littles_law(measured))
    if slo:
        good = ok
        for key, col in (("ttft_ms", "ttft_us"), ("tpot_ms", "tpot_us"), ("e2e_ms", "e2e_us")):
            if slo.get(key) is not None:
                good = good[good[col].fillna(0) <= slo[key] * 1e3]
        row["goodput_rps"] = len(good) / duration_s if duration_s else np.nan
    if health:
        row.update(health)
        stall_ms = health.get("engine_stall_ms")
        # the step as the verdict reads it: the level's TPOT less its stall (docs/methods.md), its TPOT where
        # none; so the median over repeats (sweep.merge_repeats) reads every repeat, stalled or not
        row["tpot_unstalled_p50_us"] = (float(unstalled_tpot_us(ok, engine_silence(measured)).median())
                                        if stall_ms is not None and stall_ms == stall_ms else row["tpot_p50_us"])
        lw, l_sampled = row.get("littles_lw"), health.get("inflight_sampled_mean")
        row["littles_error_pct"] = 100.0 * abs(l_sampled - lw) / lw if lw and l_sampled == l_sampled else np.nan
        row["client_suspect"] = bool(health.get("loop_lag_p99_ms", 0) > LOOP_LAG_P99_LIMIT_MS
                                     or health.get("client_cpu_pct", 0) > CLIENT_CPU_LIMIT_PCT)
    if telemetry:
        row.update(telemetry)
    return ServingLevel(**row).to_row()


def coalesced_fraction(itl_lists) -> float:
    """Share of inter-chunk gaps under COALESCED_GAP_US. Each chunk carries the tokens of one decode
    step, so near-zero gaps mean the server released several steps' tokens at once."""
    gaps = np.asarray([x for l in itl_lists for x in l], dtype=float)
    return float((gaps < COALESCED_GAP_US).mean()) if gaps.size else np.nan


def littles_law(measured: pd.DataFrame) -> dict:
    """lambda x W (request throughput x mean time in the client) over the level's span, to compare with
    the mean in-flight count the client kept apart from the records (`inflight_sampled_mean`, L: the
    count's integral over time, advanced at every change, client.InFlight).

    W counts from the request's start, not from its write (`send_ns`, where E2E and TTFT start): the
    in-flight count rises before the start gate and the connect, so the time spent there (`connect_us`)
    is in L and must be in W too, or a level whose connects wait reads L > lambda x W."""
    if measured.empty:
        return {"littles_lw": np.nan}
    connect_ns = measured["connect_us"].fillna(0.0) * 1e3 if "connect_us" in measured else 0.0
    start_ns = measured["send_ns"] - connect_ns
    span_s = (measured["end_ns"].max() - start_ns.min()) / 1e9
    lam = len(measured) / span_s if span_s else np.nan
    w = ((measured["end_ns"] - start_ns) / 1e9).mean()
    return {"littles_lw": float(lam * w)}


def knee(levels: pd.DataFrame, gain: float = 0.10) -> Optional[int]:
    """The concurrency after which doubling-ish the load adds less than `gain` of throughput: the
    plateau's start. None if throughput still grows at the last level."""
    lv = levels.sort_values("level")
    tput = lv["output_throughput_tok_s"].to_numpy()
    conc = lv["level"].to_numpy()
    for i in range(len(lv) - 1):
        if tput[i] > 0 and (tput[i + 1] - tput[i]) / tput[i] < gain:
            return int(conc[i])
    return None
