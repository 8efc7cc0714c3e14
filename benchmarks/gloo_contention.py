"""Where a gloo all-reduce's time goes on a 2-core host: the engine's threads against 03's two ranks alone.

On vLLM CPU's AVX2 path (_C_AVX2: no shared-memory all-reduce) every all-reduce is a gloo call through the
functional collectives: the worker's main thread queues it to gloo's work thread (pt_gloo_runloop), which
moves the bytes through gloo's TCP loop thread (gloo_tcp_loop), and the main thread sleeps in wait_tensor.
Each hand-over needs a core. 03 times these calls with the two ranks alone on the host; in the engine the
same threads share the cores with the engine core and the API server.

    python benchmarks/gloo_contention.py [PARAMS] [--levels 1 4] [--out FILE]

Runs, one after the other in this process: the reference (two torchrun gloo ranks, the calls back to back at
the step's all-reduce size, as 03 issues them) and the real server of PARAMS (default: the embedded default)
at each level. Prints per step and per all-reduce call each thread kind's CPU time and run-queue wait
(/proc/<pid>/task/<tid>/schedstat: time ready to run while another thread held the core), and the engine's
figures over the reference's. Forces the AVX2 path (decodescope.core.cpupath) unless the host has it already.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from decodescope.core.cpupath import apply_cpu_path_here

apply_cpu_path_here("avx2")  # before anything loads vLLM's kernels: the server and the ranks inherit it

from decodescope.exec import procs  # noqa: E402
from decodescope.exec.runserver import start_for_params  # noqa: E402
from decodescope.model import arch as archmod  # noqa: E402
from decodescope.schema.params import load_params  # noqa: E402
from decodescope.serving.client import run_async  # noqa: E402
from decodescope.serving.sweep import SweepConfig, build_prompts, run_level  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # a call's hand-overs beside the main thread

RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from decodescope.exec.procs import thread_schedstat
dist.init_process_group("gloo")
rank, n_calls, numel = dist.get_rank(), int(sys.argv[1]), int(sys.argv[2])
t = torch.ones(numel, dtype=torch.bfloat16)
for _ in range(50):
    t = fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
dist.barrier()
a, t0 = thread_schedstat(os.getpid()), time.perf_counter()
for _ in range(n_calls):
    t = fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
wall_us, b = (time.perf_counter() - t0) * 1e6, thread_schedstat(os.getpid())
threads = {}
for tid, (name, cpu, wait) in b.items():
    if tid in a:
        c, w = threads.get(name, (0.0, 0.0))
        threads[name] = (c + (cpu - a[tid][1]) / 1e3 / n_calls, w + (wait - a[tid][2]) / 1e3 / n_calls)
# one write, so the two ranks' lines do not interleave on the shared pipe
sys.stdout.write("RESULT " + json.dumps({"rank": rank, "call_us": wall_us / n_calls, "threads": threads}) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def reference(numel: int, n_calls: int = 500) -> dict:
    """Two gloo ranks alone on the host, the calls back to back: per call, its time and each thread kind's
    CPU and run-queue wait, the mean over the ranks."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RANK)
    try:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            f.name, str(n_calls), str(numel)], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    finally:
        os.unlink(f.name)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    threads = collections.defaultdict(lambda: [0.0, 0.0])
    for rk in ranks:
        for name, (cpu, wait) in rk["threads"].items():
            threads[name][0] += cpu / len(ranks)
            threads[name][1] += wait / len(ranks)
    return {"call_us": sum(rk["call_us"] for rk in ranks) / len(ranks), "threads": dict(threads)}


def task_times(pids) -> dict:
    """(role, name) -> [CPU ns, run-queue wait ns] summed over the server's threads of that kind."""
    out: dict = collections.defaultdict(lambda: [0, 0])
    for pid, role in procs.process_roles(pids).items():
        for name, cpu, wait in procs.thread_schedstat(pid).values():
            out[(role, name)][0] += cpu
            out[(role, name)][1] += wait
    return out


def engine_level(server, params, level: int, requests: int = 16, output_tokens: int = 32) -> dict:
    """One level's requests on the running server: per step (output tokens / level), its wall time and each
    thread kind's CPU and run-queue wait per process of its role."""
    cfg = SweepConfig(base_url=server.base_url, model=params.model.name, endpoint="completions", levels=[level],
                      input_tokens=32, output_tokens=output_tokens, requests_per_level=requests, warmup_requests=0,
                      timeout_s=300, seed=7, api_key=params.server.api_key)
    prompts = run_async(build_prompts(cfg, requests + level))
    run_async(run_level(cfg, level, prompts, n_requests=level, warmup=0))  # a full batch first
    pids = server.process_tree()
    counts = collections.Counter(procs.process_roles(pids).values())
    before, t0 = task_times(pids), time.monotonic()
    run_async(run_level(cfg, level, prompts, n_requests=requests, warmup=0))
    wall_s, after = time.monotonic() - t0, task_times(pids)
    steps = requests * output_tokens / level
    threads = {k: ((after[k][0] - before[k][0]) / 1e3 / steps / counts[k[0]],
                   (after[k][1] - before[k][1]) / 1e3 / steps / counts[k[0]]) for k in after if k in before}
    return {"level": level, "step_us": wall_s * 1e6 / steps, "threads": threads}


def report(ref: dict, levels: list[dict], calls_per_step: int, numel: int) -> str:
    lines = [f"reference: two gloo ranks alone, functional all_reduce + wait_tensor back to back, {numel} bf16 "
             f"elements: {ref['call_us']:.0f} us a call"]
    lines += [f"  {name:16s} CPU {cpu:7.0f} us  run-queue wait {wait:7.0f} us  a call (mean over ranks)"
              for name, (cpu, wait) in sorted(ref["threads"].items()) if cpu > 1 or wait > 1]
    ref_wait = sum(ref["threads"].get(n, (0.0, 0.0))[1] for n in GLOO_THREADS)
    for lv in levels:
        lines.append(f"\nengine at concurrency {lv['level']}: {lv['step_us']:.0f} us a step, {calls_per_step} "
                     f"all-reduces a step")
        for (role, name), (cpu, wait) in sorted(lv["threads"].items()):
            if cpu > 20 or wait > 20:
                lines.append(f"  {role:12s} {name:16s} CPU {cpu:7.0f} us  run-queue wait {wait:7.0f} us  a step "
                             "(per process)")
        gloo_wait = sum(w for (role, name), (_, w) in lv["threads"].items() if role == "worker" and name in GLOO_THREADS)
        per_call = gloo_wait / calls_per_step
        lines.append(f"  gloo's threads' run-queue wait per call: engine {per_call:.0f} us, reference {ref_wait:.0f} us"
                     + (f", engine/reference {per_call / ref_wait:.2f}" if ref_wait else ""))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("params", nargs="?", default=str(REPO / "params/default.yaml"))
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", help="also write the figures to this file")
    args = ap.parse_args()
    params = load_params(args.params)
    arch = archmod.normalize_config(params.model_config_dict())
    tp = params.server.tensor_parallel
    calls = archmod.expected_all_reduces_per_step(arch, tp)
    numel = arch.hidden_size  # one token's hidden state: the step's all-reduce at batch 1
    ref = reference(numel)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_for_params(params, Path(tmp) / "run")
        try:
            levels = [engine_level(server, params, lv) for lv in args.levels]
        finally:
            server.stop()
    text = report(ref, levels, calls, numel)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
