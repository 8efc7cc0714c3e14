"""Tables and sentences for the serving notebook."""
from __future__ import annotations

import pandas as pd

from decodescope.serving.bench_compare import load_vllm_bench_result, side_by_side
from decodescope.serving.metrics import (CLIENT_CPU_LIMIT_PCT, COALESCED_FRAC_LIMIT, COALESCED_GAP_US,
                                         LITTLES_LIMIT_PCT, LOOP_LAG_P99_LIMIT_MS)
from decodescope.serving.telemetry_read import failures, gpu_unavailable


def levels_table(levels: pd.DataFrame) -> pd.DataFrame:
    cols = {"level": "concurrency", "ok": "ok", "failed": "failed", "output_throughput_tok_s": "out tok/s",
            "request_throughput_rps": "req/s", "ttft_p50_us": "TTFT p50 ms", "ttft_p99_us": "TTFT p99 ms",
            "tpot_p50_us": "TPOT p50 ms", "tpot_p99_us": "TPOT p99 ms", "itl_p99_us": "ITL p99 ms",
            "e2e_p50_us": "E2E p50 ms", "goodput_rps": "goodput req/s", "inflight_sampled_mean": "L (in flight)",
            "littles_lw": "λW", "loop_lag_p99_ms": "client loop lag p99 ms", "client_cpu_pct": "client CPU %",
            "client_suspect": "client suspect", "itl_coalesced_frac": "coalesced gaps"}
    t = levels[[c for c in cols if c in levels]].copy()
    for c in t.columns:
        if c.endswith("_us"):
            t[c] = t[c] / 1e3
    return t.rename(columns=cols)


def client_health_note(levels: pd.DataFrame) -> str:
    if "client_suspect" not in levels or not levels["client_suspect"].any():
        return (f"**Client health:** every level's event-loop lag p99 stayed under {LOOP_LAG_P99_LIMIT_MS} ms and "
                f"the client's CPU under {CLIENT_CPU_LIMIT_PCT}%: the client did not distort these figures.")
    bad = levels[levels["client_suspect"]]
    items = ", ".join(f"c={r.level} (loop lag p99 {r.loop_lag_p99_ms:.1f} ms, CPU {r.client_cpu_pct:.0f}%)"
                      for r in bad.itertuples())
    return (f"**Client health warning:** at {items} the load generator itself was slow (lag p99 above "
            f"{LOOP_LAG_P99_LIMIT_MS} ms or CPU above {CLIENT_CPU_LIMIT_PCT}%), so TTFT and ITL there may be "
            "inflated by the client, not the server. On a small host, the server and the client share cores.")


def coalesced_note(levels: pd.DataFrame) -> str:
    """Warns when the server delivered several decode steps' tokens in one burst."""
    if "itl_coalesced_frac" not in levels:
        return ""
    bad = levels[levels["itl_coalesced_frac"] > COALESCED_FRAC_LIMIT]
    if bad.empty:
        return (f"**Stream delivery:** at every level under {100 * COALESCED_FRAC_LIMIT:.0f}% of inter-token gaps "
                f"were below {COALESCED_GAP_US:.0f} µs: tokens reached the client one decode step at a time.")
    items = ", ".join(f"c={r.level} ({100 * r.itl_coalesced_frac:.0f}%)" for r in bad.itertuples())
    return (f"**Stream delivery warning:** at {items} of inter-token gaps were below {COALESCED_GAP_US:.0f} µs: "
            "the server released several decode steps' tokens at once, so TTFT is inflated and ITL/TPOT "
            "understate the decode step there. E2E and throughput are unaffected. Typical causes: a CPU-starved "
            "API server or engine-core output thread (small hosts), or output batching in the server.")


def littles_note(levels: pd.DataFrame) -> str:
    """Little's law as a check on the client's bookkeeping: the in-flight count it sampled (L) against
    request throughput x mean E2E (λW), level by level, held to LITTLES_LIMIT_PCT."""
    if "littles_error_pct" not in levels:
        return ""
    err = levels[["level", "littles_error_pct"]].dropna()
    if err.empty:
        return "**Little's law:** not checked: no level has both a sampled in-flight count and λW."
    bad = err[err["littles_error_pct"] > LITTLES_LIMIT_PCT]
    if bad.empty:
        return (f"**Little's law:** sampled L and λW agree within {LITTLES_LIMIT_PCT:.0f}% at every level checked "
                f"(worst {err['littles_error_pct'].max():.1f}%).")
    items = ", ".join(f"c={int(r.level)} ({r.littles_error_pct:.0f}%)" for r in bad.itertuples())
    return (f"**Little's law warning:** sampled L and λW differ by more than {LITTLES_LIMIT_PCT:.0f}% at {items}: "
            "the client's sampled concurrency and its request timings disagree there (a level too short for a "
            "steady state, ramp-up and drain dominating, or requests the client did not account for).")


