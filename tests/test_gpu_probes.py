"""GPU behaviour of the probes the step model rests on. Needs an NVIDIA GPU: run through the device tool
(`python -m pytest -m gpu tests/test_gpu_probes.py`); imports only torch and the probes, as the GPU image
has no pydantic or vLLM."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


def _replay_gemms_on_one_gpu(plan: dict, tmp_path: Path, variant: str = "gemm_only") -> dict:
    """One variant of the step replay probe at world size 1: its rows by mode."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                    "decodescope.probes.step", "--plan", str(tmp_path / "plan.json"), "--out-dir", str(tmp_path),
                    "--variants", variant], check=True, timeout=300, env=env)
    return {r["mode"]: r for r in json.loads((tmp_path / "step_rank0.json").read_text())["rows"]}


def test_asked_for_the_engines_communicator_a_gpu_without_vllm_replays_through_torch_and_says_so(tmp_path):
    """A step plan that asks for the engine's communicator (as 03 writes it) on a GPU image without vLLM:
    the collectives run through torch's NCCL, eager and in a CUDA graph, each row names it, and the
    rank's meta says why."""
    plan = json.loads((REPO / "benchmarks/results/plan_kimi_tp8_step_b1.json").read_text())
    program = plan["steps"][0]["program"][:40]   # the embedding all-reduce and the first layers
    assert sum(x["kind"] == "all_reduce" for x in program) >= 2
    plan["steps"] = [{"batch": 1, "program": program}]
    plan["iters"], plan["warmup"], plan["communicator"] = 5, 2, "engine"
    rows = _replay_gemms_on_one_gpu(plan, tmp_path, "full")
    meta = json.loads((tmp_path / "step_rank0.json").read_text())["meta"]
    print(meta["communicator"], "|", meta["communicator_note"], {m: round(r["time_us"], 1) for m, r in rows.items()})
    assert set(rows) == {"eager", "cuda_graph"} and all(r["status"] == "ok" for r in rows.values())
    assert {r["communicator"] for r in rows.values()} == {"torch_nccl"} == {meta["communicator"]}
    assert "need vLLM" in meta["communicator_note"]


def test_cold_weights_timing_is_no_slower_than_a_flushed_l2_and_no_faster_than_warm():
    """A decode GEMM that reads its own weights from memory with its activations in L2: between the
    L2-flushed time (activations cold too) and the warm time (weights in L2), within the spread."""
    import torch

    from decodescope.probes.gemm import Flusher, measure

    dev = torch.device("cuda")
    shape = {"op": "moe_w13", "batch": 1, "m": 1, "n": 512, "k": 7168, "count": 1, "dtype": "bf16"}
    flushed = measure(shape, dev, iters=30, warmup=5, flush=Flusher(dev), graph=True)
    warm = measure(shape, dev, iters=30, warmup=5, flush=None, graph=True)
    cold = flushed["cold_weights_time_us"]
    print(f"warm {warm['graph_time_us']:.2f} us, cold weights {cold:.2f} us, flushed {flushed['graph_time_us']:.2f} us")
    assert warm["graph_time_us"] * 0.95 <= cold <= flushed["graph_time_us"] * 1.05


def test_step_replay_on_one_gpu_in_a_cuda_graph(tmp_path):
    """Two layers of Kimi-K2.5 TP=8 shapes per rank, world size 1: graph beats eager (launch gaps) and
    every GEMM of the program ran."""
    plan = json.loads((REPO / "benchmarks/results/plan_kimi_tp8_step_b1.json").read_text())
    program = plan["steps"][0]["program"]
    first_layers = [x for x in program if x["kind"] == "gemm"][:60]
    plan["steps"] = [{"batch": 1, "program": first_layers}]
    plan["iters"], plan["warmup"] = 5, 2
    rows = _replay_gemms_on_one_gpu(plan, tmp_path)
    print({m: round(r["time_us"], 1) for m, r in rows.items()})
    assert rows["eager"]["ops"] == rows["cuda_graph"]["ops"] == 60
    assert rows["cuda_graph"]["time_us"] < rows["eager"]["time_us"]


