"""How a vLLM server is launched from params: its command line (engine flags, the run's alias, the
profiler flag of the vLLM version at hand) and environment (HF offline, the run token, the API key in
VLLM_API_KEY and never argv). decodescope.exec.server starts, watches and stops what this describes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from decodescope.exec import privatedirs, procs
from decodescope.schema.params import Params, redact
from decodescope.engines import DEFAULT_ENGINE, ENGINES, engine

# What launch_spec sets beyond server.env: the part of the server's environment that goes to an ssh host
# (which has its own environment otherwise).
HOST_ENV_KEYS = ("PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", procs.RUN_TOKEN_ENV, "TMPDIR",
                 *sorted({e.api_key_env for e in ENGINES.values()}),
                 *sorted({e.socket_dir_env for e in ENGINES.values() if e.socket_dir_env}))


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
    tmp_dir: str = ""  # its TMPDIR on its host: made before the start, removed at teardown
    # the engine's compile-cache folders under TMPDIR, linked from tmp_dir to beside it (Engine.tmp_caches;
    # on an ssh host by its supervisor, with its user)
    tmp_caches: list = field(default_factory=list)

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
    eng = engine(s.engine)
    argv = eng.server_argv(python, model, tokenizer, [params.model.name, alias_for(run_token)], s.bind_host, s.port,
                           s.tensor_parallel)
    argv += [_expand(a, model, placeholders or {}) for a in engine_flags(s.engine_args)]
    if s.cpus:  # the API server and engine core stay there; workers bind their threads by their own setting
        argv = ["taskset", "-c", s.cpus] + argv
    env = dict(os.environ)
    env.update({k: str(v) for k, v in s.env.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded at run time
    env["TRANSFORMERS_OFFLINE"] = "1"
    env[procs.RUN_TOKEN_ENV] = run_token  # every process of the server inherits it: teardown finds them
    # the tree's temporary files (vLLM's ZMQ sockets and its workers' init file, which it never removes) go
    # in a folder of its own, inside the one the server would have used. The engine's compile caches under
    # TMPDIR (Engine.tmp_caches: vLLM CPU keeps inductor's there) are linked from it to where that TMPDIR has
    # them, so they outlive the server; one the engine does not name (FA4's CuTe DSL kernels) lives one server long
    remote = host is not None and host.remote
    tmp_dir = privatedirs.server_tmp_dir(run_token,
                                         s.env.get("TMPDIR") or ("/tmp" if remote else tempfile.gettempdir()))
    env["TMPDIR"] = tmp_dir
    if eng.socket_dir_env:  # where it binds its sockets, should its default ever not follow TMPDIR
        env[eng.socket_dir_env] = tmp_dir
    extra_keys = list(s.env)
    if profiler_dir is not None:
        eng.add_profiler(argv, env, extra_keys, str(profiler_dir), profiler_style, params.profile.with_stack)
    env.pop(eng.api_key_env, None)
    if s.api_key:
        env[eng.api_key_env] = s.api_key  # argv is readable by every local user (ps); the environment is not
    return LaunchSpec(argv=argv, env=env, host=s.bind_host, port=s.port, api_key=s.api_key,
                      extra_env_keys=extra_keys, run_token=run_token, cpus=s.cpus, tmp_dir=tmp_dir,
                      tmp_caches=list(eng.tmp_caches))


def _expand(arg: str, model: str, placeholders: dict[str, str]) -> str:
    """An engine argument with its placeholders replaced by the directories they stand for."""
    for key, path in sorted(placeholders.items(), key=lambda kv: -len(kv[0])):
        arg = arg.replace(key, path)
    # "@model:" never starts a '@config:' key, so the served model's own placeholder goes last
    return arg.replace(SELF_MODEL, model) if SELF_MODEL in arg else arg


def add_profiler(argv: list[str], env: dict, extra_env_keys: list[str], profiler_dir: Path | str,
                 style: str, with_stack: bool = False, engine_name: str = DEFAULT_ENGINE) -> None:
    """Point the server's torch profiler at profiler_dir (absolute), replacing any earlier setting, as the
    engine takes it (decodescope.engines: vLLM's --profiler-config on >= 0.13, its environment before)."""
    engine(engine_name).add_profiler(argv, env, extra_env_keys, str(profiler_dir), style, with_stack)


def profiler_style_of(version: str, engine_name: str = DEFAULT_ENGINE) -> str:
    """'config' or 'env': how a launch of that engine version turns its profiler on (decodescope.engines)."""
    return engine(engine_name).profiler_style(version)


def profiler_style_for(params: Params, host=None) -> str:
    """profiler_style_of the engine version the server's interpreter has (here or on the ssh host)."""
    remote = host is not None and host.remote
    python = params.server.python or (host.python if remote else sys.executable)
    eng = engine(params.server.engine)
    code = ("import importlib.metadata as m\n"
            f"for n in {eng.distributions!r}:\n"
            "    try: print(m.version(n)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    try:
        argv = [python, "-c", code]
        out = (host.run(argv, timeout_s=60) if remote else
               subprocess.run(argv, capture_output=True, text=True, timeout=60)).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "config"
    return eng.profiler_style(out)
