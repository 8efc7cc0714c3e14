"""Step replay probe, a torchrun entry point (NCCL on GPUs, gloo on CPUs):

    torchrun --nproc-per-node N -m decodescope.probes.step --plan step_plan.json --out-dir DIR

It replays one decode step's skeleton on the real ranks, in model order, at the model's sharded shapes.
Per layer: the attention GEMMs, an all-reduce, the MLP or MoE GEMMs, an all-reduce.
The MoE GEMMs are the router, the grouped experts and the shared experts.
The embedding all-reduce comes first; lm_head and the logits all-gather come last.
The program comes from decodescope.model.arch.step_program; the analysis side writes it into the plan.
Every GEMM has its own weights, as every layer of a model does.
So nothing is served from L2 that a real step would read from memory.
No attention kernel, norms or sampling: this is the step without the framework.
It is the ground truth the step model (decodescope.verdict.stepmodel) is checked against on GPUs where
vLLM cannot run.

The collectives go through the communicator the engine uses, where this probe can build it (plan
`communicator: engine`).
On CPUs with vLLM's CPU build, that is its shared-memory all-reduce and all-gather.
Those are what vLLM CPU calls at tensor-parallel > 1.
Otherwise it is torch.distributed (gloo on CPUs, NCCL on GPUs).
Each row names the one that ran, and the reason when the engine's could not be built.

Per batch, three variants (`full`, `gemm_only`, `comm_only`) run eager.
On GPUs they are also captured as one CUDA graph, as vLLM replays decode steps.
A barrier aligns the ranks before each timed step.
`warmup` untimed steps run, then `iters` timed ones; the median and p10/p90 are reported.
Each rank writes step_rank<r>.json atomically after each batch.

`--then` starts another job's arguments (its own --plan, --out-dir, --variants, --profile-steps, --skew-us),
run after the one before in the same ranks, process group and communicator: 03 runs its replay and each
skew calibration setting in one launch, so torchrun, torch and vLLM's kernels start once, not once a job
(~17 s a launch on the 2-core AVX2 host). The jobs must ask for the same device, rank cores and
communicator.

`--skew-us D --skew-rank R` makes rank R late by a known D us before every collective (timed and profiled
steps alike; both recorded in the meta), to calibrate the critical path's arrival skew against
(decodescope.micro.skewcal). On CPUs the rank spins (busy, as a slow rank is) inside a
record_function("decodescope::injected_skew") range. On GPUs it queues torch.cuda._sleep for D us on its
stream (captured into the graph too; in a replayed graph the trace shows the sleep kernel, not the range);
that path has not been run yet.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import shutil
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from decodescope.probes.collectives import Timer, _elems, graph_of, init_ranks
from decodescope.probes.communicators import Communicator, torch_communicator, vllm_shm_or_why
from decodescope.probes.gemm_kernels import TORCH_DTYPES, cpu_engine_kernel, make_gemm
from decodescope.probes.timing import HostRef, median_spread
from decodescope.core.logsetup import run_program
from decodescope.core.probefile import write_probe_output
from decodescope.engines import engine

log = logging.getLogger(__name__)

VARIANTS = ("full", "gemm_only", "comm_only")


def weight_budget_bytes(plan: dict, device) -> float:
    if plan.get("weight_budget_bytes"):
        return float(plan["weight_budget_bytes"])
    if device.type == "cuda":
        return 0.6 * torch.cuda.get_device_properties(device).total_memory
    return 4e9


def step_communicator(wanted: str, device, world: int, rank: int) -> tuple[Communicator, str]:
    """The communicator the replay's collectives go through, and why the engine's was not used ('' when
    it was, or was not asked for). `wanted`: 'torch' or 'engine' (vLLM's shm on CPUs when it can be built;
    on GPUs torch's NCCL, as vLLM's own communicators need vLLM)."""
    if wanted not in ("torch", "engine"):
        raise ValueError(f"step plan: communicator {wanted!r}: expected 'torch' or 'engine'")
    if wanted == "engine" and device.type == "cpu":
        shm, why = vllm_shm_or_why(world, rank)
        return (shm, "") if shm is not None else (torch_communicator(device), f"vllm_shm: {why}")
    return torch_communicator(device), ("" if wanted == "torch" or device.type == "cpu" else
                                        "vLLM's GPU communicators need vLLM: replayed through torch's NCCL")


def build_step(program: list[dict], dtype: str, device, world: int, budget_bytes: float,
               batch: Optional[int] = None, comm: Optional[Communicator] = None):
    """Callables for the step's GEMMs and collectives, in order. Every GEMM gets its own weights until
    budget_bytes are allocated; past it, GEMMs of one shape reuse earlier ones in turn (a layer's weights
    are far larger than L2, so a reused weight is still read from memory). Returns the callables, the
    GEMMs that cannot run here (with why) and how many GEMMs reuse weights. On a CPU with vllm
    importable the MoE experts run as the engine runs them, one cpu_fused_moe call per layer (at moe_w13;
    moe_w2 is inside it), as the GEMM probe times them."""
    tdtype = TORCH_DTYPES[dtype]
    comm = comm or torch_communicator(device)
    items, skipped = [], {}
    made: dict[tuple, list] = {}
    allocated, reused = 0.0, 0
    fused_moe_used = False
    for op in program:
        if op["kind"] == "gemm":
            key = (op["m"], op["n"], op["k"], op.get("groups", 1))
            if fused_moe_used and op["op"] == "moe_w2":
                continue  # inside the layer's cpu_fused_moe call
            pool = made.setdefault(key, [])
            if pool and allocated >= budget_bytes:
                fn = pool[reused % len(pool)]
                reused += 1
            else:
                engine = (cpu_engine_kernel({**op, "batch": batch}, dtype)
                          if device.type == "cpu" and batch is not None and op["op"] != "moe_w2" else None)
                if engine is not None:
                    fn, nbytes = engine.fn, engine.nbytes
                    fused_moe_used = fused_moe_used or op["op"] == "moe_w13"
                else:
                    fn, reason, nbytes = make_gemm(op["m"], op["n"], op["k"], dtype, device, op.get("groups", 1))
                    if fn is None:
                        skipped[op["op"]] = reason
                        continue
                pool.append(fn)
                allocated += nbytes
            items.append(("gemm", fn))
        elif op["kind"] == "all_reduce":
            t = torch.ones(_elems(op["msg_bytes"], tdtype), device=device, dtype=tdtype)
            items.append(("comm", lambda t=t, f=comm.all_reduce: f(t)))
        elif op["kind"] == "all_gather":
            part = torch.ones(_elems(op["msg_bytes"], tdtype), device=device, dtype=tdtype)
            out = torch.empty(part.numel() * world, device=device, dtype=tdtype)
            items.append(("comm", lambda o=out, p=part, f=comm.all_gather: f(o, p)))
    return items, skipped, reused


def variant_ops(items, variant: str) -> list:
    """The callables of one variant (full, gemm_only, comm_only), in the step's order."""
    keep = {"full": ("gemm", "comm"), "gemm_only": ("gemm",), "comm_only": ("comm",)}[variant]
    return [fn for kind, fn in items if kind in keep]


