"""Collective probe, a torchrun entry point (NCCL on GPUs, gloo on CPUs):

    torchrun --nproc-per-node N -m decodescope.probes.collectives --plan plan.json --out-dir DIR

(a) burst: a decode step's all-reduce schedule (count x size per batch), back to back.
    It runs eager and, on GPUs, replayed as one CUDA graph; it reports time per step.
(b) sweep: all-reduce and all-to-all from min to max bytes by x2, in-place and out-of-place.
    It reports nccl-tests' algbw = bytes / time and busbw.
    busbw = algbw x 2(n-1)/n for all-reduce, and algbw x (n-1)/n for all-to-all.
(c) all-to-all at expert-parallel dispatch/combine sizes per tokens per GPU.

Each all-reduce is measured through every communicator this host offers.
So the micro-benchmark can be set against the one the engine uses.
torch.distributed (gloo / NCCL) is always measured.
vLLM's own shared-memory all-reduce on CPU (`torch.ops._C.shm_allreduce`) is measured when vllm is importable.
It is the path vLLM's CPU build takes for tensor parallelism.
Rows carry `communicator`.

Timing (`timing` column):

- `back_to_back` issues `calls` all-reduces one after the other between one timer pair, and divides.
  `calls` is up to 50, fewer for slow ones, so that one repetition lasts ~20 ms.
  A decode step issues them this way.
  nccl-tests and vLLM's benchmark_device_communicators.py time them this way too.
- `cuda_graph` (GPUs): the same calls, replayed as one CUDA graph.
- `host_issue` (GPUs): the host's own time per call of issuing the same calls, the GPU drained first.
  It is the pace of an eager step whose host cannot keep its GPU busy.
- `host_after_gemm` (GPUs): the same, with each call issued right after a GEMM that writes its input.
  That GEMM's time alone is subtracted.
  What remains is what a step's host pays for the call between its other launches.
- `late_rank` (CPUs): the last rank arrives LATE_US after the others at every call.
  The op's own duration is read with torch.profiler, as a profiled engine step records it.
  That duration is the collective's own cost.
  A profiled step's per-call least time over the ranks measures the same cost.
  The rest of a step's all-reduce time is waiting for the last rank.
- `isolated`: a barrier aligns the ranks before each single call.
  It adds the barrier's wake-up and launch cost to every call.
  So it overstates what a step pays for small messages.

`warmup` untimed repetitions run, then `iters` timed ones; the median and p10/p90 are reported.
GPUs are timed with CUDA events, CPUs with perf_counter.
On a CPU the back-to-back rows also carry the scheduler tick, the share of calls a tick stalled and the
median of the rest (`tick_us`, `stalled_share`, `unstalled_us`: timing.tick_stalls).
Each rank writes collectives_rank<r>.json, atomically, after each part.
The file holds the backend, NCCL version, NCCL_* settings and the communicators (and why any was skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import logging
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from decodescope.probes.gemm_kernels import TORCH_DTYPES
from decodescope.probes.timing import (HOST_AFTER_GEMM, HOST_ISSUE, HostRef, host_issue_after_us, host_issue_us,
                                       median_spread, scheduler_tick_us, tick_stalls)
from decodescope.core.logsetup import run_program
from decodescope.core.probefile import write_probe_output
from decodescope.probes.communicators import Communicator, communicators
from decodescope.exec.procs import parse_cpulist

log = logging.getLogger(__name__)

BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn, iters: int, warmup: int, ref: Optional[HostRef] = None,
            ref_after: Optional[HostRef] = None) -> list[float]:
        """Per-iteration microseconds of fn, ranks aligned before each; with `ref`, the host's speed
        sampled before each (the device drained after it), with `ref_after` after each."""
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(iters):
            if ref is not None:
                ref()
                self.sync()
            dist.barrier()
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) * 1e3)
                if ref_after is not None:
                    ref_after()
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
        return out

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


BACK_TO_BACK_CALLS = 50
BACK_TO_BACK_TARGET_US = 20_000.0


def back_to_back(timer: "Timer", fn, calls: int, iters: int, warmup: int) -> list[float]:
    """Per-call microseconds of `calls` calls issued back to back: on a GPU each repetition's mean; on a CPU
    each call timed by itself, as a profile times each op: a call the scheduler stalled is one sample."""
    if timer.cuda:
        return [t / calls for t in timer.run(lambda: [fn() for _ in range(calls)], iters, warmup)]
    each: list[float] = []

    def many():
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            each.append((time.perf_counter() - t0) * 1e6)
    timer.run(many, iters, warmup)
    return each[-calls * iters:]  # the warm-up repetitions' calls left out


LATE_US = 100.0  # how late the last rank arrives at each call in the `late_rank` timing
# What the last rank reads between two calls when the plan does not say (plans written before it did)
DEFAULT_BETWEEN_CALLS_BYTES = 2 << 20


def late_rank(fn, calls: int, iters: int, warmup: int, world: int, rank: int,
              between_calls_bytes: int = DEFAULT_BETWEEN_CALLS_BYTES) -> list[float]:
    """Per-call microseconds on the last rank when it arrives LATE_US after the others at every call
    (it spins first), read as torch.profiler reads an engine's op: the op's own duration, without the
    Python call around it (which a profiled step books to the host's time, not the collective). That
    is the collective's own cost when no one waits for it, as a profiled step's per-call least time
    over the ranks is. The other ranks spend the interval waiting inside each call. Every rank
    returns the last rank's figures: every timed call's op, the repetitions pooled as back_to_back's on a CPU
    (a stalled call is one sample of calls x iters, not a share of one repetition's median of 4 to 50 calls)."""
    last = rank == world - 1
    out: list[float] = []
    for i in range(warmup + iters):
        dist.barrier()
        if not last:
            for _ in range(calls):
                fn()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                t_spin = time.perf_counter() + LATE_US * 1e-6
                _read_between_calls(between_calls_bytes)  # a step reads a layer's weights between its all-reduces
                while time.perf_counter() < t_spin:
                    pass
                fn()
        if i >= warmup:
            out += _top_level_op_us(prof.events())
    box = [out]
    dist.broadcast_object_list(box, src=world - 1)
    return box[0]


_SCRATCH: list = []


def _read_between_calls(nbytes: int) -> None:
    """Read `nbytes` (one byte per 64-byte line) without a recorded op, as a step's GEMMs read the weights
    of a layer between two all-reduces (the plan's between_calls_bytes: weight bytes per rank per step over
    all-reduces per step). A fixed 2 MiB written here, this core's whole L2, made the late rank's figure
    jump between ~2 and ~8 us per size (tight within a size) on an AVX-512 host where the profiled engine,
    reading 0.3 MiB of weights per interval, paid 2.3 us; the read of the step's own bytes is what the
    engine's call meets."""
    if nbytes <= 0:
        return
    if not _SCRATCH or len(_SCRATCH[0]) < nbytes:
        _SCRATCH[:] = [bytearray(b"\x01" * nbytes)]  # written once, so its pages are real, not the zero page
    _SCRATCH[0][:nbytes:64]  # a copy of every 64th byte: each line read once


def _top_level_op_us(events) -> list[float]:
    """The durations of the calls of the op that took the most time among the top-level ops (one per
    call: the collective itself)."""
    by: dict[str, list[float]] = {}
    for e in events:
        if e.cpu_parent is None:
            by.setdefault(e.name, []).append(float(e.time_range.elapsed_us()))
    return max(by.values(), key=sum)


def graph_of(fn, calls: int):
    """`calls` calls captured into one CUDA graph (warmed up on a side stream first); its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def _elems(nbytes: int, dtype: torch.dtype, world: int = 1) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    n = max(1, nbytes // elt)
    return max(world, n - n % world)


def all_reduce_fn(t: torch.Tensor, inplace: bool):
    if inplace:
        return lambda: dist.all_reduce(t)
    out = torch.empty_like(t)

    def oop():  # out-of-place: the result lands in a second buffer, as nccl-tests' out-of-place
        out.copy_(t)
        dist.all_reduce(out)
    return oop


def all_to_all_fn(t: torch.Tensor, inplace: bool):
    out = torch.empty_like(t)
    return lambda: dist.all_to_all_single(out, t)


def burst(plan: dict, device, dtype, timer: Timer, world: int, rank: int,
          comms: list[Communicator]) -> list[dict]:
    rows = []
    for comm in comms:
        for step in plan.get("burst", []):
            bufs = [torch.ones(_elems(c["msg_bytes"], dtype), device=device, dtype=dtype)
                    for c in step["calls"] for _ in range(c["count"])]
            base = {"part": "burst", "op": "all_reduce", "communicator": comm.name, "batch": step["batch"],
                    "rank": rank, "world_size": world}
            if not bufs:  # world size 1: the step issues no all-reduce, there is no burst to replay
                rows.append({**base, "mode": "eager", "status": "skipped",
                             "skip_reason": f"the step issues no all-reduce at world size {world}"})
                continue

            def run_step():
                for b in bufs:
                    comm.all_reduce(b)
            total_bytes = sum(b.numel() * b.element_size() for b in bufs)
            modes = [("eager", run_step)]
            if comm.graphable:
                try:
                    modes.append(("cuda_graph", graph_of(run_step, 1).replay))
                except Exception as e:  # recorded: some NCCL/driver combinations refuse capture
                    rows.append({**base, "mode": "cuda_graph", "status": "skipped",
                                 "skip_reason": f"{type(e).__name__}: {e}"})
            for mode, fn in modes:
                st = median_spread(timer.run(fn, plan["iters"], plan["warmup"]))
                rows.append({**base, "mode": mode, "calls": len(bufs), "bytes": total_bytes,
                             "msg_bytes": step["calls"][0]["msg_bytes"], "status": "ok", **st,
                             "per_call_us": st["time_us"] / max(len(bufs), 1)})
    return rows


WRITER_K = 32  # the inner size of the GEMM that writes an all-reduce's input in the host_after_gemm timing
# past a decode step's messages (batch x hidden, ~1 MB at 64 x 7168 bf16), where its weight (K x the
# message) would cost GPU memory for a figure no step model reads: the curve extrapolates there
HOST_AFTER_GEMM_MAX_BYTES = 8 << 20


def gemm_writing(t: "torch.Tensor") -> Callable[[], "torch.Tensor"]:
    """A GEMM whose output is the all-reduce's tensor, as a decode step's o_proj or down projection
    writes it: the host launch the all-reduce follows in a step (its inner size barely moves the
    host's cost, so it is kept small: WRITER_K)."""
    a = torch.randn(1, WRITER_K, device=t.device, dtype=t.dtype)
    w = torch.randn(t.numel(), WRITER_K, device=t.device, dtype=t.dtype)
    out = t.view(1, -1)
    return lambda: torch.mm(a, w.t(), out=out)


def sweep_sizes(plan: dict) -> list[int]:
    sw = plan.get("sweep") or {}
    size, sizes = sw.get("min_bytes", 1024), []
    while size <= sw.get("max_bytes", 1 << 20):
        sizes.append(size)
        size *= 2
    # the step's own message sizes too: the fit is read there
    sizes += [c["msg_bytes"] for step in plan.get("burst", []) for c in step["calls"]]
    return sorted(set(sizes))


def _bw(row: dict, st: dict, op: str, nbytes: int, world: int) -> dict:
    algbw = nbytes / (st["time_us"] * 1e-6) / 1e9
    return {**row, "status": "ok", **st, "algbw_gbps": algbw, "busbw_gbps": algbw * BUSBW_FACTOR[op](world)}


def sweep(plan: dict, device, dtype, timer: Timer, world: int, rank: int, comms: list[Communicator]) -> list[dict]:
    """all-reduce through every communicator, in place, back to back (and as a CUDA graph on GPUs) and
    isolated; torch's out-of-place all-reduce and all-to-all isolated, as nccl-tests."""
    rows = []
    max_calls = int(plan.get("back_to_back_calls", BACK_TO_BACK_CALLS))
    ref = HostRef(device, timer.sync) if timer.cuda else None  # the host's speed beside its issue costs
    # a CPU's calls back to back, each timed by itself, are split into those a scheduler tick stalled and the rest
    tick_us = None if timer.cuda else scheduler_tick_us()
    for nbytes in sweep_sizes(plan):
        t = torch.ones(_elems(nbytes, dtype, world), device=device, dtype=dtype)
        real = t.numel() * t.element_size()
        for comm in comms:
            base = {"part": "sweep", "op": "all_reduce", "communicator": comm.name, "bytes": real,
                    "inplace": True, "world_size": world, "rank": rank}
            fn = (lambda c=comm: c.all_reduce(t))
            try:
                isolated = median_spread(timer.run(fn, plan["iters"], plan["warmup"]))
            except (RuntimeError, NotImplementedError) as e:
                rows.append({**base, "timing": "isolated", "mode": "eager", "status": "skipped",
                             "skip_reason": f"{type(e).__name__}: {e}"[:300]})
                continue
            rows.append(_bw({**base, "timing": "isolated", "mode": "eager"}, isolated, "all_reduce", real, world))
            # enough calls back to back to swamp the timer, few enough that slow ones (gloo, large
            # messages) keep the sweep short: ~20 ms of calls per repetition, 4 to max_calls
            agreed = [int(max(4, min(max_calls, BACK_TO_BACK_TARGET_US // max(isolated["time_us"], 1.0))))]
            dist.broadcast_object_list(agreed, src=0)  # every rank must issue the same number of calls
            calls = agreed[0]
            timings = [("back_to_back", "eager", lambda: back_to_back(timer, fn, calls, plan["iters"], plan["warmup"]))]
            if not comm.graphable and world > 1:
                timings.append(("late_rank", "eager",
                                lambda: late_rank(fn, calls, plan["iters"], plan["warmup"], world, rank,
                                                  int(plan.get("between_calls_bytes", DEFAULT_BETWEEN_CALLS_BYTES)))))
            if comm.graphable:
                # the host's own cost per call (GPU drained, ranks aligned first): what an eager step
                # pays per collective when the host, not the GPU, sets its pace
                timings.append((HOST_ISSUE, "eager", lambda: host_issue_us(
                    fn, calls, plan["iters"], lambda: (timer.sync(), dist.barrier()), ref)))
                if real <= HOST_AFTER_GEMM_MAX_BYTES:
                    writer = gemm_writing(t)
                    timings.append((HOST_AFTER_GEMM, "eager", lambda: host_issue_after_us(
                        fn, writer, calls, plan["iters"], lambda: (timer.sync(), dist.barrier()), ref)))

                def graphed(fn=fn, calls=calls):
                    g = graph_of(fn, calls)
                    return [x / calls for x in timer.run(g.replay, plan["iters"], plan["warmup"])]
                timings.append(("cuda_graph", "cuda_graph", graphed))
            for timing, mode, measure in timings:
                row = {**base, "timing": timing, "mode": mode, "calls": calls}
                try:
                    samples = measure()
                    st = median_spread(samples)
                    if timing == "back_to_back":
                        st.update(tick_stalls(samples, tick_us))
                    host_ref_us = ref.take_median_us() if ref is not None else None
                    # a host's issue time is no transfer: no bandwidth from it
                    rows.append({**row, "status": "ok", **st, "host_ref_us": host_ref_us}
                                if timing in (HOST_ISSUE, HOST_AFTER_GEMM) else _bw(row, st, "all_reduce", real, world))
                except (RuntimeError, NotImplementedError) as e:
                    if ref is not None:
                        ref.take_median_us()  # this timing's samples, not the next one's
                    rows.append({**row, "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
        torch_comm = f"torch_{dist.get_backend()}"
        for op, make in (("all_reduce", lambda: all_reduce_fn(t, False)), ("all_to_all", lambda: all_to_all_fn(t, False))):
            row = {"part": "sweep", "op": op, "communicator": torch_comm, "bytes": real, "inplace": False,
                   "world_size": world, "rank": rank, "mode": "eager", "timing": "isolated"}
            try:
                rows.append(_bw(row, median_spread(timer.run(make(), plan["iters"], plan["warmup"])), op, real, world))
            except (RuntimeError, NotImplementedError) as e:
                rows.append({**row, "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
    return rows


def all_to_all_tokens(plan: dict, device, dtype, timer: Timer, world: int, rank: int) -> list[dict]:
    rows = []
    for item in plan.get("all_to_all", []):
        nbytes = max(int(item["dispatch_bytes"] * world / max(world - 1, 1)), 1) if world > 1 else int(item["dispatch_bytes"]) or 1
        t = torch.ones(_elems(nbytes, dtype, world), device=device, dtype=dtype)
        out = torch.empty_like(t)
        row = {"part": "all_to_all", "op": "all_to_all", "communicator": f"torch_{dist.get_backend()}",
               "timing": "isolated", "tokens_per_gpu": item["tokens_per_gpu"],
               "bytes": t.numel() * t.element_size(), "world_size": world, "rank": rank, "mode": "eager"}
        try:
            st = median_spread(timer.run(lambda: dist.all_to_all_single(out, t), plan["iters"], plan["warmup"]))
        except (RuntimeError, NotImplementedError) as e:
            rows.append({**row, "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({**row, "status": "ok", **st})
    return rows


def init_ranks(device_kind: str, rank_cpus: Optional[list[str]] = None) -> tuple[bool, "torch.device", int, int]:
    """This torchrun rank's process group (NCCL on GPUs, gloo on CPUs) and device; on a CPU bound first (gloo's
    threads too) to its entry of `rank_cpus`, the plan's: where the engine binds each local rank."""
    use_cuda = device_kind == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    elif rank_cpus and local < len(rank_cpus):
        try:
            os.sched_setaffinity(0, parse_cpulist(rank_cpus[local]))
        except (OSError, ValueError) as e:
            raise SystemExit(f"local rank {local}: cannot bind to cores {rank_cpus[local]!r} (the plan's rank_cpus, "
                             f"from server.env VLLM_CPU_OMP_THREADS_BIND): {e}") from e
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    return use_cuda, device, dist.get_rank(), dist.get_world_size()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="decode-step collective probe (run under torchrun)")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    plan = json.load(open(args.plan))
    use_cuda, device, rank, world = init_ranks(args.device, plan.get("rank_cpus"))
    dtype = TORCH_DTYPES[plan.get("dtype", "bf16")]
    timer = Timer(device)
    meta = {"rank": rank, "world_size": world, "backend": dist.get_backend(), "device": str(device),
            "torch": torch.__version__,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "iters": plan["iters"], "warmup": plan["warmup"], "dtype": plan.get("dtype", "bf16"),
            "cpus": None if use_cuda else sorted(os.sched_getaffinity(0)),
            "scheduler_tick_us": scheduler_tick_us()}
    comms, skipped = communicators(device, world, rank)
    meta.update(communicators=[c.name for c in comms], communicators_skipped=skipped,
                back_to_back_calls=int(plan.get("back_to_back_calls", BACK_TO_BACK_CALLS)))
    out = os.path.join(args.out_dir, f"collectives_rank{rank}.json")
    rows: list[dict] = []
    try:
        for part in (burst, sweep):
            rows += part(plan, device, dtype, timer, world, rank, comms)
            write_probe_output(out, "collectives", rows, meta)
            if rank == 0:
                log.info("%s: %d rows", part.__name__, len(rows))
        rows += all_to_all_tokens(plan, device, dtype, timer, world, rank)
        write_probe_output(out, "collectives", rows, meta)
    finally:
        for c in comms:
            if c.cleanup:
                c.cleanup()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_program(main)
