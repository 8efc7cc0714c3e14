"""Both probes for real in the embedded default: torch on the CPU, torchrun with two gloo ranks."""

import contextlib
import os

import pandas as pd
import pytest

from decodescope.exec import procs
from decodescope.model import arch as archmod
from decodescope.micro import bench as mb
from decodescope.probes.timing import scheduler_tick_us
from decodescope.schema.params import load_params
from decodescope.schema.records_probe import read_probe_output

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("probes")
    for sub in ("data", "logs"):
        (d / sub).mkdir()
    return d


@pytest.fixture(scope="module")
def params(repo):
    return load_params(repo / "params/default.yaml")


@pytest.fixture(scope="module")
def coll(params, run_dir):
    # under a run id of its own, as a run's probe is: its segments carry that run's key (procs.probe_shm_name),
    # so the test checks its own probe's and no other's
    with run_id(run_dir.name):
        return mb.run_collectives_probe(params, run_dir)


@contextlib.contextmanager
def run_id(value: str):
    old = os.environ.get(procs.RUN_ID_ENV)
    os.environ[procs.RUN_ID_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(procs.RUN_ID_ENV, None)
        else:
            os.environ[procs.RUN_ID_ENV] = old


def test_burst_replays_the_architectures_schedule(params, coll):
    arch = archmod.normalize_config(params.model_config_dict())
    burst = coll[(coll["part"] == "burst") & (coll["status"] == "ok")]
    assert set(burst["rank"]) == {0, 1} and set(burst["world_size"]) == {2}
    assert set(burst["backend"]) == {"gloo"}
    for b in params.microbench.batches:
        sched = [c for c in archmod.collective_schedule(arch, 2, b) if c.op == "all_reduce"]
        rows = burst[burst["batch"] == b]
        assert (rows["calls"] == sum(c.count for c in sched)).all()           # 1 + 2 x 4 = 9
        assert (rows["msg_bytes"] == sched[0].msg_bytes).all()                # b x 256 x 2 bytes
        assert (rows["bytes"] == sum(c.count * c.msg_bytes for c in sched)).all()
        assert (rows["time_us"] > 0).all()


def test_torchruns_own_folder_is_in_the_run_directory_not_left_in_the_temporary_folder(coll, run_dir):
    """Without --log-dir torchrun makes a /tmp/torchelastic_* folder a launch and never removes it (6 from
    one test module's probes, 2026-12-07); the probe names the run directory's logs/torchrun instead."""
    made = [p for p in (run_dir / "logs" / mb.TORCHRUN_LOG_DIR).iterdir() if p.is_dir()]
    assert made, "torchrun made no folder under the run directory's logs/torchrun"


def test_sweep_reports_nccl_tests_bandwidths(coll):
    s = coll[(coll["part"] == "sweep") & (coll["status"] == "ok") & (coll["op"] == "all_reduce")]
    assert 1024 in set(s["bytes"]) and set(s["inplace"]) == {True, False}
    assert {"back_to_back", "isolated"} <= set(s["timing"])
    row = s.iloc[0]
    assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)
    fit = mb.latency_fit(coll)
    assert {"all_reduce"} <= set(fit["op"]) and (fit["alpha_us"] >= 0).all()