def variant_fn(items, variant: str):
    fns = variant_ops(items, variant)

    def step():
        for fn in fns:
            fn()
    return step, len(fns)


def time_variant(items, variant: str, batch: int, plan: dict, timer: Timer, use_cuda: bool, device, rank: int,
                 world: int, comm_name: str, extra: dict) -> list[dict]:
    """One variant's rows, eager and (on GPUs) as one CUDA graph. Its own function so that the step
    callables and the graph (which hold the batch's weights and the graph's memory pool) are freed on
    return, before the next batch allocates its own."""
    fn, n_ops = variant_fn(items, variant)
    rows, modes = [], [("eager", fn)]
    if use_cuda:
        try:
            modes.append(("cuda_graph", graph_of(fn, 1).replay))
        except Exception as e:  # recorded, as the collectives probe does
            rows.append({"batch": batch, "variant": variant, "mode": "cuda_graph", "rank": rank,
                         "status": "skipped", "skip_reason": f"{type(e).__name__}: {e}"[:300]})
    for mode, f in modes:
        # an eager step is paced by its hosts: their speed is sampled before and after every step, as
        # 02 and 03 sample it beside their host costs (timing.HostRef)
        ref = HostRef(device, timer.sync) if use_cuda and mode == "eager" else None
        after = HostRef(device, timer.sync) if ref else None
        times_us = timer.run(f, plan["iters"], plan["warmup"], ref, after)
        rows.append({"batch": batch, "variant": variant, "mode": mode, "rank": rank, "world_size": world,
                     "ops": n_ops, "status": "ok", "communicator": comm_name, **median_spread(times_us),
                     # raw, one per step: stepmodel.replay_table makes the step's host speed of them
                     "iter_us": times_us, "host_ref_iter_us": ref.samples_us if ref else None,
                     "host_ref_after_iter_us": after.samples_us if after else None, **extra})
    return rows