def test_an_eager_gemm_sequence_is_paced_by_the_hosts_measured_cost_per_call(tmp_path):
    """The 1,462 GEMMs of a Kimi-K2.5 TP=8 decode step at batch 2, eager on one GPU (host-bound: ~15 us
    to issue each, a few us to run): each GEMM's host cost per call (the GEMM probe's host column) and
    GPU time (its cold-weights time), walked in program order (stepmodel.eager_walk), price the
    replayed sequence within 10%, each host cost restated at the host speed the replay ran at (the
    reference sampled beside each: timing.HostRef), as a cloud VM's cores change speed by up to 1.8x."""
    import torch

    from decodescope.probes.gemm import measure
    from decodescope.micro.bench import replay_table
    from decodescope.verdict.stepparts import eager_walk, replay_host_refs

    plan = json.loads((REPO / "benchmarks/results/plan_kimi_tp8_step.json").read_text())
    step = next(s for s in plan["steps"] if s["batch"] == 2)
    gemms = [x for x in step["program"] if x["kind"] == "gemm"]
    dev = torch.device("cuda")
    timed = {}
    for x in gemms:
        if x["op"] not in timed:
            r = measure({**x, "batch": 2, "count": 1, "dtype": "bf16"}, dev, iters=20, warmup=5, flush=None, graph=True)
            timed[x["op"]] = (r["host_time_us"] / r["host_ref_us"], r["cold_weights_time_us"])
    plan["steps"] = [{"batch": 2, "program": gemms}]
    plan["iters"], plan["warmup"] = 20, 5
    rows = _replay_gemms_on_one_gpu(plan, tmp_path)
    replay = replay_table(list(rows.values()))
    replay_us = rows["eager"]["time_us"]
    replay_ref_us = replay_host_refs(replay, variant="gemm_only")[2]  # each step's before/after mean, median
    predicted_us, host_us = eager_walk([(units * replay_ref_us, gpu_us) for units, gpu_us in
                                        (timed[x["op"]] for x in gemms)])
    print(f"{len(gemms)} GEMMs: eager replay {replay_us:.0f} us, host-paced walk {predicted_us:.0f} us "
          f"(host {host_us:.0f} us at {replay_ref_us:.2f} us per reference launch), graph replay "
          f"{rows['cuda_graph']['time_us']:.0f} us")
    assert all(h > 0 for h, _ in timed.values()) and len(rows["eager"]["host_ref_iter_us"]) == 20
    assert host_us > rows["cuda_graph"]["time_us"]  # host-bound: the walk's reason to exist
    assert predicted_us == pytest.approx(replay_us, rel=0.10)


