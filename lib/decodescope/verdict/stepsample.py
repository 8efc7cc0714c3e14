"""One profiled level's step as the step model reads it (StepSample), and the host's share of it.

On a small CPU host the workers, the engine core and the API server share the cores.
This module says which tensor-parallel size leaves the host processes a core.
It also says what of the measured step goes with the contention there.
That part is the gap between steps and the ops' preemption."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from decodescope.verdict.stepparts import Component, Kind

PREEMPTED = "workers preempted by the host's processes"
AS_PAID = "all-reduces as the engine paid them, less 03's price"


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
    # An engine core whose CPU per step exceeds the whole gap busy-polls.
    # vLLM's shm MessageQueue reader sched_yield-spins for a second after each read.
    # Where the workers sleep in gloo's waits, the engine core's CPU and run-queue wait are that spin.
    # On an AVX2 host they were 13.3 and 19.1 ms a step against a 4.1 ms gap.
    # They say nothing of what a step needs, so the gap is then held as profiled.
    # Taking it to 0 there read -28% and -30% against a real TP=1 server at concurrency 2 and 4.
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


def across_levels(samples: list[StepSample], batch: float, value) -> tuple[float, float, float, list[str]]:
    """A profile-sourced value at `batch`: linear between the profiled batches, held at the nearest one
    outside them (and said so). Band: the smallest and largest value at the profiled batches around it."""
    xs = np.array([s.batch for s in samples])
    ys = np.array([value(s) for s in samples])
    notes = []
    if len(xs) == 1 or batch <= xs[0] or batch >= xs[-1]:
        if not (xs[0] <= batch <= xs[-1]):
            notes.append(f"held at the nearest profiled batch ({xs[0] if batch < xs[0] else xs[-1]:g})")
        v = float(ys[0] if batch <= xs[0] else ys[-1])
        return v, float(ys.min()), float(ys.max()), notes
    v = float(np.interp(batch, xs, ys))
    i = int(np.searchsorted(xs, batch))
    return v, float(min(ys[i - 1], ys[i])), float(max(ys[i - 1], ys[i])), notes


def preempted_us(s: StepSample) -> float:
    """The workers' run-queue wait in a sample's step, never more than the idle it was measured in."""
    return min(s.preempted_us, s.idle_us)


@dataclass(frozen=True)
class HostModel:
    """The host's contention where the server's processes outnumber its cores (the embedded default: two
    workers, the engine core and the API server on 2 cores). On a host with a core per process, as a GPU
    host has, 04 measures no preemption and no gloo wait op, and every method leaves the step as profiled.
    cores: the host's cores; tp: the size priced; measured_tp: the size profiled."""

    cores: Optional[int]
    tp: int
    measured_tp: int

    @property
    def frees_a_core(self) -> bool:
        """Whether the size priced leaves the host's other processes a core the profiled size held."""
        return host_processes_get_a_core(self.tp, self.measured_tp, self.cores)

    def as_run(self, samples: list[StepSample]) -> list[StepSample]:
        """The profiled levels with the op time a worker with a core of its own keeps (ops_without_preemption)."""
        return [ops_without_preemption(s) for s in samples] if self.frees_a_core else samples

    def ops_keep_at(self, samples: list[StepSample], batch: float) -> float:
        """The share of op time kept at `batch` (ops_keep across the levels); 1 where no core is freed."""
        return across_levels(samples, batch, ops_keep)[0] if self.frees_a_core and samples else 1.0

    def between_us(self, s: StepSample) -> float:
        """A level's time between steps: at a freed core the engine core's own need (between_steps_at_freed_core)."""
        return between_steps_at_freed_core(s) if self.frees_a_core else s.between_us

    def between_notes(self, samples: list[StepSample]) -> list[str]:
        if self.frees_a_core and any(s.engine_cpu_us for s in samples):
            return [f"at tensor-parallel {self.tp} the engine core has a core of its own: between steps is its own "
                    "CPU time per step, not its wait for a core (04, /proc), where that is less"]
        return []

    def preempted(self, samples: list[StepSample], batch: float, source: str) -> Optional[Component]:
        """The workers' run-queue wait per step (04), out of the idle in the step; 0 at a freed core; None
        where 04 measured none."""
        if not any(s.preempted_us for s in samples):
            return None
        v, lo, hi, notes = across_levels(samples, batch, preempted_us)
        if any(s.preempted_us > s.idle_us for s in samples):
            notes.append("capped at the idle in the step")
        if self.frees_a_core:
            assert self.cores is not None  # frees_a_core holds only with cores set
            notes.append(f"0 at tensor-parallel {self.tp}: its workers leave {self.cores - self.tp} of the host's "
                         f"{self.cores} cores to the engine core and the API server")
            v = lo = hi = 0.0
        return Component(PREEMPTED, v, lo, hi, source + " (workers' run-queue wait per step, /proc schedstat)",
                         notes, Kind.HOST_IN_STEP)

    def collectives_as_paid(self, samples: list[StepSample], batch: float,
                            priced_us: float) -> Optional[Component]:
        """What the engine's gloo calls cost the step against 03's price of them, where each waits in an op of
        its own on every profiled level (collectives_as_paid); None elsewhere."""
        if not samples or not all(s.wait_own_op_us for s in samples):
            return None
        return collectives_as_paid(samples, batch, priced_us)


def collectives_as_paid(samples: list[StepSample], batch: float, priced_us: float) -> Component:
    """Where each all-reduce waits in an op of its own (gloo), the step's calls as the engine paid them,
    less 03's price of them at `batch` (priced_us). At and between the profiled levels
    the calls cost what the profile measured, on either side of 03's price: the critical rank's
    communication ops per step, waits included, linear in batch between the levels, as the other
    profile-sourced parts. Past them (a speculative step's verification at batch x (k + 1) tokens) they cost
    what the nearest level paid, or 03's price where that is higher (larger messages).

    A gloo call is three threads' hand-overs (the worker's, gloo's work thread, its TCP loop), each on the
    rank's core, and what else runs on that core sets what a call costs beyond its own time:
    - the engine core and the API server hold those cores in the engine, which 03's two ranks alone never
      meet (benchmarks/gloo_contention.py: 3.4-4.3x the run-queue wait a call on 2 cores): the engine's
      calls cost more than 03's;
    - on a kernel that preempts only at its tick (CONFIG_PREEMPT_NONE), gloo's TCP loop spins on the pair's
      lock while the work thread that holds it waits for the core, until a tick or another wake-up on that
      core ends it: 03's quiet cores let it run to the tick, the engine's busy ones end it sooner
      (benchmarks/results/avx2_host_20261207.txt). 03 prices its unstalled calls where it split them by the
      tick; where it did not, its calls can cost more than the engine's.
    Either way the profile measured the engine's own calls, so where it measured them it holds."""
    paid, lo, hi, notes = across_levels(samples, batch, lambda s: s.classes_us.get("communication", 0.0))
    floor = -priced_us if samples[0].batch <= batch <= samples[-1].batch else 0.0
    if paid < priced_us:
        notes.append(f"the profiled calls ({paid:,.0f} us a step here) cost the step less than 03's price "
                     f"({priced_us:,.0f} us)" + ("" if floor else ": past the profiled levels 03's price holds"))
    return Component(AS_PAID, max(paid - priced_us, floor), max(lo - priced_us, floor), max(hi - priced_us, floor),
                     "; ".join(s.source for s in samples) + " (the critical rank's all-reduce and wait ops per "
                     "step, less 03's price of the calls)", notes)
