"""GEMM probe: time each (op, batch, dtype) of a decode step at its sharded shape.

A plain program for the GPU host (no notebook dependencies beyond torch):

    python -m decodescope.probes.gemm --shapes shapes.json --out gemm.json [--device cuda] [--warm-l2]

shapes.json is a list of {op, layer_kind, batch, m, n, k, count, dtype}. Method, stated with every
result: the L2 cache flushed before each call (a 2 x L2 buffer zeroed) unless --warm-l2; eager: `warmup`
untimed calls, then `iters` calls each alone between CUDA events; graph: CUDA graphs of 16 calls
replayed between events, the flushes timed alone and subtracted (events resolve ~0.5 us, too coarse for
one microsecond GEMM); both recorded, medians with p10/p90, time_us is the graph's. On a CPU the same loop uses perf_counter, no flush,
and, when vllm is importable, the kernels vLLM's CPU build runs: its linear dispatch (oneDNN with a
prepacked weight) and its fused MoE kernel, timed whole and split between w13 and w2 by FLOPs.
On a CPU each decode step's GEMMs are also timed as the step meets them (step_order: layer by layer,
each layer its own weights, each pass after a pause as steps follow the host's work between them), the
column the step model prices CPU GEMMs with. W4A16 goes through vLLM's Marlin op when vllm is
importable, else the row is recorded as skipped.
Results are appended to --out after every shape (atomically), so a crash keeps what was measured.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Callable, Optional

import torch

from decodescope.core.dtypes import bytes_per_element
from decodescope.probes.gemm_kernels import (MARLIN_GROUP, TORCH_DTYPES, EngineKernel, marlin_unavailable,
                                             cpu_engine_kernel, make_gemm, marlin_moe_call)
from decodescope.probes.timing import HostRef, host_issue_us, median_spread
from decodescope.exec.procs import parse_cpulist
from decodescope.core.logsetup import run_program
from decodescope.core.probefile import write_probe_output

log = logging.getLogger(__name__)

HOST_ISSUE_CALLS = 32  # calls issued back to back per repetition of the host-cost timing


class Flusher:
    """Zeroes a buffer of at least 256 MB (and twice the L2): the next kernel starts with a cold L2.
    The size is triton.testing.do_bench's, so the two agree on what "cold" means."""

    def __init__(self, device: torch.device):
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        self.buf = torch.empty(max(2 * l2, 256 << 20), dtype=torch.int8, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def time_cuda(fn: Callable[[], None], iters: int, warmup: int, flush: Optional[Flusher],
              warmup_ms: float = 25.0) -> list[float]:
    """Warm-up runs at least `warmup` calls and `warmup_ms` of GPU time, so clocks have ramped up."""
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while n < warmup or (time.perf_counter() - t0) * 1e3 < warmup_ms:
        fn()
        n += 1
        if n % 16 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _capture(body: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


GRAPH_CALLS = 16  # GEMM calls per timed graph replay


def graph_replays(iters: int) -> int:
    return max(3, iters // 2)


def time_cuda_graph(fn: Callable[[], None], iters: int, warmup: int, flush: Optional[Flusher],
                    calls_per_replay: int = GRAPH_CALLS) -> list[float]:
    """Per-call times from CUDA-graph replays of many calls between one pair of events: the events'
    ~0.5 us resolution is 5-10% of a microsecond decode GEMM. A twin graph, replayed alternately and
    subtracted, cancels what is not the GEMM: with a flush, the twin is the flushes alone; warm, the
    twin holds half the calls (so the graph launch and event overheads cancel too)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 2)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    k = calls_per_replay

    def work():
        for _ in range(k if flush else 2 * k):
            if flush:
                flush()
            fn()

    def twin():
        for _ in range(k):
            flush() if flush else fn()

    return _work_minus_twin(_capture(work), _capture(twin), iters, max(2, warmup // k), k)


def _work_minus_twin(g_work, g_twin, iters: int, warm_replays: int, calls: int) -> list[float]:
    """Per-call microseconds: replays of the work graph minus replays of its twin, alternated between
    event triples, divided by the calls the work graph has beyond its twin."""
    for _ in range(warm_replays):
        g_work.replay()
        g_twin.replay()
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(graph_replays(iters))]
    for e in ev:
        e[0].record()
        g_work.replay()
        e[1].record()
        g_twin.replay()
        e[2].record()
    torch.cuda.synchronize()
    return [(e[0].elapsed_time(e[1]) - e[1].elapsed_time(e[2])) * 1e3 / calls for e in ev]


COLD_WEIGHTS_BYTES = 256 << 20  # weight copies cycled through, so none is still in L2 when it comes back


def rotating_weights(m: int, n: int, k: int, dtype: str, device: torch.device, groups: int = 1) -> Optional[list]:
    """Calls of one GEMM that share the activations and output but each read their own weight copy
    (enough copies to span COLD_WEIGHTS_BYTES): in a decode step every layer reads its own weights from
    memory while the activations stay in L2. int4 MoE through vLLM's Marlin MoE kernel; None for
    the other dtypes without a plain torch matmul."""
    if dtype == "int4" and groups > 1 and device.type == "cuda" and not marlin_unavailable(device):
        call, q_all = marlin_moe_call(m, n, k, groups, device)
        per_copy = groups * n * k * bytes_per_element("int4", MARLIN_GROUP)
        copies = int(min(4096, max(2, -(-COLD_WEIGHTS_BYTES // per_copy))))
        ws = [q_all] + [q_all.clone() for _ in range(copies - 1)]
        return [(lambda w=w: call(w)) for w in ws]
    dt = TORCH_DTYPES.get(dtype)
    if dt is None or device.type != "cuda":
        return None
    elt = torch.tensor([], dtype=dt).element_size()
    copies = int(min(4096, max(2, -(-COLD_WEIGHTS_BYTES // (groups * n * k * elt)))))
    if groups > 1:
        a = torch.randn(groups, m, k, device=device, dtype=dt)
        out = torch.empty(groups, m, n, device=device, dtype=dt)
        ws = [torch.randn(groups, n, k, device=device, dtype=dt) for _ in range(copies)]
        return [(lambda w=w: torch.bmm(a, w.transpose(1, 2), out=out)) for w in ws]
    a = torch.randn(m, k, device=device, dtype=dt)
    out = torch.empty(m, n, device=device, dtype=dt)
    ws = [torch.randn(n, k, device=device, dtype=dt) for _ in range(copies)]
    return [(lambda w=w: torch.mm(a, w.t(), out=out)) for w in ws]


def time_cuda_graph_cold_weights(fns: list, iters: int, warmup: int, calls_per_replay: int = GRAPH_CALLS) -> list[float]:
    """Per-call times of a CUDA graph that calls every weight copy once (at least 2 x GRAPH_CALLS calls),
    so each call reads weights that left L2 long ago while the activations stay in it; minus a graph of
    the first half of those calls, so graph launch and event overheads cancel, as in warm mode."""
    n_work = max(2 * calls_per_replay, len(fns))
    order = [fns[i % len(fns)] for i in range(n_work)]
    n_twin = n_work // 2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in order:
            fn()
    torch.cuda.current_stream().wait_stream(stream)

    def work():
        for fn in order:
            fn()

    def twin():
        for fn in order[:n_twin]:
            fn()

    return _work_minus_twin(_capture(work), _capture(twin), iters, 2, n_work - n_twin)


def time_cpu(fn: Callable[[], None], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure(shape: dict, device: torch.device, iters: int, warmup: int, flush: Optional[Flusher],
            graph: bool) -> dict:
    m, n, k, dtype = shape["m"], shape["n"], shape["k"], shape["dtype"]
    row = {**shape, "device": str(device), "iters": iters, "warmup": warmup,
           "l2": "flushed" if flush else "warm", "status": "ok", "skip_reason": ""}
    groups = int(shape.get("groups", 1))
    engine = cpu_engine_kernel(shape, dtype) if device.type == "cpu" else None
    fn: Optional[Callable]
    if engine is not None:
        fn, reason, nbytes, share, kernel = engine.fn, "", engine.nbytes, engine.share, engine.kernel
    else:
        (fn, reason, nbytes), share, kernel = make_gemm(m, n, k, dtype, device, groups), 1.0, ""
    if fn is None:
        row.update(status="skipped", skip_reason=reason)
        return row
    flops = 2.0 * m * n * k * groups
    if device.type == "cuda":
        eager = median_spread(time_cuda(fn, iters, warmup, flush))
        row.update({f"eager_{k2}": v for k2, v in eager.items()})
        # the host's own cost per call, for a step the host issues op by op (eager): the GPU may be idle
        # waiting for it, which no GPU timing shows
        ref = HostRef(device, torch.cuda.synchronize)
        host = median_spread(host_issue_us(fn, HOST_ISSUE_CALLS, iters, torch.cuda.synchronize, ref))
        row.update({f"host_{k2}": v for k2, v in host.items() if k2 != "n"}, host_ref_us=ref.take_median_us())
        if graph:
            try:
                g = median_spread(time_cuda_graph(fn, iters, warmup, flush))
                row.update({f"graph_{k2}": v for k2, v in g.items()})
            except Exception as e:
                row["graph_error"] = f"{type(e).__name__}: {e}"
            fns = rotating_weights(m, n, k, dtype, device, groups)
            if fns:
                # a second column, for the step model: the way a decode step meets this GEMM
                cold = median_spread(time_cuda_graph_cold_weights(fns, iters, warmup))
                row.update({f"cold_weights_{k2}": v for k2, v in cold.items()})
                del fns
        best = row.get("graph_time_us", eager["time_us"]) if graph else eager["time_us"]
        row["method"] = (f"{'L2 flushed before each call' if flush else 'L2 warm'}; eager: CUDA events around "
                         f"each call, median of {iters} after {warmup} warm-up; graph: CUDA events around "
                         f"replays of {f'{GRAPH_CALLS} calls minus the flushes alone' if flush else f'{2 * GRAPH_CALLS} calls minus replays of {GRAPH_CALLS}'}, "
                         f"median of {graph_replays(iters)}; host: the host's time to issue {HOST_ISSUE_CALLS} calls back to back "
                         f"(GPU drained first), per call; time_us = " + ("graph" if graph and "graph_time_us" in row else "eager"))
    else:
        eager = median_spread([t * share for t in time_cpu(fn, iters, warmup)])
        row.update({f"eager_{k2}": v for k2, v in eager.items()})
        best = eager["time_us"]
        row["method"] = (kernel + f"perf_counter around each call on the CPU ({torch.get_num_threads()} threads), "
                         f"median of {iters}")
    row["time_us"] = best
    row["tflops"] = flops / (best * 1e-6) / 1e12
    row["gbps"] = nbytes / (best * 1e-6) / 1e9
    row["bytes"] = nbytes
    return row


STEP_PAUSE_S = 0.001  # the host's time between two decode steps, about (2 cores, TP=2: ~1.5 ms)


def time_cpu_step_order(shapes: list[dict], dtype: str, iters: int, warmup: int) -> dict[int, list[float]]:
    """One decode step's GEMMs on a CPU as the step meets them: layer by layer (every shape of the step,
    in the plan's order, once per layer: `count` of them, each with its own weights), each pass after
    a STEP_PAUSE_S pause, as a step follows the host's work between steps. Returns, per shape (its index
    in `shapes`), its time per call in each pass. vLLM's fused MoE computes w13 and w2 in one call: it
    is called once, at moe_w13, and its time split between the two by FLOPs (EngineKernel.share).

    Why not the per-call timing alone: on the 2-core CI machine the step's 17 GEMMs take 1.26x their
    back-to-back per-call times once a pause or a barrier comes before them (183 vs 231 us at batch 1),
    and a step always comes after one."""
    layers = max(int(x.get("count", 1)) for x in shapes)
    w13 = next((i for i, x in enumerate(shapes) if x["op"] == "moe_w13"), None)
    kernels: dict[int, list[EngineKernel]] = {}  # shape index -> one kernel per layer, its own weights
    for i, x in enumerate(shapes):
        for _ in range(int(x.get("count", 1))):
            engine = cpu_engine_kernel(x, dtype)
            if engine is None:
                fn = make_gemm(x["m"], x["n"], x["k"], dtype, torch.device("cpu"), int(x.get("groups", 1)))[0]
                if fn is None:
                    break
                engine = EngineKernel(fn, 1.0, 0.0, "")
            kernels.setdefault(i, []).append(engine)
            if engine.share < 1.0 and x["op"] == "moe_w2":
                break  # inside moe_w13's fused call: one kernel for its share, never called
    # moe_w2 whose time is its share of moe_w13's fused call
    fused = {i for i, made in kernels.items() if shapes[i]["op"] == "moe_w2" and made[0].share < 1.0
             and w13 in kernels and kernels[w13][0].share < 1.0}
    # the layer an op is first met in: dense MLPs in the first layers (DeepSeek-style first_k_dense_replace),
    # every other op in the last `count` (MoE after the dense layers; the lm_head after the last layer's ops)
    first = {i: 0 if shapes[i].get("layer_kind") == "dense_mlp" else layers - len(made) for i, made in kernels.items()}
    times: dict[int, list[float]] = {i: [] for i in kernels}
    for p in range(warmup + iters):
        time.sleep(STEP_PAUSE_S)
        spent = dict.fromkeys(kernels, 0.0)
        for layer in range(layers):
            for i, made in kernels.items():
                j = layer - first[i]
                if j < 0 or j >= len(made) or i in fused:
                    continue
                t0 = time.perf_counter()
                made[j].fn()
                spent[i] += (time.perf_counter() - t0) * 1e6
        if p < warmup:
            continue
        for i, made in kernels.items():
            # per call, this GEMM's share of what the call computes (w2: of moe_w13's fused call)
            # i in fused only when w13 is in kernels: an int there
            whole = spent[w13] / len(kernels[w13]) if i in fused else spent[i] / len(made)  # type: ignore[index]
            times[i].append(whole * made[0].share)
    return times


def step_groups(shapes: list[dict]) -> dict[tuple, list[int]]:
    """Shape indices by the decode step they belong to: (batch, dtype, tensor-parallel size)."""
    out: dict[tuple, list[int]] = {}
    for i, x in enumerate(shapes):
        out.setdefault((x.get("batch"), x["dtype"], x.get("tp")), []).append(i)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", required=True, help="JSON list of shapes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--warm-l2", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--cpus", help="CPU host: the cores one engine rank is bound to, e.g. '0' or '0-3' "
                    "(VLLM_CPU_OMP_THREADS_BIND's first rank): the probe runs on them with that many threads")
    args = ap.parse_args(argv)
    if args.cpus and args.device == "cpu":
        cores = parse_cpulist(args.cpus)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    shapes = json.load(open(args.shapes))
    device = torch.device(args.device)
    flush = Flusher(device) if device.type == "cuda" and not args.warm_l2 else None
    rows: list[dict] = []
    for i, shape in enumerate(shapes, 1):
        rows.append(measure(shape, device, args.iters, args.warmup, flush, graph=not args.no_graph))
        write_probe_output(args.out, "gemm", rows)
        r = rows[-1]
        log.info(f"[{i}/{len(shapes)}] {shape['op']} b={shape.get('batch')} {shape['dtype']} {shape['m']}x{shape['n']}x{shape['k']}: "
                 + (f"{r['time_us']:.2f} us, {r['tflops']:.1f} TFLOP/s, {r['gbps']:.0f} GB/s" if r["status"] == "ok"
                    else f"skipped ({r['skip_reason'][:80]})"))
    if device.type == "cpu":
        # a second column, for the step model: the step's GEMMs in its order, after a pause
        for (batch, dtype, _), idx in step_groups(shapes).items():
            timed = time_cpu_step_order([shapes[i] for i in idx], dtype, args.iters, args.warmup)
            for j, per_pass in timed.items():
                row = rows[idx[j]]
                if row.get("status") == "ok" and per_pass:
                    row.update({f"step_order_{k2}": v for k2, v in median_spread(per_pass).items()})
                    row["method"] += (f"; step_order: the step's GEMMs layer by layer (each layer its own "
                                      f"weights), each pass after a {STEP_PAUSE_S * 1e3:g} ms pause, per call")
            write_probe_output(args.out, "gemm", rows)
            log.info("step order b=%s %s: done", batch, dtype)
    return 0


if __name__ == "__main__":
    run_program(main)
