"""Tables and sentences for the serving notebook."""
from __future__ import annotations

import pandas as pd

from decodescope.serving.metrics import (CLIENT_CPU_LIMIT_PCT, COALESCED_FRAC_LIMIT, COALESCED_GAP_US,
                                         LITTLES_LIMIT_PCT, LOOP_LAG_P99_LIMIT_MS)


def levels_table(levels: pd.DataFrame) -> pd.DataFrame:
    cols = {"level": "concurrency", "ok": "ok", "failed": "failed", "output_throughput_tok_s": "out tok/s",
            "request_throughput_rps": "req/s", "ttft_p50_us": "TTFT p50 ms", "ttft_p99_us": "TTFT p99 ms",
            "tpot_p50_us": "TPOT p50 ms", "tpot_p99_us": "TPOT p99 ms", "itl_p99_us": "ITL p99 ms",
            "e2e_p50_us": "E2E p50 ms", "goodput_rps": "goodput req/s", "inflight_sampled_mean": "L (sampled)",
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
    from decodescope.serving.compare import load_vllm_bench_result, side_by_side

    rows = [load_vllm_bench_result(params.resolve(p)) for p in params.workload.compare_with]
    if not rows:
        return pd.DataFrame()
    t = side_by_side(levels, rows)
    for c in [c for c in t.columns if c.endswith("_us")]:
        t[c.replace("_us", "_ms")] = t.pop(c) / 1e3
    return t
