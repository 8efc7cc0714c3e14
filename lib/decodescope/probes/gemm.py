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
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from decodescope.dtypes import INT4_GROUP_SIZE, bytes_per_element
from decodescope.io import write_json_atomic
from decodescope.probes.timing import HostRef, host_issue_us, median_spread

FP8_MIN_DIM = 16
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HOST_ISSUE_CALLS = 32  # calls issued back to back per repetition of the host-cost timing
# int4 weights' group size in the W4A16 probe: the one whose scales dtypes.bytes_per_element counts
MARLIN_GROUP = INT4_GROUP_SIZE


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
    memory while the activations stay in L2. None for dtypes without a plain torch matmul."""
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


def _vllm_cpu_linear(m: int, n: int, k: int, dt: torch.dtype) -> Optional[Callable]:
    """The linear vLLM's CPU build runs for an unquantized [n, k] weight (its own dispatch: oneDNN with a
    prepacked weight, or sgl's packed kernel for small weights), or None when vllm is not importable."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except Exception:
        return None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k, dtype=dt), requires_grad=False)
    a = torch.randn(m, k, dtype=dt)
    try:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        layer.cpu_linear(a, layer.weight, None)
    except Exception:
        return None
    return lambda: layer.cpu_linear(a, layer.weight, None)


def _vllm_cpu_fused_moe(shape: dict, dt: torch.dtype) -> Optional[tuple[Callable, float]]:
    """vLLM's CPU MoE kernel (`cpu_fused_moe`: w13, the activation and w2 of every hit expert in one
    call) for a moe_w13/moe_w2 shape: (callable, this GEMM's share of the call's FLOPs), or None when
    vllm is not importable. The decode step's tokens (`batch`) each pick top_k of the `groups` hit
    experts, top_k = m x groups / batch (the shape's tokens per expert times the experts hit)."""
    try:
        from vllm import _custom_ops as ops
        if not hasattr(torch.ops._C, "cpu_fused_moe"):
            return None
    except Exception:
        return None
    groups, batch = int(shape.get("groups", 1)), int(shape.get("batch") or shape["m"])
    top_k = max(1, min(groups, round(shape["m"] * groups / batch)))
    if shape["op"] == "moe_w13":
        hidden, inter = shape["k"], shape["n"] // 2
    else:
        hidden, inter = shape["n"], shape["k"]
    # as the engine picks its experts class (vllm fused_moe/experts/cpu_moe.py): AMX for bf16 activations
    # only (its AMX kernel aborts the process on fp32: "Unsupported data type for TileGemm122"), else vec
    amx = torch.cpu._is_amx_tile_supported() and dt == torch.bfloat16
    isa = "amx" if amx else "vec"
    if amx:  # the process's permission for AMX tile state (Linux arch_prctl), which the engine's processes
        torch._C._cpu._init_amx()  # have; without it the first AMX instruction raises SIGILL
    try:
        w13 = ops.cpu_prepack_moe_weight(torch.randn(groups, 2 * inter, hidden, dtype=dt), isa)
        w2 = ops.cpu_prepack_moe_weight(torch.randn(groups, hidden, inter, dtype=dt), isa)
        x, out = torch.randn(batch, hidden, dtype=dt), torch.empty(batch, hidden, dtype=dt)
        ids = torch.tensor([[(t * top_k + j) % groups for j in range(top_k)] for t in range(batch)], dtype=torch.int32)
        weights = torch.full((batch, top_k), 1.0 / top_k, dtype=torch.float32)
        fn = lambda: ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", isa)  # noqa: E731
        fn()
    except Exception:  # a dtype or shape this build's kernel refuses: the torch.bmm stand-in is timed
        return None
    # FLOPs: w13 2 x batch x top_k x 2 inter x hidden, w2 half of that
    return fn, (2.0 / 3.0 if shape["op"] == "moe_w13" else 1.0 / 3.0)


@dataclass
class EngineKernel:
    """A GEMM as vLLM's CPU build runs it: the callable, this GEMM's share of what one call computes,
    the bytes it moves and how it was made (for the method column)."""
    fn: Callable[[], None]
    share: float
    nbytes: float
    kernel: str


def cpu_engine_kernel(shape: dict, dtype: str) -> Optional[EngineKernel]:
    """The kernel vLLM's CPU build runs for this GEMM shape (its linear dispatch, or its fused MoE for
    moe_w13/moe_w2 with several experts), or None when vllm is not importable or refuses the shape:
    then torch's stand-in (make_gemm) is timed."""
    dt = TORCH_DTYPES.get(dtype)
    if dt is None:
        return None
    elt = torch.tensor([], dtype=dt).element_size()
    m, n, k, groups = shape["m"], shape["n"], shape["k"], int(shape.get("groups", 1))
    if groups == 1:
        fn = _vllm_cpu_linear(m, n, k, dt)
        return None if fn is None else EngineKernel(
            fn, 1.0, float((m * k + n * k + m * n) * elt),
            "vLLM's CPU linear (dispatch_cpu_unquantized_gemm: oneDNN or packed weights). ")
    if shape["op"] not in ("moe_w13", "moe_w2"):
        return None
    moe = _vllm_cpu_fused_moe(shape, dt)
    if moe is None:
        return None
    fn, share = moe
    return EngineKernel(fn, share, float(groups * n * k * elt),
                        f"vLLM's cpu_fused_moe (w13, activation and w2 in one call) timed whole; this GEMM's "
                        f"{100 * share:.0f}% of its FLOPs. ")


