"""Where an eager decode step's time goes on GPUs (a torchrun diagnostic):

    torchrun --nproc-per-node N benchmarks/eager_step_anatomy.py PLAN [--batch B] [--iters 20]
             [--pin | --pin-after] [--core-stride 2]

For one batch of the step plan, variants in turn (gemm_only, comm_only, then full and gemm_only
alternated three times): the host's time to issue the step (loop end, before any sync) and the step's
time (after the sync), median over iters, rank by rank, and how many issue calls took over 1 ms (the
host blocked). --pin binds each rank's main thread to one core (on the GPU's NUMA node when sysfs says
which) before NCCL starts its threads, --pin-after once they run; at the end, each rank's busiest
threads by CPU time (a spinning NCCL or watchdog thread would show there). Prints one JSON line per
rank and variant.

What it showed on 2x H200 (Kimi-K2.5 TP=8 shapes, batch 2): an eager step ends with its slower rank's
host (the faster rank's host finishes 28 ms in, both steps end at 46 ms); the same GEMM-only loop on a
pinned core read 21.8 ms in one block and 33.5 ms in the next; NCCL's threads take no CPU to speak of.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from decodescope.probes.collectives import init_ranks, torch_communicator  # noqa: E402
from decodescope.exec.procs import parse_cpulist  # noqa: E402
from decodescope.probes.step import build_step, variant_ops  # noqa: E402


def gpu_cores(device) -> list[int]:
    try:
        bus = torch.cuda.get_device_properties(device).pci_bus_id.lower()
        cpulist = Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text().strip()
    except Exception:
        return sorted(os.sched_getaffinity(0))
    return sorted(parse_cpulist(cpulist) & os.sched_getaffinity(0)) or sorted(os.sched_getaffinity(0))


def timed_issue(fns, iters: int, warmup: int):
    """(host issue us, step us, issue calls over 1 ms) per iteration."""
    out = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slow = 0
        for fn in fns:
            a = time.perf_counter()
            fn()
            if time.perf_counter() - a > 1e-3:
                slow += 1
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            out.append(((t1 - t0) * 1e6, (t2 - t0) * 1e6, slow))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pin", action="store_true", help="pin the main thread before NCCL starts its threads")
    ap.add_argument("--pin-after", action="store_true", help="pin the main thread once NCCL's threads run")
    ap.add_argument("--core-stride", type=int, default=2)
    args = ap.parse_args()
    plan = json.load(open(args.plan))
    use_cuda, device, rank, world = init_ranks("cuda")
    cores = gpu_cores(device)
    core = cores[(rank * args.core_stride) % len(cores)]
    if args.pin:
        os.sched_setaffinity(0, {core})
    step = next(s for s in plan["steps"] if s["batch"] == args.batch)
    items, skipped, reused = build_step(step["program"], plan["dtype"], device, world, 0.6 * torch.cuda.get_device_properties(device).total_memory,
                                        step["batch"], torch_communicator(device))
    warm = torch.ones(8, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    if args.pin_after:
        os.sched_setaffinity(0, {core})
    for variant in ("gemm_only", "comm_only", "full", "gemm_only", "full", "gemm_only", "full"):
        fns = variant_ops(items, variant)
        res = timed_issue(fns, args.iters, args.warmup)
        host = [r[0] for r in res]
        wall = [r[1] for r in res]
        print(json.dumps({"rank": rank, "pin": "before" if args.pin else "after" if args.pin_after else "no", "affinity": sorted(os.sched_getaffinity(0))[:4], "batch": args.batch,
                          "variant": variant, "ops": len(fns), "host_ms": round(statistics.median(host) / 1e3, 2),
                          "step_ms": round(statistics.median(wall) / 1e3, 2),
                          "step_p10_p90_ms": [round(sorted(wall)[len(wall) // 10] / 1e3, 2), round(sorted(wall)[-1 - len(wall) // 10] / 1e3, 2)],
                          "slow_calls": statistics.median([r[2] for r in res])}), flush=True)
    threads = []
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            threads.append((round(cpu_s, 1), comm, int(fields[36])))
        except (OSError, ValueError, IndexError):
            pass
    print(json.dumps({"rank": rank, "threads_cpu_s_name_lastcpu": sorted(threads, reverse=True)[:6]}), flush=True)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
