"""Summary of repeated timings, shared by the probes (plain programs: torch and the stdlib only)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

HOST_ISSUE = "host_issue"  # the collective probe's timing of the host's own cost per call (GPUs): no transfer
# the same, each call issued right after a GEMM that writes its input, as a decode step issues it, less
# that GEMM issued alone: on 2x H200 an all-reduce costs the host ~25 us back to back, 31-41 us after a GEMM
HOST_AFTER_GEMM = "host_after_gemm"


def _nearest_rank(s: list[float], q: float) -> float:
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def median_spread(times_us: list[float]) -> dict:
    """Median with p10/p90 (nearest rank) and the count: what every probe row reports."""
    s = sorted(times_us)
    return {"time_us": statistics.median(s), "p10_us": _nearest_rank(s, 0.10), "p90_us": _nearest_rank(s, 0.90),
            "n": len(s)}


# Linux's CLOCK_MONOTONIC_COARSE (linux/time.h), which Python's time module does not name: it advances once
# per scheduler tick, so its resolution is the tick
_CLOCK_MONOTONIC_COARSE = 6


def scheduler_tick_us() -> Optional[float]:
    """The kernel's scheduler tick in microseconds (4,000 at CONFIG_HZ=250), None where it cannot be read."""
    try:
        res_s = time.clock_getres(_CLOCK_MONOTONIC_COARSE)
    except (OSError, AttributeError):
        return None
    return res_s * 1e6 if 0 < res_s < 1 else None


def tick_stalls(times_us: list[float], tick_us: Optional[float]) -> dict:
    """Calls timed one by one, split into those a scheduler tick stalled and the rest.

    A stalled call waited on the core until a tick let its thread run.
    gloo's TCP loop does this on a core its own work thread shares: it spins on the pair's lock while the
    thread holding it waits for the core (gloo tcp/pair.cc handleEvents: try_lock, then epoll again).
    Only a tick or another wake-up on that core ends the spin.
    A stall adds up to a tick to the call's own time, which the fastest calls (p10) show.
    So a call is stalled when it lasts half a tick beyond p10.
    The split holds where a call's own time varies by less than half a tick, as a decode step's small
    messages do; a large message's own spread can pass it.
    It also needs p10 to be an unstalled call: where nine calls in ten stall, none count as stalled.
    Returns the tick, the stalled share and the median of the other calls; empty without a tick."""
    if not tick_us or not times_us:
        return {}
    s = sorted(times_us)
    limit_us = _nearest_rank(s, 0.10) + tick_us / 2
    unstalled = [t for t in s if t < limit_us]
    return {"tick_us": tick_us, "stalled_share": 1 - len(unstalled) / len(s),
            "unstalled_us": statistics.median(unstalled)}


REF_LAUNCHES = 32  # small-GEMM launches per host reference burst (~0.3 ms on an H200 host)
REF_DIM = 256


class HostRef:
    """The host's speed now, as the microseconds per launch of REF_LAUNCHES launches of a small bf16 GEMM.

    The GEMM is [1, REF_DIM] x [REF_DIM, REF_DIM], so the GPU never holds the host back.
    The device is drained first.
    Why: an eager step is paced by its host.
    A cloud VM's cores change speed by up to 1.8x from one second to the next (benchmarks/host_speed.py).
    A host cost measured by 02 or 03 may be set beside a step replayed a minute later.
    Dividing each by the reference taken beside it puts both at the same host speed.
    The reference is a GEMM launch, not a one-element add.
    On 2x H200 the add's time rose 1.35x from the host's fast state to its slow one, while the step's rose 1.6x.
    A GEMM launch walks the same library code (dispatcher, cuBLAS) as the step's own launches.
    Each call appends to `samples_us`."""

    def __init__(self, device, sync: Callable[[], None]):
        # torch: the analysis side uses this module's statistics without torch
        import torch

        self._a = torch.ones(1, REF_DIM, device=device, dtype=torch.bfloat16)
        self._w = torch.ones(REF_DIM, REF_DIM, device=device, dtype=torch.bfloat16)
        self._out = torch.empty(1, REF_DIM, device=device, dtype=torch.bfloat16)
        self._sync = sync
        self.samples_us: list[float] = []
        self._burst()  # first calls pay for library set-up (cuBLAS handles): not the host's speed

    def _burst(self) -> float:
        # torch: the analysis side uses this module's statistics without torch
        import torch

        self._sync()
        t0 = time.perf_counter()
        for _ in range(REF_LAUNCHES):
            torch.mm(self._a, self._w, out=self._out)
        return (time.perf_counter() - t0) * 1e6 / REF_LAUNCHES

    def __call__(self) -> float:
        us = self._burst()
        self.samples_us.append(us)
        return us

    def take_median_us(self) -> Optional[float]:
        """The median of the samples since the last take, which are then dropped."""
        s, self.samples_us = self.samples_us, []
        return statistics.median(s) if s else None


def host_issue_us(fn, calls: int, iters: int, sync, ref: Optional[HostRef] = None) -> list[float]:
    """Host microseconds per call of issuing `calls` calls back to back, the device drained (`sync`)
    before each repetition: what a host-bound (eager) step pays per launch, whatever the device takes.
    `calls` stays well below a CUDA stream's launch queue (~1,000 kernels), so the host never waits for
    the device inside the loop. With `ref`, the host's speed is sampled before each repetition."""
    out = []
    for _ in range(iters):
        if ref is not None:
            ref()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    sync()
    return out


def host_issue_after_us(fn, before, calls: int, iters: int, sync, ref: Optional[HostRef] = None) -> list[float]:
    """Host microseconds per call of `fn` issued right after `before` (`calls` pairs back to back) less
    `before` issued alone as often, the two alternated `iters` times: what a call costs the host in the
    middle of a step's other launches, which warm its caches with their own code and data."""
    out = []
    for _ in range(iters):
        pair = host_issue_us(lambda: (before(), fn()), calls, 1, sync, ref)
        alone = host_issue_us(before, calls, 1, sync)
        out.append(pair[0] - alone[0])
    return out
