"""04's guard for a server decodescope attached to: profile it only in windows its host can afford.

A torch.profiler window costs the server twice.
It costs the trace file each rank writes, and the memory each worker holds while it exports that trace.
vLLM's default is `torch_profiler_with_stack: true`.
With it, 04's window of 12 requests wrote 82 MB of gzip per rank on the 2-core host.
Each worker grew to about 11 GB while exporting it, until the kernel killed one.
A server decodescope launches is started without stacks.
An attached server is the user's, so 04 measures what a window costs there before it takes one.

A trace grows with the profiled span, not only with the steps in it.
With stacks on, one request of one token and one of six tokens wrote the same 1.1 MB per rank.
The steps were few next to the span.
Yet a window of 8 requests of 512 tokens outgrew 20 GB in a worker.
So the cost is read per second of profiled span, at the level's own load:

0. Where the server's command line says stacks are on, nothing is profiled (stack_refusal).
   The exception is a host that holds STACK_WINDOW_EXPORT_BYTES a rank within MEMORY_SHARE of its available memory.
1. Probe-1 profiles one request of one output token, the smallest real window.
   It gives bytes per second of span, read most pessimistically (all of it per second).
   That rate bounds how long a slice may be.
2. A slice of each level's own workload is profiled once its first wave of requests has run.
   It is profiled for `slice_seconds`, so that by probe-1's rate its export stays within PROBE_MEMORY_SHARE
   of the available memory.
   Then profiling stops while the workload finishes unprofiled.
   The slice gives trace bytes and output tokens per second of span.
3. The level's window: its trace is the larger of two readings of the slice.
   By the step: the slice's bytes per step times the most steps the window can take, every request alone (est_steps).
   The slice's bytes per step are its rank trace over the steps annotated in it.
   By the span: the window's output tokens over the slice's tokens per second give its span.
   That span is priced at the slice's bytes per second.
   The step is what a trace grows by with stacks off.
   That was 5.8 to 6.2 KB a step over the slices and windows of the 2-core host at concurrency 1 and 4.
   A window's steps are set by its client's pace.
   The same 12 requests of 16 tokens at concurrency 4 took 50 steps in one window and 104 in another.
   In the second, the client process stood still for about 1 s at a time (its event loop's lag, measured).
   The requests then ran one by one.
   No slice foretells that.
   A slice can see no step: at concurrency 4, 12 requests of 16 tokens ended before the profiler had started.
   It says nothing of the level then, so the level is priced from the window measured so far with the most
   trace bytes a step (pricing_window).
   Each rank's export is the trace times the largest export ratio measured.
   That ratio is at least EXPORT_PER_TRACE_BYTE.
   The floor is there because a worker reuses memory an earlier export left it, and then shows no growth.
   The window runs whole when two things fit.
   Every rank's export must fit in MEMORY_SHARE of the available memory.
   The traces must fit in DISK_SHARE of the free disk.
   Otherwise it runs with fewer requests (at least one batch) when those fit.
   Otherwise it is refused, and the refusal names what was measured and the option to change.
"""
from __future__ import annotations

import math
from typing import Optional

from decodescope.schema.records_attach import AttachGuard, WindowCost, WindowPlan

PROBE_MEMORY_SHARE = 0.1
SLICE_MAX_S = 2.0
SLICE_MIN_S = 0.2
MIN_SPAN_S = 0.05      # a span read shorter than this is taken as this (the stamps' own resolution)
MEMORY_SHARE = 0.5
DISK_SHARE = 0.5
# Memory a worker held while exporting, per byte of the gzip trace it wrote, where it could be seen.
# It was 134 in the 12-request window of the issue (11 GB for 82 MB).
# It was 148 to 310 on the 2-core host (one request, stacks on).
# The floor is the least of these, so a reading of no growth does not pass for no cost.
EXPORT_PER_TRACE_BYTE = 134.0
# With stacks on, the smallest window is not small.
# One request of one output token, profiled on a fresh server here, wrote 46 MB of trace per rank.
# A worker held 11.5 GB exporting it when the kernel killed it.
# Another fresh server's first one-token window wrote 1.1 MB.
# A server whose command line says stacks are on is refused before any window.
# The exception is a host that holds this much per rank within MEMORY_SHARE.
STACK_WINDOW_EXPORT_BYTES = 11_500_000_000


