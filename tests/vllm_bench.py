"""vLLM's own per-request figures, read from a `vllm bench serve --save-result --save-detailed` file: what
the tests set our records' TPOT beside (decodescope reads only the summary, serving.bench_compare)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from decodescope.serving.bench_compare import BenchResultError
from decodescope.serving.metrics import tpot


def load_vllm_bench_requests(path: Path) -> pd.DataFrame:
    """Per-request rows of a `--save-detailed` result, in our names and units: ttft_us, e2e_us, tpot_us
    (vLLM's definition), itl_us (list), n_out, and send_ns / end_ns when the file has start times
    (vllm bench's perf_counter is CLOCK_MONOTONIC, the clock of our own send_ns)."""
    path = Path(path)
    doc = json.loads(path.read_text())
    missing = [k for k in ("ttfts", "latencies", "itls", "output_lens") if k not in doc]
    if missing:
        raise BenchResultError(f"{path}: no per-request {missing}: save it with `--save-result --save-detailed`")
    df = pd.DataFrame({"ttft_us": [t * 1e6 for t in doc["ttfts"]], "e2e_us": [t * 1e6 for t in doc["latencies"]],
                       "itl_us": [[x * 1e6 for x in l] for l in doc["itls"]], "n_out": doc["output_lens"]})
    if len(doc.get("start_times") or []) == len(df):
        df["send_ns"] = [t * 1e9 for t in doc["start_times"]]
        df["end_ns"] = df["send_ns"] + df["e2e_us"] * 1e3
    df = df[df["n_out"] > 0]  # failed requests have no output
    df["tpot_us"] = tpot(df["e2e_us"], df["ttft_us"], df["n_out"])
    return df.reset_index(drop=True)
