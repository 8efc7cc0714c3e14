"""One profiled level's step as the step model reads it (StepSample), and the host's share of it on a
small CPU host, where the workers, the engine core and the API server share the cores: which
tensor-parallel size leaves the host processes a core, and what of the measured step goes with the
contention there (the gap between steps, the ops' preemption)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class StepSample:
    """One profiled level on its critical rank (the one that waits least in its collectives: its time is
    the step's own work): each verdict class's time per step, the host's time inside and between
    steps, and the overlap of its lanes (busy / summed)."""

    batch: float
    context_tokens: float
    classes_us: dict
    idle_us: float
    between_us: float
    overlap: float
    period_us: float
    source: str
    profiler_cost_us: Optional[float] = None
    allreduce_wait_us: float = 0.0
    wait_own_op_us: float = 0.0     # the rank's collective-wait ops per step, where the wait is an op of its own
    profiler_cost_band_us: tuple = ()   # (low, high), set with profiler_cost_us (profiler_cost)
    profiler_cost_how: str = ""
    preempted_us: float = 0.0
    engine_cpu_us: float = 0.0      # the engine core's CPU time per step (04, /proc)
    engine_wait_us: float = 0.0     # its run-queue wait per step: runnable, no core free
    kernels_per_step: float = 0.0   # the critical rank's kernels (or ops) per step (04): what an eager host issues

    @property
    def rest_us(self) -> float:
        """The profiled period less its parts (work x overlap, idle, between steps): medians of parts do
        not add up to the period (the steps' trimmed mean period), and the model must reproduce what was
        measured."""
        return self.period_us - (sum(self.classes_us.values()) * self.overlap + self.idle_us + self.between_us)


def between_steps_at_freed_core(s: StepSample) -> float:
    """The host's time between steps once the engine core has a core of its own: the profiled time
    less the engine core's wait for a core, never below the engine core's own CPU time per step (what
    it needs to take a step's output and schedule the next). With the workers holding every core (on
    2 cores at TP=2: engine core 0.7 ms of CPU and 3.3 ms of run-queue wait per step), the gap between
    steps is mostly that wait: 1.45 ms at TP=2, 0.62 ms measured at TP=1 on the same host."""
    if not s.engine_cpu_us:
        return s.between_us
    # An engine core whose CPU per step exceeds the whole gap busy-polls (vLLM's shm MessageQueue reader
    # sched_yield-spins for a second after each read): where the workers sleep in gloo's waits its CPU and
    # its run-queue wait are that spin (13.3 and 19.1 ms a step against a 4.1 ms gap on an AVX2 host) and
    # say nothing of what a step needs; the gap is then held as profiled. Taking it to 0 there read
    # -28% and -30% against a real TP=1 server at concurrency 2 and 4.
    return min(s.between_us, max(s.between_us - s.engine_wait_us, s.engine_cpu_us))


def ops_keep(s: StepSample) -> float:
    """The share of the sample's op time a worker with a core of its own keeps: the run-queue wait beyond
    the idle in the step fell inside ops, spread over them by their runnable time (an op's time less the
    wait in ops of their own, where the rank sleeps)."""
    excess_us = max(s.preempted_us - s.idle_us, 0.0)
    runnable_us = sum(s.classes_us.values()) - s.wait_own_op_us
    if excess_us <= 0 or runnable_us <= 0:
        return 1.0
    return max(1.0 - excess_us / runnable_us, 0.0)


def ops_without_preemption(s: StepSample) -> StepSample:
    """The sample's ops as a worker with a core of its own runs them: each op class times ops_keep."""
    keep = ops_keep(s)
    return s if keep == 1.0 else replace(s, classes_us={k: v * keep for k, v in s.classes_us.items()})


def host_processes_get_a_core(tp: int, measured_tp: int, host_cores: Optional[int]) -> bool:
    """Whether the workers' preemption measured at measured_tp goes away at tp: the workers held every
    core there (one each, as the CPU build binds them) and at tp they leave one to the engine core and
    the API server."""
    return host_cores is not None and host_cores > 0 and measured_tp >= host_cores > tp
