"""Benchmark: how faithfully decodescope's load generator and `vllm bench serve` measure TTFT, TPOT
and ITL at high concurrency, against the ground truth of a paced server's own log.

The paced server (benchmarks/paced_server.py) runs pinned to core 0 and writes one chunk to every
open stream each 20 ms; each client runs pinned to core 1. Per concurrency level and client, a fresh
server is started, 2 x concurrency requests of 32 output tokens are sent with at most `concurrency`
in flight, and the client's TTFT p50, TPOT p50 and ITL p99 are compared with the same figures from the
server's log (CLOCK_MONOTONIC, comparable across processes). One process runs everything, side by side.

python benchmarks/loadgen_fidelity.py [--levels 64,256,512] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

OUTPUT_TOKENS = 32
INPUT_TOKENS = 32
ITL_MS = 20.0

OURS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from decodescope.serving.sweep import SweepConfig, run_level, build_prompts
from decodescope.serving.client import run_async
from decodescope.serving.sweep import records_frame
from decodescope.serving.metrics import per_request
c, n = int(sys.argv[3]), int(sys.argv[4])
cfg = SweepConfig(base_url=sys.argv[2], model="m", endpoint="completions", levels=[c], input_tokens=%d,
                  output_tokens=%d, requests_per_level=n, warmup_requests=0, timeout_s=300)
prompts = run_async(build_prompts(cfg, 16))
recs, health = run_async(run_level(cfg, c, prompts))
df = per_request(records_frame(recs))
json.dump({"ttft_us": df["ttft_us"].tolist(), "tpot_us": df["tpot_us"].tolist(),
           "itl_us": [x for l in df["itl_us"] for x in l], "ok": int(df["ok"].sum()), "health": health},
          open(sys.argv[5], "w"))
""" % (INPUT_TOKENS, OUTPUT_TOKENS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["taskset", "-c", "0", sys.executable, str(ROOT / "benchmarks/paced_server.py"),
                             "--port", str(port), "--itl-ms", str(ITL_MS), "--log", str(log)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen, log: Path) -> list[dict]:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return json.loads(log.read_text())


def truth(log: list[dict]) -> dict:
    ttft = [(r["writes_ns"][0] - r["recv_ns"]) / 1e3 for r in log if r["writes_ns"]]
    tpot = [(r["writes_ns"][-1] - r["writes_ns"][0]) / 1e3 / (len(r["writes_ns"]) - 1)
            for r in log if len(r["writes_ns"]) > 1]
    itl = [d / 1e3 for r in log for d in np.diff(r["writes_ns"])]
    return summarise(ttft, tpot, itl)


def summarise(ttft, tpot, itl) -> dict:
    return {"ttft_p50_ms": float(np.percentile(ttft, 50)) / 1e3, "tpot_p50_ms": float(np.percentile(tpot, 50)) / 1e3,
            "itl_p99_ms": float(np.percentile(itl, 99)) / 1e3, "n": len(ttft)}


def run_ours(url: str, c: int, n: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    subprocess.run(["taskset", "-c", "1", sys.executable, "-c", OURS, str(ROOT / "lib"), url, str(c), str(n), str(out)],
                   check=True, timeout=900)
    d = json.loads(out.read_text())
    s = summarise([x for x in d["ttft_us"] if x == x], [x for x in d["tpot_us"] if x == x], d["itl_us"])
    s["ok"], s["health"] = d["ok"], d["health"]
    return s


def run_vllm_bench(url: str, c: int, n: int, tokenizer: str) -> dict:
    from decodescope.serving.bench_compare import run_vllm_bench_serve

    result = run_vllm_bench_serve(url, "m", tokenizer, c, INPUT_TOKENS, OUTPUT_TOKENS, n, Path(tempfile.mkdtemp()),
                                  "r.json", timeout_s=900, prefix=("taskset", "-c", "1"))
    d = json.loads(result.read_text())
    ttft = [t * 1e6 for t in d["ttfts"]]
    itl = [x * 1e6 for l in d["itls"] for x in l]
    tpot = [(e - t) / (o - 1) * 1e6 for e, t, o in zip(d.get("e2els", []) or [], d["ttfts"], d["output_lens"]) if o > 1] \
        if d.get("e2els") else [d["median_tpot_ms"] * 1e3]
    s = summarise(ttft, tpot, itl)
    s["ok"] = d["completed"]
    return s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="64,256,512")
    ap.add_argument("--out")
    args = ap.parse_args()
    from decodescope.exec.modeldir import build_dummy_model_dir

    tokenizer = str(build_dummy_model_dir(json.loads((ROOT / "params/models/tiny-qwen3-moe.json").read_text()),
                                          ROOT / "outputs/.cache", "tiny-qwen3-moe"))
    rows = []
    for c in [int(x) for x in args.levels.split(",")]:
        for tool in ("decodescope", "vllm bench serve"):
            log = Path(tempfile.mkstemp(suffix=".truth.json")[1])
            proc, url = start_server(log)
            try:
                got = run_ours(url, c, 2 * c) if tool == "decodescope" else run_vllm_bench(url, c, 2 * c, tokenizer)
            finally:
                t = stop_server(proc, log)
            tr = truth(t)
            row = {"concurrency": c, "client": tool, **{f"client_{k}": v for k, v in got.items() if k != "health"},
                   **{f"truth_{k}": v for k, v in tr.items()},
                   "ttft_p50_err_ms": got["ttft_p50_ms"] - tr["ttft_p50_ms"],
                   "tpot_p50_err_ms": got["tpot_p50_ms"] - tr["tpot_p50_ms"],
                   "itl_p99_err_ms": got["itl_p99_ms"] - tr["itl_p99_ms"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nclient on core 1, paced server on core 0, true ITL 20 ms, 2 x c requests of 32 tokens per level")
    print("| c | client | TTFT p50 ms (truth) | err | TPOT p50 ms (truth) | err | ITL p99 ms (truth) | err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['client']} | {r['client_ttft_p50_ms']:.1f} ({r['truth_ttft_p50_ms']:.1f}) | "
              f"{r['ttft_p50_err_ms']:+.1f} | {r['client_tpot_p50_ms']:.2f} ({r['truth_tpot_p50_ms']:.2f}) | "
              f"{r['tpot_p50_err_ms']:+.2f} | {r['client_itl_p99_ms']:.1f} ({r['truth_itl_p99_ms']:.1f}) | "
              f"{r['itl_p99_err_ms']:+.1f} |")
    ours512 = [r for r in rows if r["client"] == "decodescope" and r["concurrency"] == max(int(x) for x in args.levels.split(","))]
    if ours512:
        r = ours512[0]
        print(f"\ngoal at c={r['concurrency']}: TTFT p50 |err| {abs(r['ttft_p50_err_ms']):.1f} ms (<= 5), "
              f"ITL p99 |err| {abs(r['itl_p99_err_ms']):.1f} ms (<= 2)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