def export_ratio(costs: list[WindowCost], ranks: int) -> float:
    """A rank's export bytes per byte of its trace: the windows' export, summed over the server's processes,
    over `ranks` traces; the largest measured, at least EXPORT_PER_TRACE_BYTE."""
    measured = [c.export_bytes / (c.trace_bytes * ranks) for c in costs if c.export_bytes and c.trace_bytes]
    return max(measured + [EXPORT_PER_TRACE_BYTE])


def bytes_per_s(cost: WindowCost) -> float:
    return cost.trace_bytes / max(cost.span_s, MIN_SPAN_S)


def slice_seconds(probe: WindowCost, ranks: int, mem_available: Optional[int], ratio: float) -> float:
    """How long a level's slice may be profiled: by the probe's bytes per second of span (read most
    pessimistically), its export within PROBE_MEMORY_SHARE of the available memory; at most SLICE_MAX_S;
    0 when not even SLICE_MIN_S fits (nothing may be profiled)."""
    if not mem_available:
        return SLICE_MIN_S
    per_s = bytes_per_s(probe) * ratio * ranks
    t = min(SLICE_MAX_S, PROBE_MEMORY_SHARE * mem_available / max(per_s, 1.0))
    return t if t >= SLICE_MIN_S else 0.0


def bytes_per_step(cost: WindowCost) -> float:
    """A window's rank trace per engine step: over the steps annotated in the trace where they were counted
    (the counter's span can miss the profiler's by a step or two at each end), else vLLM's counter."""
    return cost.trace_bytes / max(float(cost.trace_steps or cost.steps), 1.0)


def saw_steps(cost: WindowCost) -> bool:
    """Whether a window profiled any engine step that generated tokens: else its bytes priced nothing."""
    return bool(cost.trace_steps or cost.steps) and cost.tokens > 0


def pricing_window(slice_cost: WindowCost, measured: list[WindowCost]) -> WindowCost:
    """What a level's window is priced from: its slice, where that saw steps; else, of the windows measured
    (probes, slices, levels), the one with the most trace bytes a step (a trace grows by the step); the
    slice itself where none saw a step."""
    if saw_steps(slice_cost):
        return slice_cost
    seen = [c for c in measured if saw_steps(c)]
    return max(seen, key=bytes_per_step) if seen else slice_cost


def window_steps(requests: int, tokens: float) -> float:
    """The most engine steps `requests` requests of `tokens` output tokens in all can take: each one alone,
    its prefill step (which makes its first token), one step a further token, and one step after its last
    (measured: 204 steps for 12 requests of 16 tokens at concurrency 1)."""
    return tokens + requests


def window_span_s(slice_cost: WindowCost, tokens: float) -> float:
    """The profiled span of a window that generates `tokens` output tokens, at the slice's rate."""
    per_s = max(slice_cost.tokens, 1.0) / max(slice_cost.span_s, MIN_SPAN_S)
    return tokens / per_s


