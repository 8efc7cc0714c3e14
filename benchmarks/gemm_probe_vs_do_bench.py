"""Benchmark (GPU): decodescope's GEMM probe against triton.testing.do_bench on the same shapes.

Kimi-K2.5 at TP=8, decode batches 1..256, bf16 and fp8: our eager and CUDA-graph medians (L2 flushed)
next to do_bench's median (which also flushes L2 before each call), their ratios, and do_bench against
itself; plus one large bf16 GEMM against the ~790 TFLOP/s measured on an H200. One process, side by side.

python benchmarks/gemm_probe_vs_do_bench.py [--out results.json] [--max-us 10 --no-large]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from decodescope.model.arch import gemm_shapes, normalize_config  # noqa: E402
from decodescope.probes.gemm import Flusher, measure  # noqa: E402
from decodescope.probes.gemm_kernels import make_gemm  # noqa: E402

ROUNDS = 4
KIMI = Path(__file__).resolve().parents[1] / "params/models/kimi-k2.5.json"


def within(ratio: float, tol: float = 0.05) -> bool:
    return abs(ratio - 1) <= tol


def compare_shape(shape: dict, dev, flush) -> dict:
    """Alternates our probe and do_bench ROUNDS times (so a clock or thermal drift between them does
    not read as a difference of method) and takes each one's median over rounds. do_bench is also
    compared with itself (its even against its odd rounds): the reference's own repeatability."""
    fn, _, _ = make_gemm(shape["m"], shape["n"], shape["k"], shape["dtype"], dev)
    ours, graph, ref = [], [], []
    r = None
    for _ in range(ROUNDS):
        r = measure(shape, dev, iters=100, warmup=10, flush=flush, graph=True)
        if r["status"] != "ok":
            return r
        ours.append(r["eager_time_us"])
        graph.append(r.get("graph_time_us", float("nan")))
        ref.append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
    r["eager_time_us"], r["graph_time_us"], r["do_bench_us"] = map(statistics.median, (ours, graph, ref))
    r["ratio_vs_do_bench"] = r["eager_time_us"] / r["do_bench_us"]
    r["graph_ratio_vs_do_bench"] = r["graph_time_us"] / r["do_bench_us"]
    r["do_bench_self_ratio"] = statistics.mean(ref[0::2]) / statistics.mean(ref[1::2])
    return r


def compare_warm_graph(shape: dict, dev) -> dict:
    """Our graph timing without flushes against triton's CUDA-graph benchmark (which does not flush)."""
    fn, _, _ = make_gemm(shape["m"], shape["n"], shape["k"], shape["dtype"], dev)
    ours, ref = [], []
    for _ in range(ROUNDS):
        r = measure(shape, dev, iters=100, warmup=10, flush=None, graph=True)
        if r["status"] != "ok":
            return r
        ours.append(r["graph_time_us"])
        ref.append(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3)
    r["graph_time_us"], r["do_bench_cudagraph_us"] = statistics.median(ours), statistics.median(ref)
    r["ratio_vs_cudagraph"] = r["graph_time_us"] / r["do_bench_cudagraph_us"]
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--max-us", type=float, default=None,
                    help="only shapes that a first do_bench times under this (to study microsecond GEMMs)")
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--warm-graph", action="store_true",
                    help="instead: our CUDA-graph timing with L2 warm against triton's do_bench_cudagraph")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = Flusher(dev)
    arch = normalize_config(json.loads(KIMI.read_text()))
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for s in gemm_shapes(arch, 8, b):
            if s.op in ("mla_w_uk", "mla_w_uv"):  # batched per-head products, not plain GEMMs
                continue
            for dt in args.dtypes.split(","):
                shape = {"op": s.op, "batch": b, "m": s.m, "n": s.n, "k": s.k, "count": s.count, "dtype": dt}
                if args.max_us is not None:
                    fn, _, _ = make_gemm(s.m, s.n, s.k, dt, dev)
                    if fn is None or triton.testing.do_bench(fn, warmup=10, rep=20, return_mode="median") * 1e3 > args.max_us:
                        continue
                r = compare_warm_graph(shape, dev) if args.warm_graph else compare_shape(shape, dev, flush)
                if args.warm_graph:
                    rows.append(r)
                    if r["status"] != "ok":
                        continue
                    print(f"b={b:4d} {s.op:16s} {dt:4s} {s.m}x{s.n}x{s.k}: ours graph (L2 warm) {r['graph_time_us']:7.2f} us  "
                          f"do_bench_cudagraph {r['do_bench_cudagraph_us']:7.2f} us  ratio {r['ratio_vs_cudagraph']:.3f}", flush=True)
                    continue
                rows.append(r)
                if r["status"] != "ok":
                    continue
                print(f"b={b:4d} {s.op:16s} {dt:4s} {s.m}x{s.n}x{s.k}: ours eager {r['eager_time_us']:8.2f} us "
                      f"graph {r['graph_time_us']:8.2f} us  do_bench {r['do_bench_us']:8.2f} us  ratio eager "
                      f"{r['ratio_vs_do_bench']:.3f} graph {r['graph_ratio_vs_do_bench']:.3f}  do_bench vs itself "
                      f"{r['do_bench_self_ratio']:.3f}", flush=True)
    warm = [x for x in rows if "ratio_vs_cudagraph" in x]
    if warm:
        print(f"L2 warm, CUDA graph: {sum(within(x['ratio_vs_cudagraph']) for x in warm)}/{len(warm)} shapes within 5% of "
              f"do_bench_cudagraph; median ratio {statistics.median(x['ratio_vs_cudagraph'] for x in warm):.3f}")
    ok = [x for x in rows if "ratio_vs_do_bench" in x]
    for label, sel in (("10 us or more", [x for x in ok if x["do_bench_us"] >= 10.0]),
                       ("under 10 us", [x for x in ok if x["do_bench_us"] < 10.0])):
        if sel:
            print(f"{label}: {len(sel)} shapes; within 5% of do_bench: eager {sum(within(x['ratio_vs_do_bench']) for x in sel)}, "
                  f"graph {sum(within(x['graph_ratio_vs_do_bench']) for x in sel)}; do_bench within 5% of itself "
                  f"{sum(within(x['do_bench_self_ratio']) for x in sel)}; median ratio eager "
                  f"{statistics.median(x['ratio_vs_do_bench'] for x in sel):.3f} graph "
                  f"{statistics.median(x['graph_ratio_vs_do_bench'] for x in sel):.3f}")
    if not args.no_large:
        big = {"op": "large_bf16", "batch": 8192, "m": 8192, "n": 8192, "k": 8192, "count": 1, "dtype": "bf16"}
        r = measure(big, dev, iters=20, warmup=5, flush=flush, graph=False)
        fn, _, _ = make_gemm(8192, 8192, 8192, "bf16", dev)
        r["do_bench_us"] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        r["tflops_eager"] = 2 * 8192 ** 3 / (r["eager_time_us"] * 1e-6) / 1e12
        r["ratio_vs_790"] = r["tflops_eager"] / 790.0
        rows.append(r)
        print(f"large bf16 8192^3: {r['tflops_eager']:.0f} TFLOP/s = {r['ratio_vs_790']:.3f} x 790 "
              f"(do_bench on the same GEMM: {2 * 8192 ** 3 / (r['do_bench_us'] * 1e-6) / 1e12:.0f} TFLOP/s)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