def make_gemm(m: int, n: int, k: int, dtype: str, device: torch.device,
              groups: int = 1) -> tuple[Optional[Callable], str, float]:
    """(callable, skip reason, bytes moved). The callable computes A[m,k] @ W[n,k]^T, or with groups > 1
    one batched product over that many experts' weights (torch.bmm, one kernel), as fused MoE runs."""
    if dtype in ("bf16", "fp16", "fp32"):
        dt = TORCH_DTYPES[dtype]
        elt = torch.tensor([], dtype=dt).element_size()
        if groups > 1:
            a = torch.randn(groups, m, k, device=device, dtype=dt)
            w = torch.randn(groups, n, k, device=device, dtype=dt)
            out = torch.empty(groups, m, n, device=device, dtype=dt)
            return (lambda: torch.bmm(a, w.transpose(1, 2), out=out)), "", \
                float(groups * (m * k + n * k + m * n) * elt)
        a = torch.randn(m, k, device=device, dtype=dt)
        w = torch.randn(n, k, device=device, dtype=dt)
        out = torch.empty(m, n, device=device, dtype=dt)
        return (lambda: torch.mm(a, w.t(), out=out)), "", float((m * k + n * k + m * n) * elt)
    if groups > 1:
        return None, f"grouped (MoE) {dtype} GEMMs are not probed: only bf16/fp16/fp32 through torch.bmm", 0.0
    if dtype == "fp8":
        if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
            return None, "fp8 needs a CUDA GPU with float8 (Hopper or newer)", 0.0
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9:
            return None, f"fp8 tensor cores need compute capability 9.0+, this GPU is {major}.x", 0.0
        if n % FP8_MIN_DIM or k % FP8_MIN_DIM:
            return None, f"torch._scaled_mm needs N and K multiples of {FP8_MIN_DIM} (N={n}, K={k})", 0.0
        mp = max(m, FP8_MIN_DIM) if m % FP8_MIN_DIM else m  # rows padded as serving kernels pad them
        a = torch.randn(mp, k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return (lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), "", \
            float(mp * k + n * k + mp * n * 2)
    if dtype == "int4":
        return _marlin_w4a16(m, n, k, device)
    return None, f"unknown dtype {dtype!r}; valid: bf16, fp16, fp32, fp8, int4", 0.0


def accepted_kwargs(fn: Callable, given: dict) -> dict:
    """The arguments of `given` that fn takes, by name."""
    names = inspect.signature(fn).parameters
    return {name: value for name, value in given.items() if name in names}


def _marlin_w4a16(m: int, n: int, k: int, device: torch.device):
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils_test as mt  # noqa: F401
        from vllm import _custom_ops as ops  # noqa: F401
    except Exception as e:  # vllm missing or built without Marlin: recorded, not fatal
        return None, f"W4A16 needs vLLM's Marlin kernels: vllm not importable here ({type(e).__name__}: {e})", 0.0
    if device.type != "cuda":
        return None, "Marlin W4A16 runs on CUDA GPUs only", 0.0
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types

        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        _, q_w, s, g_idx, sort_idx, _ = marlin_quantize(w, scalar_types.uint4b8, MARLIN_GROUP, False)
        ws = torch.zeros(n // 64 * 16, dtype=torch.int, device=device)
        # by name: the positional order changed between vLLM releases (b_bias, a_scales were added)
        given = {"a": a, "c": None, "b_q_weight": q_w, "b_bias": None, "b_scales": s, "a_scales": None,
                 "global_scale": None, "b_zeros": None, "g_idx": g_idx, "perm": sort_idx, "workspace": ws,
                 "b_q_type": scalar_types.uint4b8, "size_m": m, "size_n": n, "size_k": k, "is_k_full": True}
        kwargs = accepted_kwargs(ops.gptq_marlin_gemm, given)
        fn = lambda: ops.gptq_marlin_gemm(**kwargs)  # noqa: E731
        fn()
        return fn, "", float(m * k * 2 + n * k * bytes_per_element("int4", MARLIN_GROUP) + m * n * 2)
    except Exception as e:
        return None, f"Marlin W4A16 call failed on this vLLM build: {type(e).__name__}: {e}", 0.0


def measure(shape: dict, device: torch.device, iters: int, warmup: int, flush: Optional[Flusher],
            graph: bool) -> dict:
    m, n, k, dtype = shape["m"], shape["n"], shape["k"], shape["dtype"]
    row = {**shape, "device": str(device), "iters": iters, "warmup": warmup,
           "l2": "flushed" if flush else "warm", "status": "ok", "skip_reason": ""}
    groups = int(shape.get("groups", 1))
    engine = cpu_engine_kernel(shape, dtype) if device.type == "cpu" else None
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
            whole = spent[w13] / len(kernels[w13]) if i in fused else spent[i] / len(made)
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
        from decodescope.procs import parse_cpulist

        cores = parse_cpulist(args.cpus)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    shapes = json.load(open(args.shapes))
    device = torch.device(args.device)
    flush = Flusher(device) if device.type == "cuda" and not args.warm_l2 else None
    rows: list[dict] = []
    for i, shape in enumerate(shapes, 1):
        rows.append(measure(shape, device, args.iters, args.warmup, flush, graph=not args.no_graph))
        write_json_atomic(args.out, rows)
        r = rows[-1]
        print(f"[{i}/{len(shapes)}] {shape['op']} b={shape.get('batch')} {shape['dtype']} {shape['m']}x{shape['n']}x{shape['k']}: "
              + (f"{r['time_us']:.2f} us, {r['tflops']:.1f} TFLOP/s, {r['gbps']:.0f} GB/s" if r["status"] == "ok"
                 else f"skipped ({r['skip_reason'][:80]})"), file=sys.stderr, flush=True)
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
            write_json_atomic(args.out, rows)
            print(f"step order b={batch} {dtype}: done", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
