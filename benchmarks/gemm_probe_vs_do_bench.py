"""Benchmark (GPU): decodescope's GEMM probe against triton.testing.do_bench on the same shapes.

Kimi-K2.5 at TP=8, decode batches 1..256, bf16 and fp8: our eager median (L2 flushed) next to
do_bench's median (which also flushes L2 before each call), and their ratio; plus one large bf16
GEMM against the ~790 TFLOP/s measured on an H200. One process, side by side.

python benchmarks/gemm_probe_vs_do_bench.py [--out results.json]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from decodescope.arch import gemm_shapes, normalize_config  # noqa: E402
from decodescope.probes.gemm import Flusher, make_gemm, measure  # noqa: E402

ROUNDS = 3
KIMI = Path(__file__).resolve().parents[1] / "params/models/kimi-k2.5.json"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = Flusher(dev)
    arch = normalize_config(json.loads(KIMI.read_text()))
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for s in gemm_shapes(arch, 8, b):
            if s.op in ("mla_w_uk", "mla_w_uv"):  # batched per-head products, not plain GEMMs
                continue
            for dt in ("bf16", "fp8"):
                shape = {"op": s.op, "batch": b, "m": s.m, "n": s.n, "k": s.k, "count": s.count, "dtype": dt}
                # Alternate the two methods ROUNDS times and take each one's median of medians, so a
                # clock or thermal drift between them does not read as a difference of method.
                ours_runs, ref_runs, r = [], [], None
                fn, _, _ = make_gemm(s.m, s.n, s.k, dt, dev)
                for _ in range(ROUNDS):
                    r = measure(shape, dev, iters=100, warmup=10, flush=flush, graph=False)
                    if r["status"] != "ok":
                        break
                    ours_runs.append(r["eager_time_us"])
                    ref_runs.append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
                if r["status"] != "ok":
                    rows.append(r)
                    continue
                r["eager_time_us"] = sorted(ours_runs)[ROUNDS // 2]
                ref = sorted(ref_runs)[ROUNDS // 2]
                r["do_bench_us"] = ref
                r["ratio_vs_do_bench"] = r["eager_time_us"] / ref
                rows.append(r)
                print(f"b={b:4d} {s.op:16s} {dt:4s} {s.m}x{s.n}x{s.k}: ours {r['eager_time_us']:8.2f} us  "
                      f"do_bench {ref:8.2f} us  ratio {r['ratio_vs_do_bench']:.3f}", flush=True)
    big = {"op": "large_bf16", "batch": 8192, "m": 8192, "n": 8192, "k": 8192, "count": 1, "dtype": "bf16"}
    r = measure(big, dev, iters=20, warmup=5, flush=flush, graph=False)
    fn, _, _ = make_gemm(8192, 8192, 8192, "bf16", dev)
    r["do_bench_us"] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    r["ratio_vs_do_bench"] = r["eager_time_us"] / r["do_bench_us"]
    r["tflops_eager"] = 2 * 8192 ** 3 / (r["eager_time_us"] * 1e-6) / 1e12
    r["ratio_vs_790"] = r["tflops_eager"] / 790.0
    rows.append(r)
    ok = [x for x in rows if "ratio_vs_do_bench" in x]
    within = sum(abs(x["ratio_vs_do_bench"] - 1) <= 0.05 for x in ok)
    print(f"\nlarge bf16 8192^3: {r['tflops_eager']:.0f} TFLOP/s = {r['ratio_vs_790']:.3f} x 790 "
          f"(do_bench on the same GEMM: {2 * 8192 ** 3 / (r['do_bench_us'] * 1e-6) / 1e12:.0f} TFLOP/s)")
    small = [x for x in ok if x["do_bench_us"] < 10.0]
    print(f"{sum(abs(x['ratio_vs_do_bench'] - 1) <= 0.05 for x in ok if x['do_bench_us'] >= 10.0)}/"
          f"{len(ok) - len(small)} shapes of 10 us or more within 5%; {len(small)} shapes under 10 us, where "
          "CUDA events' ~0.5 us resolution is itself 5%")
    print(f"{within}/{len(ok)} shapes within 5% of do_bench; ratio min {min(x['ratio_vs_do_bench'] for x in ok):.3f} "
          f"median {sorted(x['ratio_vs_do_bench'] for x in ok)[len(ok) // 2]:.3f} max {max(x['ratio_vs_do_bench'] for x in ok):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
