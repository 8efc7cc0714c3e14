"""The step model (decodescope.stepmodel, priced from the GEMM and collective micro-benchmarks) against
the step replay probe (probes/step.py: the same GEMMs and collectives in model order, measured whole).

    python benchmarks/step_model_vs_replay.py GEMM_RAW_JSON COLLECTIVES_DIR STEP_DIR PARAMS [--tp 8]

Defaults: the H200 results in benchmarks/results (Kimi-K2.5 TP=8 shapes per rank, bf16, two H200s over
NVLink, NCCL). Prints, per batch and timing, the prediction with its band, the replay, and their ratio.
"""
from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from decodescope import arch as archmod
from decodescope import microbench as mb
from decodescope import stepmodel as sm
from decodescope.params import load_params

RESULTS = Path(__file__).resolve().parent / "results"


def print_comparison(title: str, cmp, *parts: tuple[str, str]) -> None:
    """One table: per batch the model with its band, two of its parts (header, column), the replay."""
    print(f"\n{title}")
    print(f"{'batch':>5} {'model ms':>9} {'band ms':>15} " + " ".join(f"{h:>9}" for h, _ in parts)
          + f" {'replay ms':>10} {'model/replay':>12}")
    for r in cmp.itertuples():
        print(f"{r.batch:>5} {r.predicted_us / 1e3:>9.2f} {r.low_us / 1e3:>7.2f}-{r.high_us / 1e3:<7.2f} "
              + " ".join(f"{getattr(r, c) / 1e3:>9.2f}" for _, c in parts)
              + f" {r.replay_us / 1e3:>10.2f} {r.predicted_us / r.replay_us:>12.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gemm", nargs="?", default=str(RESULTS / "h200_gemm_kimi_tp8_b1_64_cold_weights" / "gemm_raw.json"))
    ap.add_argument("collectives", nargs="?", default=str(RESULTS / "h200x2_collectives_back_to_back"))
    ap.add_argument("step", nargs="?", default=str(RESULTS / "h200x2_step_replay_kimi_tp8"))
    ap.add_argument("params", nargs="?", default=str(Path(__file__).resolve().parents[1] / "params" /
                                                      "kimi-k2.5-int4-8x-pcie.yaml"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--communicator", default="torch_nccl")
    args = ap.parse_args()
    arch = archmod.normalize_config(load_params(args.params).model_config_dict())
    gemm = mb.gemm_table(json.loads(Path(args.gemm).read_text()), None)
    coll = mb.collectives_table(Path(args.collectives))
    rows = [r for f in sorted(glob.glob(f"{args.step}/step_rank*.json")) for r in json.load(open(f))["rows"]]
    replay = sm.replay_table(rows)
    batches = sorted(replay["batch"].unique())
    print(f"step model vs step replay: {arch.model_type} TP={args.tp} shapes per rank, world size "
          f"{rows[0]['world_size']}, {args.communicator}")
    for timing, mode in (("cuda_graph", "cuda_graph"), ("back_to_back", "eager")):
        cmp = sm.compare_with_replay(sm.predict_replay(gemm, coll, arch, args.tp, batches, args.communicator, timing),
                                     replay, mode=mode)
        print_comparison(f"{mode} replay (model: GEMMs from 02 + {timing} collective latency, in series)", cmp,
                         ("GEMMs ms", "gemm_us"), ("colls ms", "collectives_us"))
    if sm.has_host_costs(gemm, coll, args.communicator):
        cmp = sm.compare_with_replay(sm.predict_replay_eager(gemm, coll, arch, args.tp, batches, args.communicator),
                                     replay, mode="eager")
        print_comparison("eager replay (model: host-paced walk: 02's and 03's host cost per call issue each op, "
                         "the GPU runs it at its cold-weights / CUDA-graph time once issued)", cmp,
                         ("host ms", "host_us"), ("GPU ms", "gpu_us"))
    else:
        print("\n(no host cost per call in 02/03's results: the host-paced eager model is not priced)")
    parts = replay[replay["mode"] == "cuda_graph"].pivot(index="batch", columns="variant", values="time_us") / 1e3
    print("\nreplay parts, CUDA graph (ms): full vs GEMMs alone + collectives alone")
    print(parts[["full", "gemm_only", "comm_only"]].round(2).to_string())


if __name__ == "__main__":
    main()