def profile_steps(items, batch: int, steps: int, use_cuda: bool, rank: int, out_dir: str) -> str:
    """`steps` full steps under torch.profiler, each inside a range named as vLLM names a decode step
    (execute_context_0(0)_generation_<b>(<b>)), replayed as one CUDA graph on GPUs; returns the gzipped
    trace's path (step_replay_b<b>_rank<r>.pt.trace.json.gz)."""
    fn, _ = variant_fn(items, "full")
    run = graph_of(fn, 1).replay if use_cuda else fn
    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(engine().step_label(0, 0, batch, batch)):
                run()
            if use_cuda:
                torch.cuda.synchronize()
    raw = os.path.join(out_dir, f"step_replay_b{batch}_rank{rank}.pt.trace.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(raw)
    return raw + ".gz"


SKEW_RANGE = "decodescope::injected_skew"


def with_skew(items, skew_us: float, device) -> list:
    """`items` with a D us delay before each collective (a CPU busy wait, or a GPU sleep kernel)."""
    if skew_us <= 0:
        return items
    if device.type == "cuda":
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(1_000_000)
        t1.record()
        t1.synchronize()
        cycles = int(skew_us * 1_000_000 / (t0.elapsed_time(t1) * 1e3))

        def delay():
            with record_function(SKEW_RANGE):
                torch.cuda._sleep(cycles)
    else:
        def delay():
            with record_function(SKEW_RANGE):
                end = time.perf_counter_ns() + int(skew_us * 1e3)
                while time.perf_counter_ns() < end:
                    pass
    return [(kind, (lambda f=fn: (delay(), f())) if kind == "comm" else fn) for kind, fn in items]


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="decode-step replay probe (run under torchrun); `--then` starts "
                                             "another job's arguments, run after it in the same ranks")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also capture this many full steps per batch under torch.profiler (CUDA graph on GPUs), "
                         "one trace per rank in --out-dir, each step marked as vLLM marks its steps")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--skew-us", type=float, default=0.0,
                    help="make --skew-rank late by this many us before every collective (a busy wait on CPUs)")
    ap.add_argument("--skew-rank", type=int, default=1, help="the rank --skew-us delays (default 1)")
    return ap


THEN = "--then"
# what every job of one launch shares (its ranks, their cores, their communicator), so must ask alike
SHARED_ARGS = ("device",)
SHARED_PLAN_KEYS = ("rank_cpus", "communicator")


def split_jobs(argv: list[str]) -> list[list[str]]:
    """The command line cut at each --then: one job's arguments each."""
    jobs: list[list[str]] = [[]]
    for a in argv:
        if a == THEN:
            jobs.append([])
        else:
            jobs[-1].append(a)
    return jobs


