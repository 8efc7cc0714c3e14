"""Steps that lose the CUDA graph's cover, priced from the baseline's own engine (05_verdict).

A decode step on a GPU replays CUDA graphs: the host launches one graph.
The Python and launches of the attention and MoE custom ops (`vllm::*`) then cost it nothing.
Two variants bring that host time back:
- piecewise graphs: a speculative-decoding step whose requests drafted nothing is no uniform decode batch
  of 1 + k tokens.
  So vLLM replays its piecewise graphs and runs their splitting ops on the host, layer by layer.
  Each splitting op runs before the next piece.
  The splitting ops are attention and KV-cache updates, named in the engine's config line.
- eager (`--enforce-eager`): no graph and no torch.compile; every op is issued from Python.

04's un-graphed capture (trace.hostops, data/profile/host_ops.json) measured each custom op's host cost.
It measured it in the baseline's engine, under the profiler.
The profiler's own cost is taken off each op by the events it recorded inside it.
Each event is priced at the cost per event 04 measured.
That cost is the level-1 step's profiler cost over the events a profiled decode step at batch 1 records.
The level-1 step's profiler cost is the engine's inter-token latency profiled less unprofiled.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from decodescope.schema.records import HostOps, ProfileCapture
from decodescope.schema.rundata import RunDir
from decodescope.trace.hostops import HOST_OPS_RECORD
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import stepparts as sp
from decodescope.engines import engine

# the baseline engine's own splitting ops where its log has no config line (vLLM 0.2x's attention ops)
DEFAULT_SPLITTING = engine().default_splitting_ops


def read_host_ops(run_dir: Path) -> Optional[HostOps]:
    """04's un-graphed capture's figures; None where 04 did not take it (older runs, profile.host_ops_tokens 0)."""
    return RunDir(run_dir).host_ops(HOST_OPS_RECORD)


def profiler_us_per_event(host_ops: Optional[HostOps], captures: dict[int, ProfileCapture]) -> tuple[Optional[float], str]:
    """(the profiler's cost per recorded host event, how): level 1's profiler step cost over the events a
    decode step at batch 1 records (the un-graphed capture's own decode steps); else the cost per recorded
    op 04 timed on a bare op (a floor: no CUDA activity, no trace writer)."""
    cap = captures.get(1)
    events = host_ops.decode_events_per_step if host_ops is not None else None
    if cap is not None and cap.profiler_step_cost_us is not None and cap.profiler_step_cost_us > 0 and events:
        return (cap.profiler_step_cost_us / events,
                f"level 1's profiler cost ({cap.profiler_step_cost_us:,.0f} us a step) over {events:,.0f} events a step")
    bare = next((c.profiler_event_cost_us for c in captures.values() if c.profiler_event_cost_us), None)
    return (float(bare), "04's cost per recorded op on a bare op") if bare else (None, "not measured")


def op_host_us(host_ops: HostOps, per_event_us: Optional[float], names: Optional[tuple] = None) -> list[tuple[str, int, float, float]]:
    """(name, calls per forward, host us per call without the profiler, launches per call) of each custom op
    of the un-graphed step (only `names` when given)."""
    out = []
    for r in host_ops.ops:
        if names is not None and r.name not in names:
            continue
        cost = r.host_us_per_call - (r.events_per_call * per_event_us if per_event_us else 0.0)
        out.append((r.name, r.calls_per_step, max(cost, 0.0), r.launches_per_call))
    return out


def piecewise_items(host_ops: HostOps, per_event_us: Optional[float], splitting: tuple, call_us: float,
                    gpu_us: float, attention_gpu_us: float) -> tuple[list[tuple[float, float]], list[str]]:
    """A piecewise step as the host issues it, layer by layer: a graph piece (a launch at 02's cost of a bare
    call), then the layer's splitting ops at their host cost, each attention op with its share of the step's
    attention GPU time; a last piece after the last layer. The pieces share the rest of the GPU time. Returns
    (items for stepparts.eager_walk, notes); no items when the capture ran none of the splitting ops."""
    ops = op_host_us(host_ops, per_event_us, splitting or DEFAULT_SPLITTING)
    layers = max((calls for _, calls, _, _ in ops), default=0)
    if not layers:
        return [], []
    attention = [name for name, _, _, _ in ops if "attention" in name]
    piece = ((gpu_us - attention_gpu_us) / (layers + 1)) if gpu_us > attention_gpu_us else 0.0
    items: list[tuple[float, float]] = []
    for layer in range(layers):
        items.append((call_us, piece))
        for name, calls, cost, _ in ops:
            if layer < calls:
                share = attention_gpu_us / (calls * len(attention)) if name in attention else 0.0
                items.append((cost, share))
    items.append((call_us, piece))
    notes = [f"{calls} x {name} at {cost:,.1f} us" for name, calls, cost, _ in ops]
    notes.append(f"{layers + 1} graph pieces launched at {call_us:.1f} us each (02's bare call), {gpu_us:,.0f} us of "
                 f"GPU time ({attention_gpu_us:,.0f} us of it attention)")
    return items, notes


def piecewise_component(items: list[tuple[float, float]], notes: list[str], gpu_us: float, step_tokens: int,
                        how_per_event: str, per_event_us: Optional[float]) -> sm.Component:
    """What a piecewise step adds to the graphed one: the host-paced walk's end past the GPU's own time (the
    GPU waits while the host runs each splitting op before launching the next piece)."""
    end = sp.eager_walk(items)[0]
    us = max(end - gpu_us, 0.0)
    return sm.Component(sm.OUTSIDE_GRAPH, us, us, us, f"host_ops.json (04's un-graphed step, {step_tokens} tokens)",
                        notes + [f"the walk ends at {end:,.0f} us against {gpu_us:,.0f} us of GPU time",
                                 f"the profiler's cost taken off per recorded event: {per_event_us or 0:,.2f} us "
                                 f"({how_per_event})"], sp.Kind.HOST_IN_STEP)


def lost_async_component(host_gap_us: Optional[float], gpu_idle_us: float, source: str) -> Optional[sm.Component]:
    """A variant that schedules synchronously where the baseline did not: the host's work between steps
    (scheduling, output processing: the baseline's host gap between one step's execute range and the next,
    under the profiler) no longer overlaps the GPU's step. What it adds is that gap less the time the
    baseline's GPU already sat idle a step (its period less its busy time): where the baseline's step was
    the host's, part of the gap was in it already. Band: none of the idle was the gap's (the whole gap)."""
    if host_gap_us is None:
        return None
    us = max(host_gap_us - gpu_idle_us, 0.0)
    return sm.Component(sm.LOST_ASYNC, us, us, host_gap_us, source,
                        [f"the baseline's host time between steps, {host_gap_us:,.0f} us, which its async scheduling "
                         f"overlapped with the GPU, less the {gpu_idle_us:,.0f} us its GPU sat idle a step"],
                        sp.Kind.HOST_IN_STEP)


def eager_items(host_ops: HostOps, per_event_us: Optional[float], kernels_per_step: int, call_us: float,
                gpu_us: float) -> tuple[list[tuple[float, float]], list[str]]:
    """An eager step as the host issues it: each custom op at its host cost, then every kernel not launched
    inside one at 02's cost of a bare call; the step's GPU time shared by launches. Returns (items for
    stepparts.eager_walk, notes)."""
    ops = op_host_us(host_ops, per_event_us)
    inside = sum(calls * launches for _, calls, _, launches in ops)
    rest = max(int(round(kernels_per_step - inside)), 0)
    launches = max(inside + rest, 1.0)
    items = [(cost, gpu_us * max(lch, 1.0) / launches) for _, calls, cost, lch in ops for _ in range(calls)]
    items += [(call_us, gpu_us / launches)] * rest
    notes = [f"{calls} x {name} at {cost:,.1f} us" for name, calls, cost, _ in ops]
    notes.append(f"{rest} more kernels at {call_us:.1f} us each (02's bare call)")
    return items, notes