def test_the_engines_own_communicator_is_measured_back_to_back_at_the_steps_sizes(params, coll, run_dir,
                                                                                 engine_allreduce):
    """Like for like: the all-reduce the embedded default's server runs, as this host's vLLM picks it
    (vLLM CPU's shared-memory all-reduce where it loads _C or _C_AVX512; gloo where it loads _C_AVX2, which
    has none), at the step's message sizes, through the same burst and the same back-to-back timing."""
    engine = engine_allreduce.communicator
    assert engine == {"shm": "vllm_shm", "gloo": "torch_gloo"}[engine_allreduce.path]
    arch = archmod.normalize_config(params.model_config_dict())
    step_sizes = {c.msg_bytes for b in params.microbench.batches for c in archmod.collective_schedule(arch, 2, b)
                  if c.op == "all_reduce"}
    ok = coll[coll["status"] == "ok"]
    mine = ok[(ok["communicator"] == engine) & (ok["part"] == "sweep") & ok["inplace"].astype(bool)]
    assert step_sizes <= set(mine["bytes"])
    assert set(mine["timing"]) == {"back_to_back", "late_rank", "isolated"}
    # the last rank's op with the others already waiting, read by torch.profiler as an engine step's op is
    # (no Python call around it, no waiting); both ranks carry its figures. On a CPU 03 times each back-to-back
    # call by itself, each rank on the core the engine binds its worker to, so a typical back-to-back call waits
    # for no one either and the two are about one call on both paths (gloo, forced AVX2: late rank 158 us, back to
    # back 211 us, benchmarks/probe_placement.py; shm under a full suite: 2.92 and 2.44 us)
    by = mine[mine["bytes"] == min(step_sizes)].groupby(["timing", "rank"])[["time_us", "p10_us", "n", "calls"]].first()
    print(f"{engine} at", min(step_sizes), "B:", by.round(2).to_dict("index"))
    late, b2b = by.loc[("late_rank", 0)], by.loc[("back_to_back", 0)]
    assert late.equals(by.loc[("late_rank", 1)])
    # every timed call is one sample of the late rank's figures, as of back-to-back's: a stalled call is one of
    # calls x iterations, not a share of one repetition's median of its few calls
    assert late["n"] == late["calls"] * params.microbench.iterations
    # its calls that no stall reached (p10) within 3x of back-to-back's: what the timing guarantees, the op is one
    # call's own cost, the last rank's, not an early rank's that waits out the 100 us (40x of an shm call). Not
    # the medians: a waiting rank sleeps, and a loaded host's scheduler wakes it behind other work 2-10 ms later
    # in over half of either timing's calls at times (two busy loops: medians 0.1-9.9 ms, p10 64-139 us)
    assert late["p10_us"] < 3 * b2b["p10_us"]
    # each back-to-back call was timed by itself, so the probe split them by this host's scheduler tick: those
    # half a tick past the fastest (a spin of gloo's TCP loop that ran to the tick) and the rest
    tick_us = scheduler_tick_us()
    split = ok[(ok["part"] == "sweep") & (ok["timing"] == "back_to_back")]
    assert tick_us and (split["tick_us"] == tick_us).all() and split["stalled_share"].between(0.0, 1.0).all()
    # the unstalled calls are the fastest ones, so their median is at most the median of all, and each of them
    # ended before the limit
    assert (split["unstalled_us"] <= split["time_us"]).all()
    assert (split["unstalled_us"] < split["p10_us"] + tick_us / 2).all()
    print("stalled share back to back at the step's sizes:",
          split[split["bytes"].isin(step_sizes)].groupby(["communicator", "bytes"])["stalled_share"].max().to_dict())
    burst = ok[ok["part"] == "burst"]
    per_call = burst.groupby("communicator")["per_call_us"].median()
    print("burst per call (us):", per_call.round(1).to_dict())
    fit = mb.latency_fit(coll)
    assert {(engine, "back_to_back"), ("torch_gloo", "back_to_back")} <= set(zip(fit["communicator"], fit["timing"]))
    metas = [read_probe_output(p, "collectives").meta for p in sorted(run_dir.rglob("collectives_rank*.json"))]
    assert len(metas) == 2 and all(m["scheduler_tick_us"] == tick_us for m in metas)
    if engine == "vllm_shm":
        assert set(burst["communicator"]) == {"torch_gloo", "vllm_shm"}
        assert per_call["vllm_shm"] < per_call["torch_gloo"]  # the engine's path is the fast one on CPU
    else:  # vLLM's _C_AVX2 has no shm all-reduce: the probe says so instead of measuring it
        assert set(burst["communicator"]) == {"torch_gloo"}
        assert all(f"vllm.{engine_allreduce.cpu_extension}" in m["communicators_skipped"]["vllm_shm"] for m in metas), metas
    assert procs.probe_shm_of_run(run_dir.name) == []  # this probe's segments removed


def test_all_to_all_at_dispatch_sizes(params, coll):
    a = coll[coll["part"] == "all_to_all"]
    assert sorted(a["tokens_per_gpu"].unique()) == params.microbench.all_to_all_tokens
    assert (a["status"] == "ok").all(), a["skip_reason"].dropna().tolist()


