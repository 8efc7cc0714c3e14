"""A gloo all-reduce call, as 03 times it, alone and beside processes that spin on sched_yield.

On vLLM CPU's AVX2 path the engine core spins on sched_yield while the workers sleep in gloo's waits (vLLM's
shm message-queue reader: `shm_broadcast.SpinCondition`, a second after each read), and the profile's calls
cost more than 03's two ranks alone measure (the all-reduce row 1.86-2.18 on the forced-AVX2 embedded
default, 2026-12-03). This times the same call (functional collectives, the step's 512 B, each rank on a
core of its own, waits included) three ways in one process tree, one after the other: alone; beside one
spinner on rank 0's core; beside a spinner on every rank's core. Prints the mean per call over `--calls`
calls after a warm-up, and each setting's ratio to alone, for `--rounds` rounds.

    python benchmarks/gloo_beside_spinners.py [--rounds 3] [--calls 2000] [--bytes 512]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

RANK = """
import os, sys, time, torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
dist.init_process_group("gloo")
rank = dist.get_rank()
os.sched_setaffinity(0, {rank})
torch.set_num_threads(1)
x = torch.ones(int(sys.argv[1]) // 2, dtype=torch.bfloat16)
for _ in range(200):
    fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))
dist.barrier()
n = int(sys.argv[2])
t0 = time.perf_counter()
for _ in range(n):
    fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))
if rank == 0:
    print(f"{(time.perf_counter() - t0) / n * 1e6:.1f}")
dist.destroy_process_group()
"""
SPIN = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
while True:
    os.sched_yield()
"""


def time_calls(script: Path, msg_bytes: int, calls: int, spin_cores: tuple[int, ...]) -> float:
    """us per call on rank 0, with a sched_yield spinner on each of spin_cores for the whole run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in spin_cores]
    try:
        time.sleep(0.5)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script), str(msg_bytes), str(calls)], capture_output=True, text=True, env=env,
                              timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the two ranks exited {proc.returncode} beside spinners on {spin_cores}:\n"
                             f"{proc.stderr[-2000:]}")
        return float(proc.stdout.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--bytes", type=int, default=512, dest="msg_bytes")
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (one a rank)")
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"gloo_beside_spinners_{os.getpid()}.py"
    script.write_text(RANK)
    settings = (("alone", ()), ("one spinner, rank 0's core", (0,)), ("a spinner on each rank's core", (0, 1)))
    try:
        print(f"# gloo all-reduce of {a.msg_bytes} B through the functional collectives, waits included, "
              f"{a.calls} calls back to back, us per call on rank 0")
        for r in range(1, a.rounds + 1):
            alone = None
            for name, cores in settings:
                us = time_calls(script, a.msg_bytes, a.calls, cores)
                alone = alone or us
                print(f"round {r}  {name:32s} {us:8.1f} us  x {us / alone:.2f} of alone")
    finally:
        script.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
