"""Summary of repeated timings, shared by the probes (plain programs: torch and the stdlib only)."""
from __future__ import annotations

import statistics

HOST_ISSUE = "host_issue"  # the collective probe's timing of the host's own cost per call (GPUs): no transfer
# the same, each call issued right after a GEMM that writes its input, as a decode step issues it, less
# that GEMM issued alone: on 2x H200 an all-reduce costs the host ~25 us back to back, 31-41 us after a GEMM
HOST_AFTER_GEMM = "host_after_gemm"


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


def host_issue_after_us(fn, before, calls: int, iters: int, sync) -> list[float]:
    """Host microseconds per call of `fn` issued right after `before` (`calls` pairs back to back) less
    `before` issued alone as often, the two alternated `iters` times: what a call costs the host in the
    middle of a step's other launches, which warm its caches with their own code and data."""
    out = []
    for _ in range(iters):
        pair, alone = host_issue_us(lambda: (before(), fn()), calls, 1, sync), host_issue_us(before, calls, 1, sync)
        out.append(pair[0] - alone[0])
    return out