def comparison_table(levels: pd.DataFrame, params) -> pd.DataFrame:
    """Our levels beside any `vllm bench serve --save-result` files the params name (ms)."""
    rows = [load_vllm_bench_result(params.resolve(p)) for p in params.workload.compare_with]
    if not rows:
        return pd.DataFrame()
    t = side_by_side(levels, rows)
    for c in [c for c in t.columns if c.endswith("_us")]:
        t[c.replace("_us", "_ms")] = t.pop(c) / 1e3
    return t


def server_vs_client_table(levels: pd.DataFrame) -> pd.DataFrame:
    """Per level, the engine's own TPOT and TTFT (its /metrics histograms, serving.telemetry) beside the
    client's means (ms): the difference is what the API server, the stream and the client add. Empty
    when no level has server telemetry."""
    if "server_tpot_mean_us" not in levels or levels["server_tpot_mean_us"].isna().all():
        return pd.DataFrame()
    lv = levels.sort_values("level")
    t = pd.DataFrame({"concurrency": lv["level"],
                      "client TPOT mean ms": lv["tpot_mean_us"] / 1e3,
                      "server TPOT mean ms": lv["server_tpot_mean_us"] / 1e3})
    t["client - server ms"] = t["client TPOT mean ms"] - t["server TPOT mean ms"]
    t["of client TPOT %"] = 100.0 * t["client - server ms"] / t["client TPOT mean ms"]
    if "server_ttft_mean_us" in lv:
        t["client TTFT mean ms"] = lv["ttft_mean_us"] / 1e3
        t["server TTFT mean ms"] = lv["server_ttft_mean_us"] / 1e3
        t["TTFT client - server ms"] = t["client TTFT mean ms"] - t["server TTFT mean ms"]
    return t.reset_index(drop=True)


def telemetry_table(levels: pd.DataFrame) -> pd.DataFrame:
    """The telemetry summary per level (units in the headers; latencies in ms). Empty without telemetry."""
    cols = {"level": "concurrency", "server_running_mean": "running mean", "server_running_max": "running max",
            "server_waiting_mean": "waiting mean", "server_waiting_max": "waiting max",
            "server_kv_usage_max_pct": "KV cache max %", "server_preemptions": "preemptions",
            "server_queue_mean_us": "queue mean ms", "server_api_cpu_pct": "API server CPU %",
            "server_spec_acceptance_pct": "spec acceptance %", "server_spec_accept_len": "spec accept length",
            "gpu_power_mean_w": "GPU power mean W", "gpu_power_max_w": "GPU power max W",
            "gpu_sm_clock_mean_mhz": "SM clock mean MHz", "gpu_sm_clock_min_mhz": "SM clock min MHz",
            "gpu_util_mean_pct": "GPU util mean %", "gpu_mem_used_max_mib": "GPU mem max MiB",
            "gpu_temp_max_c": "GPU temp max °C", "gpu_throttle_reasons": "clock event reasons",
            "telemetry_scrapes": "samples", "telemetry_scrape_failures": "failed samples"}
    if "telemetry_scrapes" not in levels:
        return pd.DataFrame()
    t = levels.sort_values("level")[[c for c in cols if c in levels]].copy()
    t = t[[c for c in t.columns if c == "level" or t[c].notna().any()]]
    for c in t.columns:
        if c.endswith("_us"):
            t[c] = t[c] / 1e3
    return t.rename(columns=cols).reset_index(drop=True)


def telemetry_note(telemetry: pd.DataFrame) -> str:
    """What the telemetry sampled and what it could not: failed /metrics samples (by error) and why there
    are no GPU samples."""
    if telemetry.empty:
        return ("**Telemetry:** none recorded (`workload.telemetry_interval_s: 0`, or the levels were measured "
                "before telemetry existed).")
    ok = telemetry[(telemetry["source"] == "telemetry") & (telemetry["metric"] == "scrape_ok")]
    n, bad = len(ok), int((ok["value"] == 0).sum())
    parts = [f"**Telemetry:** {n} samples of the server's `/metrics` over {telemetry['level'].nunique()} level(s)"]
    if bad:
        worst = "; ".join(f"c={lv}: {err} (x{k})" for lv, err, k in failures(telemetry)[:4])
        parts.append(f"{bad} failed and are left out of the figures ({worst})")
    n_gpu = telemetry.loc[(telemetry["source"] == "gpu") & (telemetry["metric"] == "power_w"), "labels"].nunique()
    reason = gpu_unavailable(telemetry)
    if reason:
        parts.append(f"no GPU samples: {reason}")
    elif n_gpu:
        parts.append(f"NVML sampled {n_gpu} GPU(s)")
    return "; ".join(parts) + "."
