"""Phase 2 on the analysis side: build the probes' inputs from the architecture, run the probe
programs (plain python / torchrun child processes), and turn their per-rank files into tables."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.model import arch as archmod
from decodescope.exec.hardware import resolve_peaks
from decodescope.exec.host import host_for, node_hosts
from decodescope.core.io import write_json_atomic, write_parquet_atomic
from decodescope.probes.timing import HOST_AFTER_GEMM, HOST_ISSUE
from decodescope.schema.records import LATENCY_FIT_COLUMNS, CollectivesFit, LatencyFit, write_record
from decodescope.schema.records_host import Peaks
from decodescope.schema.records_probe import read_probe_output, read_probe_rows
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.rundata import COLLECTIVES, GEMM, RunDir
from decodescope.exec.server import log_tail


class ProbeError(RuntimeError):
    pass


def gemm_plan(params) -> list[dict]:
    """The step's GEMMs at the server's tensor-parallel size in every dtype, then the shapes at each
    other size of whatif.tensor_parallel in the first dtype (the tensor-parallel what-if)."""
    arch = archmod.normalize_config(params.model_config_dict())
    mb = params.microbench
    rows = []
    sizes = [(params.server.tensor_parallel, mb.dtypes)] + [(t, mb.dtypes[:1]) for t in params.projected_tensor_parallel()]
    for tp, dtypes in sizes:
        for b in mb.batches:
            for s in archmod.gemm_shapes(arch, tp, b, mb.expert_parallel, mb.moe_skew):
                for dt in dtypes:
                    rows.append({"op": s.op, "layer_kind": s.layer_kind, "batch": b, "m": s.m, "n": s.n, "k": s.k,
                                 "count": s.count, "groups": s.groups, "dtype": dt, "tp": tp})
    return rows


def collectives_plan(params, dtype: str = "bf16") -> dict:
    arch = archmod.normalize_config(params.model_config_dict())
    tp = params.server.tensor_parallel
    mb = params.microbench
    burst = []
    for b in mb.batches:
        calls = [c for c in archmod.collective_schedule(arch, tp, b, dtype) if c.op == "all_reduce"]
        burst.append({"batch": b, "calls": [{"msg_bytes": c.msg_bytes, "count": c.count, "where": c.where}
                                            for c in calls]})
    ep = mb.expert_parallel if mb.expert_parallel > 1 else (mb.world_size or tp)
    a2a = [{"tokens_per_gpu": t, **archmod.all_to_all_bytes(arch, ep, t, dtype)} for t in mb.all_to_all_tokens]
    # what a rank reads between two all-reduces of a batch-1 step (its weights over its all-reduces): the
    # late_rank timing reads as much before each call, as the engine's call follows the layer's GEMMs
    between = (archmod.weight_bytes_per_step(archmod.gemm_shapes(arch, tp, 1, mb.expert_parallel, mb.moe_skew))["total"]
               / max(1, archmod.expected_all_reduces_per_step(arch, tp)))
    # the ranks sit where the engine binds its workers: gloo's hand-overs between a rank's threads cost what
    # they cost in the engine only on the same cores (benchmarks/probe_placement.py, forced AVX2: back to back
    # 211 us a call bound, 410 us unbound; the engine's median call 226 us)
    return {"dtype": dtype, "iters": mb.iterations, "warmup": mb.warmup, "burst": burst,
            "between_calls_bytes": int(between), "rank_cpus": engine_rank_cpus(params),
            "sweep": {"min_bytes": mb.sweep_min_bytes, "max_bytes": mb.sweep_max_bytes,
                      "ops": ["all_reduce", "all_to_all"]},
            "all_to_all": [{"tokens_per_gpu": x["tokens_per_gpu"], "dispatch_bytes": x["dispatch_bytes"]} for x in a2a]}


# shared-memory segments of vLLM's shm all-reduce, named after the probe's run token (procs.probe_shm_name)
PROBE_SHM_GLOBS = ("decodescope-probe-{token12}-*",)


def _run(argv: list[str], log_path: Path, timeout_s: float, host, env: Optional[dict] = None,
         inputs: tuple = (), outputs: tuple = ()) -> None:
    """A probe on the run's host (decodescope.exec.host: here or over ssh, inputs copied there and outputs
    back), in its own session and with its own run token, so an interrupt, a timeout or a dropped link
    stops every rank (torchrun's workers included, even re-parented ones)."""
    rc = host.run_job(argv, log_path, timeout_s, env=env, inputs=inputs, outputs=outputs,
                      shm_globs=PROBE_SHM_GLOBS)
    if rc != 0:
        raise ProbeError(f"{argv[2] if len(argv) > 2 else argv[0]} exited with {rc}; last lines of {log_path}:\n"
                         f"{log_tail(log_path, 25)}")


def run_gemm_probe(params, run_dir: Path, device: Optional[str] = None) -> pd.DataFrame:
    data = RunDir(run_dir).data
    plan = gemm_plan(params)
    shapes_path = data / "gemm_shapes.json"
    write_json_atomic(shapes_path, plan)
    out = data / "gemm_raw.json"

    host = host_for(params)
    argv = [host.python, "-m", "decodescope.probes.gemm", "--shapes", host.path(shapes_path), "--out", host.path(out),
            "--iters", str(params.microbench.iterations), "--warmup", str(params.microbench.warmup)]
    if device:
        argv += ["--device", device]
    if not params.microbench.flush_l2:
        argv.append("--warm-l2")
    cpus = rank_cpus(params)
    if cpus:
        argv += ["--cpus", cpus]
    _run(argv, run_dir / "logs" / "gemm_probe.log", params.microbench.probe_timeout_s, host=host,
         inputs=(shapes_path,), outputs=(out,))
    table = gemm_table(read_probe_output(out, "gemm").rows, peaks_for(run_dir, params))
    main = table["tp"] == params.server.tensor_parallel
    if not main.all():
        # other tensor-parallel sizes feed the verdict's what-if only: their own file
        write_parquet_atomic(data / GEMM_WHATIF_TP, table[~main].reset_index(drop=True))
    return table[main].reset_index(drop=True)


GEMM_WHATIF_TP = "gemm_whatif_tp.parquet"


def engine_rank_cpus(params) -> Optional[list[str]]:
    """On a CPU host, the cores vLLM binds each local rank to (VLLM_CPU_OMP_THREADS_BIND '0|1' -> ['0', '1']);
    None when the server does not bind (a GPU host, or no binding given)."""
    bind = params.server.env.get("VLLM_CPU_OMP_THREADS_BIND")
    if not bind or bind in ("auto", "all", "nobind"):
        return None
    cpus = [part.strip() for part in bind.split("|")]
    return cpus if all(cpus) else None


def rank_cpus(params) -> Optional[str]:
    """The cores vLLM binds its first rank to: 02 times the GEMMs with the threads one rank has, like for like."""
    cpus = engine_rank_cpus(params)
    return cpus[0] if cpus else None


def peaks_for(run_dir: Path, params) -> Optional[Peaks]:
    """Peaks from the host phase's file (GPU datasheet or the measured CPU matmul), else from the params;
    None when nothing is known."""
    host = RunDir(run_dir).host()
    peaks = (host.peaks if host else None) or resolve_peaks(params.hardware.gpu, params.hardware.peaks.model_dump())
    if peaks is None and host is not None and host.cpu_matmul:
        best = {m.dtype: m.gflops / 1e3 for m in host.cpu_matmul}
        peaks = Peaks(name="CPU (measured)", bf16_tflops=best.get("bfloat16"), fp32_tflops=best.get("float32"),
                      source="host.json cpu_matmul")
    return peaks


def dtype_peaks(peaks: Optional[Peaks]) -> dict[str, tuple[Optional[float], str]]:
    """Each probed dtype's compute roofline (TFLOP/s, None when unknown) and where it comes from.

    fp16 runs at the bf16 tensor-core rate.
    int4 is W4A16: the weights are dequantized and multiplied in 16-bit.
    So its peak is the bf16 one, unless `hardware.peaks.int4_tflops` says otherwise.
    fp32 has a peak only when one is given or measured.
    Datasheets list tensor-core peaks, and fp32 GEMMs run on the CUDA cores, far below bf16/2."""
    where = f" of {peaks.name} ({peaks.source})" if peaks is not None and peaks.name else ""

    def given(key: str, why: str = ""):
        v = getattr(peaks, key) if peaks is not None else None
        return (float(v), f"{key}{where}{why}") if v else None

    def missing(dtype: str, key: str):
        return None, f"no {dtype} peak known (set hardware.peaks.{key})"

    return {
        "bf16": given("bf16_tflops") or missing("bf16", "bf16_tflops"),
        "fp16": given("bf16_tflops", ", the same tensor-core rate") or missing("fp16", "bf16_tflops"),
        "fp8": given("fp8_tflops") or missing("fp8", "fp8_tflops"),
        "int4": (given("int4_tflops")
                 or given("bf16_tflops", ": W4A16 dequantizes the weights and multiplies in 16-bit")
                 or missing("int4", "int4_tflops")),
        "fp32": given("fp32_tflops") or missing("fp32", "fp32_tflops"),
    }


def gemm_table(rows: list[dict], peaks: Optional[Peaks]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    by_dtype = dtype_peaks(peaks)
    mem = peaks.mem_gbps if peaks is not None else None
    df["peak_tflops"] = df["dtype"].map({d: v for d, (v, _) in by_dtype.items()}).astype(float)
    df["peak_source"] = df["dtype"].map({d: src for d, (_, src) in by_dtype.items()})
    df["mem_gbps"] = float(mem) if mem else np.nan
    for col in ("tflops", "gbps", "time_us"):
        if col not in df:
            df[col] = np.nan
    df["pct_of_compute_peak"] = 100 * df["tflops"] / df["peak_tflops"]
    df["pct_of_mem_peak"] = 100 * df["gbps"] / mem if mem else np.nan
    df["pct_of_peak"] = df[["pct_of_compute_peak", "pct_of_mem_peak"]].max(axis=1)
    df["step_time_us"] = df["time_us"] * df["count"]
    return df


def step_memory_floor(params, peaks: Optional[Peaks]) -> pd.DataFrame:
    """Per batch: the bytes one rank must read in a decode step (its weights, `model.weight_dtype` for
    the quantized layers, and the KV cache of `microbench.context_tokens` per sequence in bf16) and the
    time that takes at the memory peak: no step on this host can be faster."""
    arch = archmod.normalize_config(params.model_config_dict())
    tp, mb = params.server.tensor_parallel, params.microbench
    wdt = params.model.weight_dtype
    quantized = ("moe_expert",) if arch.moe_layers else ("attention", "dense_mlp")
    mem = peaks.mem_gbps if peaks is not None else None
    rows = []
    for b in mb.batches:
        shapes = archmod.gemm_shapes(arch, tp, b, mb.expert_parallel, mb.moe_skew)
        w = archmod.weight_bytes_per_step(shapes, wdt, quantized_kinds=quantized)
        kv = archmod.kv_cache_bytes_per_step(arch, tp, b, mb.context_tokens)
        total = w["total"] + kv
        rows.append({"batch": b, "weight_dtype": wdt, "weight_bytes": w["total"],
                     "quantized_weight_bytes": w.get(wdt, 0.0) if wdt != "bf16" else 0.0,
                     "kv_bytes": kv, "context_tokens": mb.context_tokens, "total_bytes": total,
                     "mem_gbps": float(mem) if mem else np.nan,
                     "floor_us": total / (mem * 1e9) * 1e6 if mem else np.nan})
    return pd.DataFrame(rows)


def memory_floor_note(floor: pd.DataFrame, peaks: Optional[Peaks]) -> str:
    if floor.empty:
        return ""
    first = floor.iloc[0]
    dt = first["weight_dtype"]
    how = ("int4 weights count half a byte each plus a 2-byte scale per 32 (decodescope.core.dtypes)" if dt == "int4"
           else f"{dt} weights")
    if first["mem_gbps"] != first["mem_gbps"]:
        return (f"**Memory floor:** no memory bandwidth peak is known for this host (set "
                f"hardware.peaks.mem_gbps), so only the bytes are shown; {how}, KV cache in bf16 at "
                f"{int(first['context_tokens'])} tokens of context per sequence.")
    assert peaks is not None  # a bandwidth in the table came from peaks (step_memory_floor)
    return (f"**Memory floor:** reading the bytes below at {first['mem_gbps']:,.0f} GB/s ({peaks.name}, "
            f"{peaks.source}) takes at least {first['floor_us']:,.1f} us per decode step at batch "
            f"{int(first['batch'])}; {how}, KV cache in bf16 at {int(first['context_tokens'])} tokens of context "
            "per sequence. A step measured well above this floor spends its time elsewhere.")


def gemm_per_step(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"]
    return ok.groupby(["batch", "dtype"]).agg(step_gemm_us=("step_time_us", "sum"),
                                              gemms=("count", "sum")).reset_index()


def run_collectives_probe(params, run_dir: Path, device: Optional[str] = None) -> pd.DataFrame:
    data = RunDir(run_dir).data
    plan_path = data / "collectives_plan.json"
    write_json_atomic(plan_path, collectives_plan(params))
    out_dir = data / "collectives_ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    mb = params.microbench
    world = mb.world_size or params.server.tensor_parallel
    args = ["--plan", plan_path, "--out-dir", out_dir] + (["--device", device] if device else [])
    run_torchrun_probe(params, run_dir, "decodescope.probes.collectives", args, world, inputs=(plan_path,),
                       outputs=(out_dir,), log_name="collectives_probe")
    return collectives_table(out_dir)


STEP_REPLAY = "step_replay.parquet"


def step_plan(params, dtype: str = "bf16") -> dict:
    """The step replay probe's plan (probes/step.py): the step's program in model order per batch, its
    collectives through the communicator the engine uses where the probe can build it."""
    arch = archmod.normalize_config(params.model_config_dict())
    tp, mb = params.server.tensor_parallel, params.microbench
    return {"dtype": dtype, "iters": mb.iterations, "warmup": mb.warmup, "communicator": "engine",
            "rank_cpus": engine_rank_cpus(params), "steps": [{"batch": b, "program": archmod.step_program(arch, tp, b, mb.expert_parallel)} for b in mb.batches]}


def step_replay_job(params, run_dir: Path, device: Optional[str] = None) -> tuple[list, Path, Path]:
    """The replay's job of probes.step (GEMMs and collectives in model order, at every microbench batch):
    its arguments, its plan's path (written here) and its output folder."""
    data = RunDir(run_dir).data
    plan_path = data / "step_plan.json"
    dtype = "bf16" if "bf16" in params.microbench.dtypes else params.microbench.dtypes[0]
    write_json_atomic(plan_path, step_plan(params, dtype))
    out_dir = data / "step_ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    return ["--plan", plan_path, "--out-dir", out_dir] + (["--device", device] if device else []), plan_path, out_dir


def save_step_replay(out_dir: Path, run_dir: Path) -> pd.DataFrame:
    """The replay's rank files as per (batch, variant, mode) the slowest rank's median (replay_table);
    data/step_replay.parquet written and returned."""
    table = replay_table(read_probe_rows(sorted(Path(out_dir).glob("step_rank*.json")), "step"))
    write_parquet_atomic(RunDir(run_dir).data / STEP_REPLAY, table)
    return table


# torchrun's own folder (its ranks' error files) goes in the run directory: without --log-dir it makes a
# /tmp/torchelastic_* folder a run and never removes it
TORCHRUN_LOG_DIR = "torchrun"


def run_torchrun_probe(params, run_dir: Path, module: str, args: list, world: int, inputs: tuple = (),
                       outputs: tuple = (), log_name: str = "probe", env: Optional[dict] = None) -> None:
    """A torchrun probe (collectives, step replay) on the run's host, or across params.host and
    host.nodes (one torchrun agent per host, launched over ssh, meeting at microbench.rdzv_endpoint
    through torchrun's c10d rendezvous; `world` ranks split evenly over the hosts). Path arguments
    (Paths of the run directory) become the host's paths; inputs are copied there, outputs back."""
    mb = params.microbench
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    hosts = node_hosts(params)
    log = Path(run_dir) / "logs" / f"{log_name}.log"

    def argv_on(host, nnodes: int, per_node: int, node_rank: int) -> list[str]:
        argv = [host.python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={per_node}",
                f"--log-dir={host.path(Path(run_dir) / 'logs' / TORCHRUN_LOG_DIR)}"]
        if nnodes > 1:
            argv += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={mb.rdzv_endpoint}"]
            if len(hosts) > 1:  # decodescope launches every agent: the first host holds the rendezvous store
                argv += [f"--rdzv-id={Path(run_dir).name}-{log_name}",
                         f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}"]
        else:
            argv += ["--standalone"]
        return argv + ["-m", module] + [host.path(a) if isinstance(a, Path) else str(a) for a in args]

    if len(hosts) == 1:
        _run(argv_on(hosts[0], mb.nnodes, world, mb.node_rank), log, mb.probe_timeout_s, hosts[0], env,
             inputs=inputs, outputs=outputs)
        return
    if world % len(hosts):
        raise ProbeError(f"microbench.world_size {world} does not split evenly over {len(hosts)} hosts "
                         f"(host and host.nodes); use a multiple of {len(hosts)}")
    _run_on_nodes(hosts, [argv_on(h, len(hosts), world // len(hosts), i) for i, h in enumerate(hosts)],
                  [log.with_name(f"{log_name}.node{i}.log") for i in range(len(hosts))], mb.probe_timeout_s, env,
                  inputs, outputs)


def _run_on_nodes(hosts, argvs, logs, timeout_s: float, env: dict, inputs: tuple, outputs: tuple) -> None:
    """One agent per host, started together, waited for together; any failure stops all of them."""
    handles, failed, timed_out = [], [], []
    try:
        for host, argv, log in zip(hosts, argvs, logs):
            for p in inputs:
                host.push(p)
            handles.append(host.start(argv, log, env=env, grace_s=5.0, shm_globs=PROBE_SHM_GLOBS, sync=outputs))
        deadline = time.monotonic() + timeout_s
        while any(h.poll() is None for h in handles) and time.monotonic() < deadline:
            failed = [i for i, h in enumerate(handles) if h.poll() not in (None, 0)]
            if failed:
                break
            time.sleep(0.2)
        failed = [i for i, h in enumerate(handles) if h.poll() not in (None, 0)]
        timed_out = [i for i, h in enumerate(handles) if h.poll() is None]
    finally:
        for h in handles:
            h.stop()
        for host in hosts:
            for p in outputs:
                host.pull(p, quiet=True)

    module = argvs[0][argvs[0].index("-m", 3) + 1]
    for i in failed or range(len(handles)):
        h, log = handles[i], logs[i]
        if h.poll() != 0:
            why = h.dead_reason() or (f"was still running after {timeout_s:.0f} s (microbench.probe_timeout_s) "
                                      "and was stopped" if i in timed_out else f"exited with {h.poll()}")
            raise ProbeError(f"{module} on node {i} ({hosts[i].name}) {why}; last lines of {log}:\n"
                             f"{log_tail(log, 25)}")


def collectives_table(out_dir: Path) -> pd.DataFrame:
    rows, metas = [], []
    for p in sorted(Path(out_dir).glob("collectives_rank*.json")):
        doc = read_probe_output(p, "collectives")
        metas.append(doc.meta)
        for r in doc.rows:
            rows.append({**r, "backend": doc.meta["backend"], "nccl_version": doc.meta.get("nccl_version")})
    df = pd.DataFrame(rows)
    df.attrs["meta"] = metas
    return df


def with_timing_columns(coll: pd.DataFrame) -> pd.DataFrame:
    """Rows written before the probe measured several communicators and timings: torch, isolated."""
    coll = coll.copy()
    if "communicator" not in coll:
        coll["communicator"] = "torch_" + coll.get("backend", pd.Series("?", index=coll.index)).astype(str)
    if "timing" not in coll:
        coll["timing"] = "isolated"
    coll["communicator"] = coll["communicator"].fillna("torch")
    mode = coll["mode"] if "mode" in coll else pd.Series("eager", index=coll.index)
    coll["timing"] = coll["timing"].fillna(mode.map({"cuda_graph": "cuda_graph"}).fillna("back_to_back"))
    return coll


def latency_fit(sweep: pd.DataFrame) -> pd.DataFrame:
    """t(n) = alpha + n / beta per operation, least squares over the sweep's medians (rank 0): one
    records.LatencyFit per row."""
    out = []
    ok = sweep[(sweep["part"] == "sweep") & (sweep["status"] == "ok")]
    ok = with_timing_columns(ok[ok["rank"] == ok["rank"].min()])
    ok = ok[~ok["timing"].isin((HOST_ISSUE, HOST_AFTER_GEMM))]  # the host's issue time moves no bytes: nothing to fit
    for (op, inplace, comm, timing), g in ok.groupby(["op", "inplace", "communicator", "timing"]):
        if len(g) < 2:
            continue
        x, y = g["bytes"].to_numpy(float), g["time_us"].to_numpy(float)
        slope, alpha = np.polyfit(x, y, 1)
        if alpha < 0:  # a latency cannot be negative: least squares with alpha held at 0
            slope, alpha = float(x @ y / (x @ x)), 0.0
        beta_gbps = (1.0 / slope) * 1e6 / 1e9 if slope > 0 else np.inf
        out.append(LatencyFit(op=op, inplace=bool(inplace), communicator=comm, timing=timing, alpha_us=float(alpha),
                              beta_gbps=float(beta_gbps), points=len(g)))
    return pd.DataFrame([f.model_dump() for f in out], columns=LATENCY_FIT_COLUMNS)


def save_gemm(df: pd.DataFrame, data_dir: Path) -> None:
    write_parquet_atomic(Path(data_dir) / GEMM, df)


def save_collectives(df: pd.DataFrame, fit: pd.DataFrame, data_dir: Path) -> None:
    write_parquet_atomic(Path(data_dir) / COLLECTIVES, df)
    write_record(Path(data_dir) / "collectives_fit.json",
                 CollectivesFit(fits=[LatencyFit.model_validate(r) for r in fit.to_dict("records")]))


# ---- the phases: each measures, writes its records and returns them ------------------------------------
def gemm_for_phase(ctx: PhaseContext) -> pd.DataFrame:
    """02_gemm: the GEMM probe on the run's host; data/gemm.parquet written and returned."""
    gemm = run_gemm_probe(ctx.params, ctx.run_dir)
    save_gemm(gemm, ctx.data_dir)
    return gemm


def collectives_for_phase(ctx: PhaseContext) -> tuple[pd.DataFrame, pd.DataFrame]:
    """03_collectives: the collective probe and its latency fit; data/collectives.parquet and
    data/collectives_fit.json written, both returned."""
    coll = run_collectives_probe(ctx.params, ctx.run_dir)
    fit = latency_fit(coll)
    save_collectives(coll, fit, ctx.data_dir)
    return coll, fit


def replay_table(step_rows: list[dict]) -> pd.DataFrame:
    """probes/step.py output (all ranks) -> one row per (batch, variant, mode): the slowest rank's median,
    since a step ends when its last rank does."""
    df = pd.DataFrame([r for r in step_rows if r.get("status") == "ok"])
    if "communicator" not in df:  # written before the probe named its communicator: torch's
        df["communicator"] = None
    out = (df.groupby(["batch", "variant", "mode"]).agg(time_us=("time_us", "max"), p10_us=("p10_us", "max"),
                                                          p90_us=("p90_us", "max"), ops=("ops", "first"),
                                                          communicator=("communicator", "first"))
           .reset_index())
    if "host_ref_iter_us" in df:
        # each rank's speed over a step: the mean of its samples before and after it, where taken
        after = df["host_ref_after_iter_us"] if "host_ref_after_iter_us" in df else pd.Series(None, index=df.index)
        df["host_ref_step_us"] = [step_host_refs(b, a) for b, a in zip(df["host_ref_iter_us"], after)]
        refs = df.groupby(["batch", "variant", "mode"])["host_ref_step_us"].apply(paced_host_ref_us)
    else:
        refs = None
    out["host_ref_us"] = out.set_index(["batch", "variant", "mode"]).index.map(refs).astype(float) \
        if refs is not None else np.nan
    return out


def step_host_refs(before, after) -> Optional[list]:
    """One rank's host speed per step: the mean of its reference sampled before and after each step
    (a VM core can change speed inside a 30 ms step), or the before samples alone."""
    if not isinstance(before, (list, np.ndarray)) or not len(before):
        return None
    if isinstance(after, (list, np.ndarray)) and len(after) == len(before):
        return list((np.asarray(before, float) + np.asarray(after, float)) / 2)
    return list(before)


def paced_host_ref_us(per_rank: pd.Series) -> Optional[float]:
    """The host speed an eager step ran at: per step, the slowest rank's reference (a step ends with
    its slowest host), median over the steps. per_rank: each rank's list, one sample per step."""
    lists = [x for x in per_rank if isinstance(x, (list, np.ndarray)) and len(x)]
    if not lists or len({len(x) for x in lists}) != 1:
        return None
    return float(np.median(np.max(np.array(lists, dtype=float), axis=0)))