def test_the_collective_probe_times_an_all_reduces_host_cost_after_the_gemm_that_writes_it(tmp_path):
    """03 on GPUs: every swept size up to HOST_AFTER_GEMM_MAX_BYTES has a host_after_gemm row beside its
    host_issue row (the call issued right after a GEMM writing its input, less that GEMM alone), with no
    bandwidth made of it."""
    plan = {"dtype": "bf16", "iters": 10, "warmup": 3, "burst": [],
            "sweep": {"min_bytes": 1024, "max_bytes": 16384, "ops": ["all_reduce"]}, "all_to_all": []}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                    "decodescope.probes.collectives", "--plan", str(tmp_path / "plan.json"), "--out-dir", str(tmp_path)],
                   check=True, timeout=300, env=env)
    rows = [r for r in json.loads((tmp_path / "collectives_rank0.json").read_text())["rows"]
            if r.get("part") == "sweep" and r.get("communicator") == "torch_nccl" and r.get("inplace")]
    by = {(r["timing"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    print({n: (round(by[("host_issue", n)]["time_us"], 1), round(by[("host_after_gemm", n)]["time_us"], 1)) for n in sizes})
    assert sizes == [1024, 2048, 4096, 8192, 16384]
    for n in sizes:
        assert by[("host_after_gemm", n)]["status"] == "ok" and by[("host_after_gemm", n)]["time_us"] > 0
        assert "algbw_gbps" not in by[("host_after_gemm", n)]
        # the host's speed sampled beside each host timing, for the eager walk to restate it
        assert by[("host_after_gemm", n)]["host_ref_us"] > 0 and by[("host_issue", n)]["host_ref_us"] > 0


def test_one_variant_over_several_batches_frees_each_batchs_weights_before_the_next(tmp_path):
    """--variants full over batches 16 and 32 of a Kimi-K2.5 TP=8 step (77 GB of weights per rank at 16;
    at 32, 128 GB held to the probe's budget, 60% of the GPU's memory): the second batch builds its own
    only if the first's, held by the timed step and its CUDA graph, were freed (on 2x H200 this ran out
    of memory at batch 32 before time_variant)."""
    plan = json.loads((REPO / "benchmarks/results/plan_kimi_tp8_step.json").read_text())
    plan["steps"] = [s for s in plan["steps"] if s["batch"] in (16, 32)]
    plan["iters"], plan["warmup"] = 3, 1
    _replay_gemms_on_one_gpu(plan, tmp_path, "full")
    rows = json.loads((tmp_path / "step_rank0.json").read_text())["rows"]
    assert sorted((r["batch"], r["mode"]) for r in rows if r["status"] == "ok") == [
        (16, "cuda_graph"), (16, "eager"), (32, "cuda_graph"), (32, "eager")]
    assert all(r["gemms_reusing_weights"] > 0 for r in rows if r["batch"] == 32)  # held to the budget


def test_the_replay_and_a_late_rank_profiled_run_as_two_jobs_of_one_launch(tmp_path):
    """03's step probe jobs on a GPU (probes/step.py --then): the replay timed eager and in a CUDA graph,
    then, in the same launch and process, the step profiled with the rank late by 100 us before every
    collective (torch.cuda._sleep in the graph). Each job writes its own folder with its own delay in its
    meta; the launch exits 0 past the CUDA graphs (the probe leaves by os._exit there)."""
    plan = json.loads((REPO / "benchmarks/results/plan_kimi_tp8_step_b1.json").read_text())
    program = plan["steps"][0]["program"][:40]   # the embedding all-reduce and the first layers
    plan["steps"] = [{"batch": 1, "program": program}]
    plan["iters"], plan["warmup"], plan["communicator"] = 5, 2, "engine"
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    replay, late = tmp_path / "replay", tmp_path / "late"
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                    "decodescope.probes.step", "--plan", str(tmp_path / "plan.json"), "--out-dir", str(replay),
                    "--variants", "full", "--then", "--plan", str(tmp_path / "plan.json"), "--out-dir", str(late),
                    "--variants", "", "--profile-steps", "3", "--skew-us", "100", "--skew-rank", "0"],
                   check=True, timeout=300, env=env)
    timed = json.loads((replay / "step_rank0.json").read_text())
    profiled = json.loads((late / "step_rank0.json").read_text())
    rows = {r["mode"]: r for r in timed["rows"]}
    print({m: round(r["time_us"], 1) for m, r in rows.items()}, profiled["meta"]["skew_us"])
    assert set(rows) == {"eager", "cuda_graph"} and all(r["status"] == "ok" for r in rows.values())
    assert timed["meta"]["skew_us"] == 0.0 and profiled["meta"]["skew_us"] == 100.0 and profiled["rows"] == []
    assert not list(replay.glob("*.pt.trace.json.gz"))
    traces = list(late.glob("step_replay_b1_rank0.pt.trace.json.gz"))
    assert len(traces) == 1
    events = json.loads(gzip.open(traces[0]).read())["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("execute_context_0(0)_generation_1(1)")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    sleeps = sorted({e["name"] for e in kernels if "sleep" in e["name"].lower() or "spin" in e["name"].lower()})
    print(len(steps), "steps,", len(kernels), "kernels; sleep kernels:", sleeps[:3])
    assert len(steps) >= 3 and kernels