def test_gemm_probe_on_cpu_measures_every_shape_and_skips_fp8_with_a_reason(params, run_dir):
    params = params.model_copy(deep=True)
    params.microbench.dtypes = ["bf16", "fp8"]
    params.microbench.batches = [1, 4]
    g = mb.run_gemm_probe(params, run_dir)
    arch = archmod.normalize_config(params.model_config_dict())
    expected = {(s.op, b) for b in (1, 4) for s in archmod.gemm_shapes(arch, 2, b)}
    bf16 = g[g["dtype"] == "bf16"]
    assert set(zip(bf16["op"], bf16["batch"])) == expected
    assert (bf16["status"] == "ok").all() and (bf16["time_us"] > 0).all()
    # one engine rank's cores and threads (VLLM_CPU_OMP_THREADS_BIND "0|1": core 0), like for like
    assert bf16["method"].str.contains(r"\(1 threads\)").all(), bf16["method"].iloc[0]
    fp8 = g[g["dtype"] == "fp8"]
    assert (fp8["status"] == "skipped").all()
    assert fp8["skip_reason"].str.contains("CUDA|grouped").all()
    # routed experts run as one grouped call per layer, as fused MoE kernels do
    w13 = bf16[bf16["op"] == "moe_w13"]
    assert (w13["groups"] >= arch.top_k).all() and (w13["count"] == arch.moe_layers).all()
    # like for like: the kernels the CPU engine runs (the profile's _C::onednn_mm and _C::cpu_fused_moe),
    # not torch.mm, which on this CPU's bf16 path is ~4x slower at these shapes
    dense = bf16[bf16["groups"] == 1]
    assert dense["method"].str.startswith("vLLM's CPU linear").all(), dense["method"].iloc[0]
    assert bf16[bf16["op"].isin(["moe_w13", "moe_w2"])]["method"].str.contains("cpu_fused_moe").all()
    raw = read_probe_output(run_dir / "data/gemm_raw.json", "gemm").rows
    # the raw file also holds the tensor-parallel what-if shapes (whatif.tensor_parallel: [1], first dtype
    # only), which go to their own table
    whatif = pd.read_parquet(run_dir / "data/gemm_whatif_tp.parquet")
    assert len(raw) == len(g) + len(whatif)
    assert set(whatif["tp"]) == {1} and set(whatif["dtype"]) == {"bf16"}
    assert set(zip(whatif["op"], whatif["batch"])) == {(s.op, b) for b in (1, 4) for s in archmod.gemm_shapes(arch, 1, b)}


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,dtype", [(1, 20480, 7168, "bf16"), (16, 7168, 256, "bf16"), (64, 2112, 7168, "fp8"),
                                         (4096, 4096, 4096, "bf16")])
def test_gemm_probe_graph_and_eager_timings_agree_on_gpu(m, n, k, dtype):
    """Run through the device tool; benchmarks/gemm_probe_vs_do_bench.py compares both with do_bench."""
    import torch

    from decodescope.probes.gemm import Flusher, measure

    dev = torch.device("cuda")
    shape = {"op": "t", "batch": m, "m": m, "n": n, "k": k, "count": 1, "dtype": dtype}
    r = measure(shape, dev, iters=50, warmup=10, flush=Flusher(dev), graph=True)
    assert r["status"] == "ok" and "graph_error" not in r
    assert r["time_us"] == r["graph_time_us"] > 0
    # graph replays drop the few microseconds of launch gap that eager events include, not kernel time
    times = f"eager {r['eager_time_us']:.2f} us, graph {r['graph_time_us']:.2f} us"
    assert r["graph_time_us"] < 1.05 * r["eager_time_us"], times
    assert r["eager_time_us"] - r["graph_time_us"] < max(5.0, 0.15 * r["eager_time_us"]), times
    assert r["graph_p10_us"] <= r["graph_time_us"] <= r["graph_p90_us"]


def test_gemm_display_and_note_use_the_graph_time_when_measured():
    import pandas as pd

    from decodescope.report.micro_view import gemm_display, gemm_method_note

    rows = pd.DataFrame([{"op": "o_proj", "batch": 1, "dtype": "bf16", "m": 1, "n": 7168, "k": 1024, "status": "ok",
                          "method": "m", "time_us": 4.0, "graph_time_us": 4.0, "graph_p10_us": 3.9,
                          "graph_p90_us": 4.2, "eager_time_us": 7.0, "eager_p10_us": 6.5, "eager_p90_us": 9.0,
                          "pct_of_peak": 20.0}])
    shown = gemm_display(rows).iloc[0]
    assert (shown["time_us"], shown["p10"], shown["p90"], shown["eager_time_us"]) == (4.0, 3.9, 4.2, 7.0)
    assert "eager minus graph is 3.0 us" in gemm_method_note(rows)
    cpu = rows.drop(columns=["graph_time_us", "graph_p10_us", "graph_p90_us"]).assign(time_us=7.0)
    shown = gemm_display(cpu).iloc[0]
    assert (shown["p10"], shown["p90"]) == (6.5, 9.0) and "eager_time_us" not in shown
    assert "graph" not in gemm_method_note(cpu)
    # the step model's CPU timing (the step's GEMMs in its order) is shown beside the per-call one
    assert gemm_display(cpu.assign(step_order_time_us=9.5)).iloc[0]["step_order_time_us"] == 9.5
