"""Where a gloo all-reduce's time goes on a 2-core host: the engine's threads against 03's two ranks alone.

On vLLM CPU's AVX2 path (_C_AVX2: no shared-memory all-reduce) every all-reduce is a gloo call through the
functional collectives: the worker's main thread queues it to gloo's work thread (pt_gloo_runloop), which
moves the bytes through gloo's TCP loop thread (gloo_tcp_loop), and the main thread sleeps in wait_tensor.
Each hand-over needs a core. 03 times these calls with the two ranks alone on the host; in the engine the
same threads share the cores with the engine core and the API server.

    python benchmarks/gloo_contention.py [PARAMS] [--levels 1 4] [--out FILE]

Runs, one after the other in this process: the reference (two torchrun gloo ranks, the calls back to back at
the step's all-reduce size, as 03 issues them), twice: each rank on its own core with gloo's threads, as 03
and vLLM's workers are placed, and unpinned; then the real server of PARAMS (default: the embedded default)
at each level. Prints per step and per all-reduce call each thread kind's CPU time and run-queue wait
(/proc/<pid>/task/<tid>/schedstat: time ready to run while another thread held the core), the reference's
calls split by the scheduler tick (probes.timing.tick_stalls), and the engine's figures over the reference's.
gloo's TCP loop using far more CPU a call than its calls need is its spin on the pair's lock, which ends at
a tick or another wake-up on its core (docs/methods.md). Forces the AVX2 path (decodescope.core.cpupath)
unless the host has it already.
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
from decodescope.probes.timing import median_spread, scheduler_tick_us, tick_stalls
n_calls, numel, pinned = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "pinned"
if pinned:  # before the group: gloo's threads start on the rank's core, as in 03's ranks and vLLM's workers
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(numel, dtype=torch.bfloat16)
for _ in range(50):
    t = fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
dist.barrier()
a, t0, each = thread_schedstat(os.getpid()), time.perf_counter(), []
for _ in range(n_calls):
    t1 = time.perf_counter()
    t = fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
    each.append((time.perf_counter() - t1) * 1e6)
wall_us, b = (time.perf_counter() - t0) * 1e6, thread_schedstat(os.getpid())
split = tick_stalls(each, scheduler_tick_us())
threads = {}
for tid, (name, cpu, wait) in b.items():
    if tid in a:
        c, w = threads.get(name, (0.0, 0.0))
        threads[name] = (c + (cpu - a[tid][1]) / 1e3 / n_calls, w + (wait - a[tid][2]) / 1e3 / n_calls)
# one write, so the two ranks' lines do not interleave on the shared pipe
sys.stdout.write("RESULT " + json.dumps({"rank": rank, "call_us": wall_us / n_calls, "threads": threads,
                                         "median_us": median_spread(each)["time_us"], **split}) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def reference(numel: int, pinned: bool, n_calls: int = 500) -> dict:
    """Two gloo ranks alone on the host, the calls back to back, each rank on a core of its own (pinned) or
    not: per call, its mean and median time, the share a tick stalled and each thread kind's CPU and run-queue
    wait, the mean over the ranks."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RANK)
    try:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            f.name, str(n_calls), str(numel), "pinned" if pinned else "free"],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           check=True)
    finally:
        os.unlink(f.name)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    threads = collections.defaultdict(lambda: [0.0, 0.0])
    for rk in ranks:
        for name, (cpu, wait) in rk["threads"].items():
            threads[name][0] += cpu / len(ranks)
            threads[name][1] += wait / len(ranks)
    mean = lambda key: sum(rk[key] for rk in ranks) / len(ranks) if all(key in rk for rk in ranks) else None  # noqa: E731
    return {"call_us": mean("call_us"), "median_us": mean("median_us"), "stalled_share": mean("stalled_share"),
            "unstalled_us": mean("unstalled_us"), "pinned": pinned, "threads": dict(threads)}


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


def reference_lines(ref: dict, numel: int) -> list[str]:
    where = "each rank and its gloo threads on a core of its own" if ref["pinned"] else "unpinned"
    lines = [f"reference: two gloo ranks alone ({where}), functional all_reduce + wait_tensor back to back, "
             f"{numel} bf16 elements: {ref['call_us']:.0f} us a call (mean), median {ref['median_us']:.0f} us"]
    if ref["stalled_share"] is not None:
        lines.append(f"  {ref['stalled_share']:.0%} of the calls a scheduler tick stalled; the others' median "
                     f"{ref['unstalled_us']:.0f} us")
    lines += [f"  {name:16s} CPU {cpu:7.0f} us  run-queue wait {wait:7.0f} us  a call (mean over ranks)"
              for name, (cpu, wait) in sorted(ref["threads"].items()) if cpu > 1 or wait > 1]
    return lines


def report(refs: list[dict], levels: list[dict], calls_per_step: int, numel: int) -> str:
    lines = [line for ref in refs for line in reference_lines(ref, numel)]
    ref = refs[0]
    ref_wait = sum(ref["threads"].get(n, (0.0, 0.0))[1] for n in GLOO_THREADS)
    ref_loop_cpu = ref["threads"].get("gloo_tcp_loop", (0.0, 0.0))[0]
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
        loop_cpu = sum(c for (role, name), (c, _) in lv["threads"].items() if role == "worker" and name == "gloo_tcp_loop")
        lines.append(f"  gloo's TCP loop's CPU per call: engine {loop_cpu / calls_per_step:.0f} us, reference "
                     f"{ref_loop_cpu:.0f} us")
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
    refs = [reference(numel, pinned=True), reference(numel, pinned=False)]
    with tempfile.TemporaryDirectory() as tmp:
        server = start_for_params(params, Path(tmp) / "run")
        try:
            levels = [engine_level(server, params, lv) for lv in args.levels]
        finally:
            server.stop()
    text = report(refs, levels, calls, numel)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
