"""Where a variant's decode step spends its host time, from its own torch.profiler trace (04 on the variant,
`profile: true`): the steps' top-level CPU ops on the model runner's thread, per step, beside the step's
GPU busy time. For a projection that missed because the host, not the GPU, set the step's pace (eager,
or a spec-decode step that left the full CUDA graph).

    python benchmarks/variant_host_ops.py TRACE_DIR [TRACE_DIR ...] [--top 12]

A trace dir holds one rank's `*.pt.trace.json.gz` (vLLM's profiler). Steps are vLLM's
`execute_context_0(0)_generation_<n>(<tok>)` ranges (decode only); an op is top-level when no earlier op
of its thread is still open at its start; its time is its wall duration (children included).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodescope.trace.analyze import STEP_NAME  # noqa: E402
from decodescope.trace.nesting import parents_in_order, prev_in_thread  # noqa: E402


def is_decode(name: str) -> bool:
    m = STEP_NAME.fullmatch(name)
    return m is not None and m.group(1) == "0"  # no context (prefill) requests in the step


def load_events(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.glob("*rank0*.pt.trace.json.gz")) or sorted(trace_dir.glob("*.pt.trace.json.gz"))
    if not files:
        raise SystemExit(f"{trace_dir}: no *.pt.trace.json.gz")
    with gzip.open(files[0]) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def top_level(ops: list[dict]) -> list[dict]:
    """The ops no earlier op of their thread still holds open (trace.nesting, as the trace table nests them)."""
    ops = sorted(ops, key=lambda e: (str(e["tid"]), e["ts"], -e["dur"]))
    thread = np.unique([str(e["tid"]) for e in ops], return_inverse=True)[1]
    ts = np.array([e["ts"] for e in ops], dtype=float)
    parent = parents_in_order(prev_in_thread(len(ops), thread), ts, ts + np.array([e["dur"] for e in ops], dtype=float))
    return [e for e, p in zip(ops, parent) if p < 0]


def step_anatomy(events: list[dict]) -> dict:
    """Per decode step (medians and per-step means): its CPU range, GPU busy (union of kernel time inside
    the range's span), the gap to the next step's range, and the top-level CPU ops inside it by name."""
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and is_decode(e["name"])),
                   key=lambda e: e["ts"])
    if not steps:
        raise SystemExit("no decode steps (execute_context_0(0)_generation_N ranges) in the trace")
    starts = [s["ts"] for s in steps]
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in top_level([e for e in events if e.get("cat") == "cpu_op"]):
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] < steps[i]["ts"] + steps[i]["dur"]:
            per_name[e["name"]][0] += 1
            per_name[e["name"]][1] += e["dur"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    busy = []
    for a, b in zip(steps, steps[1:] + [None]):
        lo, hi = a["ts"], (b["ts"] if b is not None else a["ts"] + a["dur"])
        k0, k1 = bisect.bisect_left(kernels, (lo, lo)), bisect.bisect_left(kernels, (hi, hi))
        total, end = 0.0, lo
        for s, e in kernels[k0:k1]:
            s, e = max(s, end), min(e, hi)
            if e > s:
                total, end = total + e - s, e
        busy.append(total)
    n = len(steps)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(steps, steps[1:])]
    return {"steps": n, "cpu_range_us": statistics.median(s["dur"] for s in steps),
            "gpu_busy_us": statistics.median(busy), "between_us": statistics.median(gaps) if gaps else 0.0,
            "ops": {k: (c / n, t / n) for k, (c, t) in per_name.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for d in args.trace_dirs:
        a = step_anatomy(load_events(d))
        ops = sorted(a["ops"].items(), key=lambda kv: -kv[1][1])
        host = sum(t for _, t in a["ops"].values())
        print(f"{d}: {a['steps']} decode steps; per step (medians): CPU range {a['cpu_range_us']:,.0f} us, "
              f"GPU busy {a['gpu_busy_us']:,.0f} us, to the next step {a['between_us']:,.0f} us; top-level CPU ops "
              f"{host:,.0f} us a step (mean), {sum(c for c, _ in a['ops'].values()):.0f} of them")
        for name, (calls, us) in ops[:args.top]:
            print(f"  {calls:6.1f} a step  {us:9.1f} us a step  {us / calls:8.1f} us a call  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
