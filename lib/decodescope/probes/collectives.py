"""Collective probe, a torchrun entry point (NCCL on GPUs, gloo on CPUs):

    torchrun --nproc-per-node N -m decodescope.probes.collectives --plan plan.json --out-dir DIR

(a) burst: a decode step's all-reduce schedule (count x size per batch) back to back, eager and, on
    GPUs, replayed as one CUDA graph: time per step;
(b) sweep: all-reduce and all-to-all from min to max bytes by x2, in-place and out-of-place, with
    nccl-tests' algbw = bytes / time and busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (all-to-all);
(c) all-to-all at expert-parallel dispatch/combine sizes per tokens per GPU.

Method: ranks aligned with a barrier before each measured call; `warmup` untimed then `iters` timed
calls, median and p10/p90 reported; GPU calls timed with CUDA events, CPU calls with perf_counter.
Each rank writes collectives_rank<r>.json (atomically, after each part), with the backend, NCCL
version and NCCL_* settings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from decodescope.io import write_json_atomic
from decodescope.probes.timing import median_spread

BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn, iters: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(iters):
            dist.barrier()
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
        return out

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


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


def burst(plan: dict, device, dtype, timer: Timer, world: int, rank: int) -> list[dict]:
    rows = []
    for step in plan.get("burst", []):
        bufs = [torch.ones(_elems(c["msg_bytes"], dtype), device=device, dtype=dtype)
                for c in step["calls"] for _ in range(c["count"])]

        def run_step():
            for b in bufs:
                dist.all_reduce(b)
        total_bytes = sum(b.numel() * b.element_size() for b in bufs)
        modes = [("eager", run_step)]
        if device.type == "cuda":
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run_step()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run_step()
                modes.append(("cuda_graph", g.replay))
            except Exception as e:  # recorded: some NCCL/driver combinations refuse capture
                rows.append({"part": "burst", "op": "all_reduce", "batch": step["batch"], "mode": "cuda_graph",
                             "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}", "rank": rank})
        for mode, fn in modes:
            st = median_spread(timer.run(fn, plan["iters"], plan["warmup"]))
            rows.append({"part": "burst", "op": "all_reduce", "batch": step["batch"], "mode": mode,
                         "calls": len(bufs), "bytes": total_bytes, "msg_bytes": step["calls"][0]["msg_bytes"],
                         "world_size": world, "rank": rank, "status": "ok", **st,
                         "per_call_us": st["time_us"] / max(len(bufs), 1)})
    return rows


def sweep(plan: dict, device, dtype, timer: Timer, world: int, rank: int) -> list[dict]:
    rows = []
    sw = plan.get("sweep") or {}
    size = sw.get("min_bytes", 1024)
    sizes = []
    while size <= sw.get("max_bytes", 1 << 20):
        sizes.append(size)
        size *= 2
    for op in sw.get("ops", ["all_reduce"]):
        for nbytes in sizes:
            t = torch.ones(_elems(nbytes, dtype, world), device=device, dtype=dtype)
            real = t.numel() * t.element_size()
            # all-to-all cannot alias its buffers: out-of-place only
            for inplace in ((True, False) if op == "all_reduce" else (False,)):
                make = all_reduce_fn if op == "all_reduce" else all_to_all_fn
                row = {"part": "sweep", "op": op, "bytes": real, "inplace": inplace, "world_size": world,
                       "rank": rank, "mode": "eager"}
                try:
                    st = median_spread(timer.run(make(t, inplace), plan["iters"], plan["warmup"]))
                except (RuntimeError, NotImplementedError) as e:
                    rows.append({**row, "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
                    break
                algbw = real / (st["time_us"] * 1e-6) / 1e9
                rows.append({**row, "status": "ok", **st, "algbw_gbps": algbw,
                             "busbw_gbps": algbw * BUSBW_FACTOR[op](world)})
    return rows


def all_to_all_tokens(plan: dict, device, dtype, timer: Timer, world: int, rank: int) -> list[dict]:
    rows = []
    for item in plan.get("all_to_all", []):
        nbytes = max(int(item["dispatch_bytes"] * world / max(world - 1, 1)), 1) if world > 1 else int(item["dispatch_bytes"]) or 1
        t = torch.ones(_elems(nbytes, dtype, world), device=device, dtype=dtype)
        out = torch.empty_like(t)
        row = {"part": "all_to_all", "op": "all_to_all", "tokens_per_gpu": item["tokens_per_gpu"],
               "bytes": t.numel() * t.element_size(), "world_size": world, "rank": rank, "mode": "eager"}
        try:
            st = median_spread(timer.run(lambda: dist.all_to_all_single(out, t), plan["iters"], plan["warmup"]))
        except (RuntimeError, NotImplementedError) as e:
            rows.append({**row, "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({**row, "status": "ok", **st})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="decode-step collective probe (run under torchrun)")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    plan = json.load(open(args.plan))
    use_cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.get("dtype", "bf16")]
    timer = Timer(device)
    meta = {"rank": rank, "world_size": world, "backend": dist.get_backend(), "device": str(device),
            "torch": torch.__version__,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "iters": plan["iters"], "warmup": plan["warmup"], "dtype": plan.get("dtype", "bf16")}
    out = os.path.join(args.out_dir, f"collectives_rank{rank}.json")
    rows: list[dict] = []
    for part in (burst, sweep, all_to_all_tokens):
        rows += part(plan, device, dtype, timer, world, rank)
        write_json_atomic(out, {"meta": meta, "rows": rows})
        if rank == 0:
            print(f"{part.__name__}: {len(rows)} rows", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
