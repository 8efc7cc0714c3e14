"""/metrics texts exactly as the installed vLLM's own Prometheus stat logger exposes them, without a server.

vLLM's API server serves `prometheus_client`'s exposition of the metrics that
`vllm.v1.metrics.loggers.PrometheusStatLogger` registers and updates from the engine's stats. This builds
that logger (with a stand-in config: a served model name, speculative decoding on, no connectors),
exposes the registry once, records one batch of scheduler and iteration stats with known values (the
engine's own stats classes), and exposes it again. The two texts and the values recorded go to OUT_DIR:

    scrape_0.txt  scrape_1.txt  truth.json

python tests/make_vllm_metrics.py tests/fixtures/vllm_metrics   (tests/fixtures/vllm_metrics holds a copy
made with vLLM 0.32; tests/test_telemetry.py checks the parser on it and, where vLLM is installed,
on a fresh one.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

TRUTH = {
    "served_model_name": "tiny-moe",
    "running": 3, "waiting": 1, "kv_cache_usage": 0.25, "preemptions": 2,
    "ttft_s": [0.052, 0.071],
    "itl_s": [0.011, 0.013, 0.012, 0.018],
    "tpot_s": [0.0125, 0.0205],
    "e2e_s": [0.9, 1.3],
    "spec": {"num_spec_tokens": 3, "num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 18},
}


def make(out_dir: Path) -> dict:
    from prometheus_client import REGISTRY, generate_latest

    import vllm
    from vllm.config import ObservabilityConfig
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    t = TRUTH
    spec = t["spec"]
    cfg = NS(model_config=NS(served_model_name=t["served_model_name"], max_model_len=2048, is_diffusion=False),
             observability_config=ObservabilityConfig(),
             speculative_config=NS(num_speculative_tokens=spec["num_spec_tokens"]),
             kv_transfer_config=None, ec_transfer_config=None, lora_config=None, watermark_config=None,
             cache_config=NS(num_gpu_blocks=1000), parallel_config=NS())
    logger = PrometheusStatLogger(cfg, [0])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scrape_0.txt").write_bytes(generate_latest(REGISTRY))

    sd = SpecDecodingStats.new(spec["num_spec_tokens"])
    sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens = (spec["num_drafts"], spec["num_draft_tokens"],
                                                                  spec["num_accepted_tokens"])
    sched = SchedulerStats(num_running_reqs=t["running"], num_waiting_reqs=t["waiting"],
                           kv_cache_usage=t["kv_cache_usage"], spec_decoding_stats=sd)
    it = IterationStats()
    it.num_preempted_reqs = t["preemptions"]
    it.num_generation_tokens = 40
    it.time_to_first_tokens_iter = list(t["ttft_s"])
    it.inter_token_latencies_iter = list(t["itl_s"])
    it.finished_requests = [FinishedRequestStats(finish_reason=FinishReason.LENGTH, e2e_latency=e2e,
                                                 num_prompt_tokens=64, num_generation_tokens=32,
                                                 mean_time_per_output_token=tpot)
                            for tpot, e2e in zip(t["tpot_s"], t["e2e_s"])]
    logger.record(sched, it, engine_idx=0)
    (out_dir / "scrape_1.txt").write_bytes(generate_latest(REGISTRY))
    truth = {**t, "vllm_version": vllm.__version__}
    (out_dir / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    return truth


if __name__ == "__main__":
    make(Path(sys.argv[1]))