def parse_jobs(argv: list[str]) -> list[tuple[argparse.Namespace, dict]]:
    """Each job's arguments and plan, checked before any rank starts work: delays of 0 us or more, and the
    same device, rank cores and communicator asked for by every job."""
    ap = arg_parser()
    jobs = []
    for i, job_argv in enumerate(split_jobs(argv)):
        args = ap.parse_args(job_argv)
        if args.skew_us < 0:
            ap.error(f"job {i + 1}: --skew-us {args.skew_us:g}: give a delay of 0 us or more")
        with open(args.plan) as f:
            jobs.append((args, json.load(f)))
    first_args, first_plan = jobs[0]
    for i, (args, plan) in enumerate(jobs[1:], start=2):
        for k in SHARED_ARGS:
            if getattr(args, k) != getattr(first_args, k):
                ap.error(f"job {i}: --{k} {getattr(args, k)} differs from job 1's {getattr(first_args, k)}; "
                         "the jobs of one launch share their ranks")
        for k in SHARED_PLAN_KEYS:
            if plan.get(k) != first_plan.get(k):
                ap.error(f"job {i}: plan {args.plan}: {k} {plan.get(k)!r} differs from job 1's "
                         f"{first_plan.get(k)!r}; the jobs of one launch share their ranks")
    return jobs


def run_job(args: argparse.Namespace, plan: dict, comm: Communicator, comm_note: str, use_cuda: bool, device,
            rank: int, world: int) -> None:
    """One job: its plan's batches timed (its --variants) and profiled (its --profile-steps), rank
    --skew-rank late by --skew-us; step_rank<r>.json in its --out-dir rewritten after each batch."""
    timer = Timer(device)
    meta = {"rank": rank, "world_size": world, "backend": dist.get_backend(), "device": str(device),
            "torch": torch.__version__, "dtype": plan["dtype"], "iters": plan["iters"], "warmup": plan["warmup"],
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            "gpu": torch.cuda.get_device_name(device) if use_cuda else None,
            "cpus": None if use_cuda else sorted(os.sched_getaffinity(0)),
            "skew_us": args.skew_us, "skew_rank": args.skew_rank,
            "communicator": comm.name, "communicator_note": comm_note}
    # made here, on the host the ranks run on: over ssh only the launcher's side has it
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"step_rank{rank}.json")
    rows: list[dict] = []
    for step in plan["steps"]:
        items, skipped, reused = build_step(step["program"], plan["dtype"], device, world,
                                            weight_budget_bytes(plan, device), step.get("batch"), comm)
        items = with_skew(items, args.skew_us if rank == args.skew_rank else 0.0, device)
        for variant in [v for v in args.variants.split(",") if v]:
            rows += time_variant(items, variant, step["batch"], plan, timer, use_cuda, device, rank, world,
                                 comm.name, {"gemms_skipped": skipped, "gemms_reusing_weights": reused})
        if args.profile_steps:
            profile_steps(items, step["batch"], args.profile_steps, use_cuda, rank, args.out_dir)
        del items
        if use_cuda:
            torch.cuda.empty_cache()
        write_probe_output(out, "step", rows, meta)
        if rank == 0:
            log.info("%s batch %s: done", args.out_dir, step["batch"])
    dist.barrier()  # the next job's first timed step starts on every rank together


def main(argv: Optional[list[str]] = None) -> int:
    jobs = parse_jobs(sys.argv[1:] if argv is None else argv)
    first_args, first_plan = jobs[0]
    use_cuda, device, rank, world = init_ranks(first_args.device, first_plan.get("rank_cpus"))
    for args, _ in jobs:
        if args.skew_us and not 0 <= args.skew_rank < world:
            raise SystemExit(f"--skew-rank {args.skew_rank}: expected a rank from 0 to {world - 1}")
    comm, comm_note = step_communicator(first_plan.get("communicator", "torch"), device, world, rank)
    for args, plan in jobs:
        run_job(args, plan, comm, comm_note, use_cuda, device, rank, world)
    if comm.cleanup:
        comm.cleanup()
    dist.barrier()
    if use_cuda:
        # Seen on 2x H200 (torch 2.11, NCCL 2.28): after NCCL calls captured in CUDA graphs, tearing the
        # process group down hung until torchrun's timeout. Every result is on disk by now: leave at once.
        torch.cuda.synchronize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_program(main)