def plan_window(label: str, slice_cost: WindowCost, planned_requests: int, planned_tokens: float, concurrency: int,
                ranks: int, ratio: float, mem_available: Optional[int], disk_free: Optional[int]) -> WindowPlan:
    """The level's window from its slice: whole when it fits, else the most requests (at least
    `concurrency`, one batch) that fit, its span scaled by requests; else refused."""
    span = window_span_s(slice_cost, planned_tokens)
    steps = window_steps(planned_requests, planned_tokens)
    trace = max(bytes_per_s(slice_cost) * span, bytes_per_step(slice_cost) * steps)
    limits = []   # the largest rank trace each resource allows
    if mem_available:
        limits.append(("memory", MEMORY_SHARE * mem_available / (ratio * ranks)))
    if disk_free:
        limits.append(("disk", DISK_SHARE * disk_free / (ranks + 1)))  # the ranks' and the front end's traces
    bound = min(limits, key=lambda x: x[1]) if limits else None
    common = dict(label=label, planned_requests=planned_requests, planned_tokens=planned_tokens, est_span_s=span,
                  priced_by=slice_cost.label,
                  mem_available_bytes=mem_available, disk_free_bytes=disk_free)

    def plan(requests: int, decision: str) -> WindowPlan:
        share = requests / max(planned_requests, 1)
        t = trace * share
        return WindowPlan(**common, est_steps=steps * share, allowed_requests=requests if decision != "refused" else 0,
                          est_trace_bytes=int(t), est_export_bytes=int(t * ratio * ranks),
                          decision=decision)

    if bound is None or trace <= bound[1]:
        return plan(planned_requests, "fits")
    allowed = min(planned_requests, int(math.floor(planned_requests * bound[1] / trace)))
    if allowed >= concurrency:
        return plan(allowed, f"shrunk: {planned_requests} requests would not fit the {bound[0]}")
    refused = plan(concurrency, "refused")
    return refused.model_copy(update={"decision": f"refused: one batch of {concurrency} would not fit the {bound[0]}"})


def stack_refusal(with_stack: Optional[bool], ranks: int, mem_available: Optional[int]) -> Optional[str]:
    """Why a server with stacks on cannot be profiled here at all (None: it may be probed): the smallest
    window's measured export per rank, against MEMORY_SHARE of the available memory."""
    if not with_stack:
        return None
    need = STACK_WINDOW_EXPORT_BYTES * ranks
    if mem_available and need <= MEMORY_SHARE * mem_available:
        return None
    have = f"{mem_available / 2**30:.1f} GiB available" if mem_available else "memory that could not be read"
    return (f"04 refused to profile the attached server: its command line says torch_profiler_with_stack true "
            f"(vLLM's default), and with stacks on even a window of one request of one token has needed "
            f"{STACK_WINDOW_EXPORT_BYTES / 1e9:.1f} GB in a worker to export (measured on vLLM CPU 0.32, where the "
            f"kernel then killed the worker): {ranks} ranks x that is more than {MEMORY_SHARE:.0%} of the host's "
            f"{have}. Restart the server yourself with --profiler-config torch_profiler_with_stack false. No "
            "profile was started; the server was left running, as it was")


def refusal_message(guard: AttachGuard, plan: WindowPlan, ranks: int) -> str:
    """Why a level's window was refused: what was measured, what the host has, what to change."""
    gib = 1 / 2**30
    measured = "; ".join(f"{c.label}: {c.span_s:.2f} s profiled, {c.steps:.0f} steps, rank trace "
                         f"{c.trace_bytes / 2**20:.2f} MiB, export "
                         + (f"{c.export_bytes * gib:.2f} GiB" if c.export_bytes is not None else "not readable")
                         for c in guard.probes + guard.slices)
    stack = ("it was started with torch_profiler_with_stack true (vLLM's default)" if guard.with_stack
             else "its profiler settings")
    return (f"04 refused to profile the attached server at {plan.label}: one batch would write about "
            f"{plan.est_trace_bytes / 2**20:.0f} MiB of trace per rank and need about "
            f"{plan.est_export_bytes * gib:.1f} GiB of the workers' memory to export it ({ranks} ranks), against "
            + (f"{plan.mem_available_bytes * gib:.1f} GiB available" if plan.mem_available_bytes else "unknown memory")
            + (f" and {plan.disk_free_bytes * gib:.1f} GiB free disk" if plan.disk_free_bytes else "")
            + f" (a window may take {MEMORY_SHARE:.0%} of either). Measured: {measured}. The cause: {stack}. "
            "Restart the server yourself with --profiler-config torch_profiler_with_stack false (record_shapes, "
            "with_memory and with_flops false too), or make the window smaller (profile.output_tokens, "
            "profile.requests, profile.concurrency). The server was left running, as it was")
