"""Large bf16 GEMM (8192^3) through the GEMM probe and through triton.testing.do_bench, side by side,
against the ~790 TFLOP/s the device notes report for an H200 (one process, three alternations)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import torch  # noqa: E402
import triton.testing  # noqa: E402

from decodescope.probes.gemm import Flusher, measure  # noqa: E402
from decodescope.probes.gemm_kernels import make_gemm  # noqa: E402

dev = torch.device("cuda")
flush = Flusher(dev)
shape = {"op": "large_bf16", "batch": 8192, "m": 8192, "n": 8192, "k": 8192, "count": 1, "dtype": "bf16"}
fn, _, _ = make_gemm(8192, 8192, 8192, "bf16", dev)
flops = 2 * 8192 ** 3
for i in range(3):
    ours = measure(shape, dev, iters=50, warmup=10, flush=flush, graph=False)["eager_time_us"]
    ref = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median") * 1e3
    print(f"round {i}: probe {flops / ours / 1e6:.0f} TFLOP/s ({flops / ours / 1e6 / 790:.3f} x 790), "
          f"do_bench {flops / ref / 1e6:.0f} TFLOP/s, probe/do_bench time ratio {ours / ref:.3f}", flush=True)
