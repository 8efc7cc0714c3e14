"""What the profiler costs a decode step, from the engine's inter-token latency with and without it.

The same workload runs twice unprofiled just before /start_profile (profiling.capture): the two runs differ by
the host's noise, and the profiled run exceeds them by the profiler's cost per step. A level's unprofiled
step is the one measured before the phase's first profile where there was one; the gap between the two is
what earlier profiles left behind (the residue). profiler_event_cost_us times the profiler's cost per
recorded op on this machine: the fallback where /metrics has no inter-token latency.
"""
from __future__ import annotations

import time
from typing import Optional


def unprofiled_itl_us(runs_us: list) -> Optional[float]:
    """The mean of the unprofiled runs that measured it; None when none did."""
    got = [float(x) for x in runs_us if x]
    return sum(got) / len(got) if got else None


def itl_window_noise(runs_us: list, profiled_us: Optional[float] = None) -> Optional[float]:
    """|a - b| / their mean, of the two unprofiled runs: how much one workload's step moves a second
    later; at least the profiled run's shortfall below their mean, where it is faster than them (the
    profiler cannot speed a step up: a third window moved by that much)."""
    got = [float(x) for x in runs_us if x]
    if len(got) < 2:
        return None
    mean = sum(got[:2]) / 2
    spread = abs(got[0] - got[1]) / mean
    return max(spread, (mean - float(profiled_us)) / mean) if profiled_us else spread


def engine_itl_unprofiled_us(runs_us: list, before_profiles_us: Optional[float]) -> Optional[float]:
    """The level's unprofiled step: as measured before the phase's first profile where it was, else the
    mean of the unprofiled runs just before its own profile."""
    return float(before_profiles_us) if before_profiles_us else unprofiled_itl_us(runs_us)


def profiler_step_cost_us(unprofiled_us: Optional[float], profiled_us: Optional[float]) -> Optional[float]:
    """What the profiler added to each step: the profiled run's inter-token latency less the unprofiled step's."""
    return profiled_us - unprofiled_us if unprofiled_us and profiled_us else None


def profiler_residue_us(runs_us: list, before_profiles_us: Optional[float]) -> Optional[float]:
    """How much slower the level ran unprofiled just before its own profile than before the phase's first:
    what the earlier profiles left behind in the server (plus the host's drift over the phase)."""
    after = unprofiled_itl_us(runs_us)
    return after - float(before_profiles_us) if after and before_profiles_us else None


def profiler_event_cost_us(n_ops: int = 20000, repeats: int = 3) -> Optional[float]:
    """What torch.profiler (CPU activity, no stacks or shapes: how the server is started) adds to one
    recorded op: a tiny op timed n_ops times with and without it, the least difference of `repeats`."""
    try:
        # torch: the cpu/gpu extras only; the analysis side imports this module without it
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    a = torch.ones(8)

    def per_op_us() -> float:
        t0 = time.perf_counter()
        for _ in range(n_ops):
            torch.add(a, a)
        return (time.perf_counter() - t0) / n_ops * 1e6

    diffs = []
    for _ in range(repeats):
        plain = per_op_us()
        with profile(activities=[ProfilerActivity.CPU]):
            profiled = per_op_us()
        diffs.append(profiled - plain)
    return max(0.0, min(diffs))
