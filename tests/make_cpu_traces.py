"""A real two-rank torch.profiler capture on the CPU (gloo), shaped like vLLM's: each step is a
record_function range named as vLLM names them, holding matmuls and all-reduces.

Run: torchrun --nproc-per-node 2 tests/make_cpu_traces.py OUT_DIR STEPS ALLREDUCES_PER_STEP
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function


def main(out_dir: str, steps: int, per_step: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(4, 256)
    w = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            with record_function("execute_context_0(0)_generation_4(4)"):
                for _ in range(per_step):
                    y = x @ w
                    dist.all_reduce(y)
            # the gap between steps, as the scheduler would leave
            torch.randn(64, 64).sum()
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, f"testhost_rank{rank}.{os.getpid()}.pt.trace.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
