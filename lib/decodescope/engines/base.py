"""What decodescope needs of a serving engine, in one place: the seam every phase asks.

An engine is served over the OpenAI-compatible HTTP API, so 01's load generator speaks to any; the rest is
engine-specific, and each of these is one attribute or method of an Engine:
- launch: the server's command line for a model, its served names, host, port and tensor-parallel size; the
  environment variable that carries the API key (never argv); the distributions its version is read from;
- the profiler: how a launch turns the torch profiler on into a directory (by flag or environment, by
  version), the endpoints that start and stop a profiled window;
- health and model endpoints, and the Prometheus names behind the server-side figures (TTFT, TPOT, ITL,
  E2E and queue means, KV-cache usage, steps, generated tokens, speculative acceptance per position);
- its processes: the names it gives its engine core and workers (a run's teardown and /proc reading),
  where they bind their IPC sockets, and the compile caches they keep under TMPDIR;
- its log: the modes it states it runs with (CUDA graphs, compilation, async scheduling, the ops piecewise
  graphs leave to the host);
- its traces: the annotation that names a decode step (and its token counts), the file name of a rank's
  trace, the prefix of its custom ops;
- speculative decoding: the engine argument that carries a speculative config.
A second engine (SGLang) is one module like engines/vllm.py, registered in engines/__init__.py's ENGINES, and
its name in params (`server.engine`).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MetricNames:
    """The Prometheus samples behind the server-side figures; each tuple: alternatives, the first found wins."""

    prefix: str  # every sample of the engine's own starts with it
    histogram_means: dict = field(default_factory=dict)  # summary column -> sample bases
    kv_usage: tuple = ()  # a fraction
    engine_steps: str = ""  # one observation per engine iteration (step)
    generation_tokens: str = ""  # output tokens generated, a counter
    requests_running: str = ""  # a gauge
    requests_waiting: str = ""  # a gauge
    preemptions: str = ""  # a counter
    spec_drafts: str = ""  # speculative decoding counters: drafts proposed, draft tokens, accepted tokens
    spec_draft_tokens: str = ""
    spec_accepted_tokens: str = ""
    spec_accepted_per_pos: str = ""  # speculative decoding: accepted drafts per position, a counter


class Engine(ABC):
    """One serving engine (module docstring)."""

    name: str  # as params name it (server.engine)
    label: str  # as the report names it
    distributions: tuple  # the packages whose installed version is the engine's
    api_key_env: str
    health_path: str
    version_path: str
    profiler_env: tuple  # environment variables an older launch sets its profiler with
    models_path: str
    metrics_path: str
    profile_start_path: str
    profile_stop_path: str
    process_roles: tuple  # (process name prefix, role), role: "engine core" | "worker"
    # the environment variable naming the folder its processes bind their IPC sockets in, files it leaves
    # behind when it stops; a launch points it at the server's own temporary folder (its TMPDIR, removed
    # at teardown), should the engine's default not follow TMPDIR ("": it follows)
    socket_dir_env: str = ""
    # the folders its processes keep compile caches in under TMPDIR ("{user}": the user's name). A launch links
    # each, inside the server's own folder, to the one beside it that a server with the default TMPDIR uses,
    # so a start reuses what the one before compiled
    tmp_caches: tuple = ()
    metrics: MetricNames
    step_name: re.Pattern  # a decode step's annotation, its groups: context requests and tokens, generation ditto
    step_any: re.Pattern  # any step annotation the engine writes
    step_annotation_json: re.Pattern  # the step annotation as its trace's JSON spells it (bytes)
    custom_op_prefix: str
    default_splitting_ops: tuple  # the ops piecewise CUDA graphs leave to the host when the config does not say
    speculative_arg: str  # the engine argument a speculative config goes in

    @abstractmethod
    def server_argv(self, python: str, model: str, tokenizer: str, served_names: list[str], bind_host: str,
                    port: int, tensor_parallel: int) -> list[str]:
        """The server's command line, before the params' own engine arguments."""

    @abstractmethod
    def profiler_style(self, version: str) -> str:
        """How a launch of this engine version turns the profiler on: 'config' (a flag) or 'env'."""

    @abstractmethod
    def add_profiler(self, argv: list[str], env: dict, extra_env_keys: list[str], trace_dir: str, style: str,
                     with_stack: bool) -> None:
        """Point the launch's torch profiler at trace_dir (absolute), replacing any earlier setting."""

    @abstractmethod
    def step_label(self, context_requests: int, context_tokens: int, generation_requests: int,
                   generation_tokens: int) -> str:
        """A step's annotation as the engine writes it (step_name reads it back)."""

    @abstractmethod
    def version_of(self, body: str) -> str | None:
        """The engine's version from its version endpoint's body; None where it names none."""

    @abstractmethod
    def profiler_from_launch(self, argv: list[str], environ: dict | None = None) -> dict:
        """What a running server's command line (or environment) says of its profiler: {configured, profiler,
        torch_profiler_dir, torch_profiler_with_stack, source} (an attached server's, read in /proc)."""

    @abstractmethod
    def modes_from_log(self, log_text: str) -> list[Any]:
        """Each engine start's modes, in the order the log has them."""

    def is_own_metric(self, sample: str) -> bool:
        return sample.startswith(self.metrics.prefix)
