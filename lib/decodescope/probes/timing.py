"""Summary of repeated timings, shared by the probes (plain programs: torch and the stdlib only)."""
from __future__ import annotations

import statistics

HOST_ISSUE = "host_issue"  # the collective probe's timing of the host's own cost per call (GPUs): no transfer


def median_spread(times_us: list[float]) -> dict:
    """Median with p10/p90 (nearest rank) and the count: what every probe row reports."""
    s = sorted(times_us)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"time_us": statistics.median(s), "p10_us": pick(0.10), "p90_us": pick(0.90), "n": len(s)}


def host_issue_us(fn, calls: int, iters: int, sync) -> list[float]:
    """Host microseconds per call of issuing `calls` calls back to back, the device drained (`sync`)
    before each repetition: what a host-bound (eager) step pays per launch, whatever the device takes.
    `calls` stays well below a CUDA stream's launch queue (~1,000 kernels), so the host never waits for
    the device inside the loop."""
    import time

    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    sync()
    return out
