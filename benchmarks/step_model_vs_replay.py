"""The step model (decodescope.verdict.stepmodel, priced from the GEMM and collective micro-benchmarks) against
the step replay probe (probes/step.py: the same GEMMs and collectives in model order, measured whole).

    python benchmarks/step_model_vs_replay.py GEMM_RAW_JSON COLLECTIVES_DIR STEP_DIR PARAMS [--tp 8]

Defaults: the H200 results in benchmarks/results (Kimi-K2.5 TP=8 shapes per rank, bf16, two H200s over
NVLink, NCCL). Prints, per batch and timing, the prediction with its band, the replay, and their ratio.
"""
from __future__ import annotations

import argparse
import glob
from pathlib import Path

import pandas as pd

from decodescope.model import arch as archmod
from decodescope.micro import bench as mb
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import stepparts as sp
from decodescope.schema.params import load_params
from decodescope.schema.records_probe import read_probe_output, read_probe_rows

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


def print_host_refs(gemm, coll, communicator: str, replay) -> None:
    """The host speed (us per reference launch) each input was measured at: 02's, 03's, the replay's."""
    g = gemm["host_ref_us"].dropna() if "host_ref_us" in gemm else []
    c = sp.latency_curve(coll, communicator, sm.HOST_AFTER_GEMM)
    c = c["host_ref_us"].dropna() if "host_ref_us" in c else []
    print(f"host reference, us per launch: 02 median {pd.Series(g).median():.2f} (p10-p90 "
          f"{pd.Series(g).quantile(0.1):.2f}-{pd.Series(g).quantile(0.9):.2f}); 03 median {pd.Series(c).median():.2f}")
    r = replay[(replay["mode"] == "eager") & (replay["variant"] == "full")]
    print("replay (slowest rank per step, median): " + ", ".join(f"b{int(b)} {v:.2f}" for b, v in
                                                                 zip(r["batch"], r["host_ref_us"])))


def print_eager_parts(gemm, coll, arch, tp: int, batches, communicator: str, replay) -> None:
    """Model/replay of each eager variant the replay ran, each at its own host speed: where the full
    step's gap lies (in the GEMMs, in the collectives, or in their interleaving across ranks)."""
    variants = [v for v in ("gemm_only", "comm_only", "full")
                if not replay[(replay["mode"] == "eager") & (replay["variant"] == v)].empty]
    if variants == ["full"]:
        return
    cols = {}
    for v in variants:
        pred = sp.predict_replay_eager(gemm, coll, arch, tp, batches, communicator,
                                       host_ref_us=sp.replay_host_refs(replay, variant=v), variant=v)
        cmp = sp.compare_with_replay(pred, replay, mode="eager", variant=v)
        cols[v] = dict(zip(cmp["batch"], cmp["predicted_us"] / cmp["replay_us"]))
    print("\neager parts at each one's host speed, model/replay: " + ", ".join(variants))
    print(f"{'batch':>5} " + " ".join(f"{v:>10}" for v in variants))
    for b in batches:
        print(f"{b:>5} " + " ".join(f"{cols[v].get(b, float('nan')):>10.3f}" for v in variants))


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
    gemm = mb.gemm_table(read_probe_output(args.gemm, "gemm").rows, None)
    coll = mb.collectives_table(Path(args.collectives))
    rows = read_probe_rows(sorted(glob.glob(f"{args.step}/step_rank*.json")), "step")
    replay = mb.replay_table(rows)
    batches = sorted(replay["batch"].unique())
    print(f"step model vs step replay: {arch.model_type} TP={args.tp} shapes per rank, world size "
          f"{rows[0]['world_size']}, {args.communicator}")
    for timing, mode in (("cuda_graph", "cuda_graph"), ("back_to_back", "eager")):
        cmp = sp.compare_with_replay(sp.predict_replay(gemm, coll, arch, args.tp, batches, args.communicator, timing),
                                     replay, mode=mode)
        print_comparison(f"{mode} replay (model: GEMMs from 02 + {timing} collective latency, in series)", cmp,
                         ("GEMMs ms", "gemm_us"), ("colls ms", "collectives_us"))
    if sp.has_host_costs(gemm, coll, args.communicator):
        cmp = sp.compare_with_replay(sp.predict_replay_eager(gemm, coll, arch, args.tp, batches, args.communicator),
                                     replay, mode="eager")
        print_comparison("eager replay (model: host-paced walk: 02's and 03's host cost per call issue each op, "
                         "the GPU runs it at its cold-weights / CUDA-graph time once issued)", cmp,
                         ("host ms", "host_us"), ("GPU ms", "gpu_us"))
        refs = sp.replay_host_refs(replay)
        if refs:
            cmp = sp.compare_with_replay(sp.predict_replay_eager(gemm, coll, arch, args.tp, batches, args.communicator,
                                                                 host_ref_us=refs), replay, mode="eager")
            print_comparison("eager replay, the same walk at the replay's host speed (each host cost x the replay's "
                             "host reference / the one sampled beside it in 02/03)", cmp,
                             ("host ms", "host_us"), ("GPU ms", "gpu_us"))
            print("rescaled: " + ", ".join(f"b{r.batch} {'yes' if r.host_rescaled else 'no: ' + r.notes}"
                                            for r in cmp.itertuples()))
            print_host_refs(gemm, coll, args.communicator, replay)
            print_eager_parts(gemm, coll, arch, args.tp, batches, args.communicator, replay)
        else:
            print("\n(the replay sampled no host speed: the walk is not restated at it)")
    else:
        print("\n(no host cost per call in 02/03's results: the host-paced eager model is not priced)")
    parts = replay[replay["mode"] == "cuda_graph"].pivot(index="batch", columns="variant", values="time_us") / 1e3
    if {"gemm_only", "comm_only"} <= set(parts.columns):
        print("\nreplay parts, CUDA graph (ms): full vs GEMMs alone + collectives alone")
        print(parts[["full", "gemm_only", "comm_only"]].round(2).to_string())


if __name__ == "__main__":
    main()
