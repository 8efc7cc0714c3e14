"""Is this host's CPU steady enough to price an eager (host-bound) decode step? A fixed pure-Python
workload, in chunks of ~10 ms, on each given core at once (one process pinned per core) for --duration-s:
per core the chunk times' p10 / p50 / p90 / max and p90 / p10, the ratio against the core's own fast
decile (1.0 = steady), and the hypervisor's steal time over the same window (/proc/stat).

    python benchmarks/host_speed.py [CORE ...] [--duration-s 20]

Why: an eager step on GPUs is paced by its ranks' hosts issuing ~1,600 launches (a Kimi-K2.5 TP=8
step); the step ends with its slowest rank, so a host whose cores change speed by 2x from one second to
the next changes the step by as much, whatever was measured a minute before. Seen on a 2x H200 VM:
p90 / p10 1.6-1.8 on four cores, no steal time reported (benchmarks/results/h200x2_host_speed.txt).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

CHUNK_ITERS = 200_000


def chunk_times_ms(core: int, duration_s: float, q) -> None:
    os.sched_setaffinity(0, {core})
    out = []
    t_end = time.perf_counter() + duration_s
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        s = 0
        for i in range(CHUNK_ITERS):
            s += i * i
        out.append((time.perf_counter() - t0) * 1e3)
    q.put((core, out))


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) jiffies from /proc/stat's cpu line."""
    f = open("/proc/stat").readline().split()
    return int(f[8]), sum(int(x) for x in f[1:9])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cores", nargs="*", type=int)
    ap.add_argument("--duration-s", type=float, default=20.0)
    args = ap.parse_args()
    cores = args.cores or sorted(os.sched_getaffinity(0))[:2]
    q = mp.Queue()
    s0 = cpu_ticks()
    procs = [mp.Process(target=chunk_times_ms, args=(c, args.duration_s, q)) for c in cores]
    for p in procs:
        p.start()
    results = sorted(q.get() for _ in procs)
    for p in procs:
        p.join()
    s1 = cpu_ticks()
    print(f"{len(cores)} cores at once for {args.duration_s:.0f} s, {CHUNK_ITERS:,} loop iterations per chunk; "
          f"steal time {100 * (s1[0] - s0[0]) / max(1, s1[1] - s0[1]):.2f}% of all CPU time")
    print(f"{'core':>4} {'chunks':>6} {'p10 ms':>7} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} {'p90/p10':>8}")
    for core, out in results:
        out.sort()
        n = len(out)
        p10, p50, p90 = out[n // 10], out[n // 2], out[-1 - n // 10]
        print(f"{core:>4} {n:>6} {p10:>7.1f} {p50:>7.1f} {p90:>7.1f} {out[-1]:>7.1f} {p90 / p10:>8.2f}")


if __name__ == "__main__":
    main()
