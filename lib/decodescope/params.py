"""The params schema: one YAML file describes a campaign (host, server, model, workload, probes).

`load_params(path)` validates everything at once and raises one `ParamsError` listing every problem
with the file, the dotted field path and what would be valid, before anything expensive starts.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decodescope.phases import PHASES, SERVER_PHASES
# Secret-looking keys: HF_TOKEN, api_key, AUTH-TOKEN, password... but not input_tokens or tokenizer.
SECRET_KEY_PATTERN = re.compile(
    r"(api[_-]?key|access[_-]?key|(^|[_\-.])(token|secret|password|passwd|authorization|credentials?)($|[_\-.]))", re.I)
REDACTED = "***redacted***"


class ParamsError(ValueError):
    """Every problem found in one params file, each with its dotted field path."""

    def __init__(self, path: Path | str, problems: list[tuple[str, str]]):
        self.path = str(path)
        self.problems = problems
        lines = [f"{self.path}: {len(problems)} problem(s) in the params file"]
        lines += [f"  - {field or '<top level>'}: {msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


def _at_least(lo: float, what: str = "must be"):
    def check(v):
        if v < lo:
            raise ValueError(f"{what} >= {lo}, got {v}")
        return v
    return AfterValidator(check)


def _positive(v: float) -> float:
    if v <= 0:
        raise ValueError(f"must be > 0, got {v}")
    return v


def _cpulist(v: Optional[str]) -> Optional[str]:
    if v is not None and not CPULIST.fullmatch(v):
        raise ValueError(f"{v!r} is not a list of cores; write it as taskset -c does, e.g. '1', '2-3' or '0,4-7'")
    return v


CPULIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
CpuList = Annotated[Optional[str], AfterValidator(_cpulist)]
AtLeastOne = Annotated[int, _at_least(1)]
NonNegative = Annotated[int, _at_least(0)]
Positive = Annotated[float, AfterValidator(_positive)]


RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


def check_run_name(name: str) -> str:
    """A run name becomes a directory name and appears in the report: letters, digits and . _ + -
    only (no '/', spaces, control characters or markup)."""
    if not RUN_NAME_PATTERN.match(name):
        raise ValueError(f"{name!r} cannot be a run name: it names the run directory, so use 1-100 letters, "
                         "digits, '.', '_', '+' or '-' (starting with a letter or digit), e.g. 'kimi-tp8'")
    return name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunParams(_Section):
    name: Optional[str] = Field(None, description="run name; defaults to the params file's stem")
    output_dir: str = Field("outputs", description="where run directories are made, relative to the repo")
    phases: Optional[list[str]] = Field(None, description="phases to run, in order; default: every "
                                        "notebook in notebooks/")

    @field_validator("name")
    @classmethod
    def _file_name(cls, name: Optional[str]) -> Optional[str]:
        if name is not None:
            check_run_name(name)
        return name

    @field_validator("phases")
    @classmethod
    def _known_phases(cls, phases: Optional[list[str]]) -> Optional[list[str]]:
        if phases is None:
            return phases
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise ValueError(f"unknown phase(s) {unknown}; valid: {list(PHASES)}")
        return phases


class ServerParams(_Section):
    mode: Literal["launch", "attach"] = "launch"
    url: Optional[str] = Field(None, description="base URL of a running server (attach mode)")
    bind_host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel: Annotated[int, _at_least(1, "tensor_parallel must be")] = 1
    python: Optional[str] = Field(None, description="interpreter that has vllm; defaults to this one")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM CLI flags, without --")
    env: dict[str, str] = Field(default_factory=dict)
    cpus: CpuList = Field(None, description="the cores the server's processes start on (taskset -c), e.g. '1': "
                          "vLLM's CPU workers then bind their threads where VLLM_CPU_OMP_THREADS_BIND says, "
                          "and the API server and engine core stay off them. None: wherever the OS puts them")
    startup_timeout_s: Positive = 900.0
    api_key: Optional[str] = None

    @field_validator("port")
    @classmethod
    def _port_range(cls, port: int) -> int:
        if not 1 <= port <= 65535:
            raise ValueError(f"{port} is not a TCP port; use 1..65535")
        return port

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, url: Optional[str]) -> Optional[str]:
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"{url!r} is not an http(s) URL like http://127.0.0.1:8000")
        return url


class ModelParams(_Section):
    name: str
    config: str = Field(..., description="HF config.json of the architecture, relative to the params file")
    path: Optional[str] = Field(None, description="weights directory or HF id as the server sees it; "
                                "None: a local dir is built from `config` (dummy weights)")
    tokenizer: str = Field("train", description="'train' (local byte-level BPE, dummy weights), 'model' "
                           "(the server loads it from `path`) or a local tokenizer directory")
    weight_dtype: Literal["bf16", "fp16", "fp8", "int4"] = Field(
        "bf16", description="dtype of the quantized weights: the routed experts' in a MoE model (e.g. int4 "
        "for Kimi-K2.5 INT4; the other layers count as bf16), every linear layer but lm_head in a dense "
        "one; sets the weight bytes of the step's memory floor (02_gemm). int4 counts a bf16 scale per "
        "32 weights (decodescope.dtypes)")


class SloParams(_Section):
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2e_ms: Optional[float] = None


class WorkloadParams(_Section):
    endpoint: Literal["completions", "chat"] = "completions"
    concurrency: list[int] = Field(default_factory=lambda: [1, 2, 4])
    repeats: Annotated[int, _at_least(1, "repeats must be")] = Field(
        1, description="each level measured this many times (the whole sweep, then again): levels then show "
                       "the median and a 95% band, and compare says whether a difference is above the noise")
    input_tokens: AtLeastOne = 64
    output_tokens: AtLeastOne = 32
    requests_per_level: AtLeastOne = 8
    warmup_requests: NonNegative = Field(2, description="untimed requests before each level, at least one per "
                                         "concurrent slot (serving.sweep.warmup_count); 0: none")
    request_timeout_s: Positive = 300.0
    seed: int = 0
    request_rate: Optional[float] = Field(None, description="requests/s (open loop); None: closed loop at "
                                          "each concurrency level. The level is then the concurrency cap")
    burstiness: float = Field(1.0, description="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    compare_with: list[str] = Field(default_factory=list, description="`vllm bench serve --save-result` JSON "
                                    "files to show beside our levels (relative to the params file)")
    slo: SloParams = Field(default_factory=SloParams)
    telemetry_interval_s: float = Field(1.0, description="seconds between samples of the server's /metrics "
                                        "(and NVML on a GPU host) during each level; 0 turns telemetry off")

    @field_validator("telemetry_interval_s")
    @classmethod
    def _telemetry_interval(cls, v: float) -> float:
        if v != 0 and v < 0.1:
            raise ValueError(f"telemetry_interval_s must be 0 (off) or at least 0.1 s (each sample costs the "
                             f"server's API process a /metrics render), got {v}")
        return v

    @field_validator("request_rate")
    @classmethod
    def _rate_positive(cls, r: Optional[float]) -> Optional[float]:
        if r is not None and r <= 0:
            raise ValueError(f"request_rate must be > 0 requests/s (or omitted), got {r}")
        return r

    @field_validator("burstiness")
    @classmethod
    def _burst_positive(cls, b: float) -> float:
        if b <= 0:
            raise ValueError(f"burstiness (gamma shape) must be > 0, got {b}")
        return b

    @field_validator("concurrency")
    @classmethod
    def _levels_positive(cls, levels: list[int]) -> list[int]:
        if not levels:
            raise ValueError("needs at least one concurrency level, e.g. [1, 4, 16]")
        bad = [c for c in levels if c < 1]
        if bad:
            raise ValueError(f"concurrency levels must be >= 1, got {bad}")
        return levels


class MicrobenchParams(_Section):
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    dtypes: list[Literal["bf16", "fp16", "fp32", "fp8", "int4"]] = Field(default_factory=lambda: ["bf16"])
    iterations: int = 20
    warmup: int = 5
    world_size: Optional[int] = Field(None, description="ranks for the collective probe; default: TP")
    sweep_max_bytes: int = 1 << 24
    sweep_min_bytes: int = 1024
    all_to_all_tokens: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    expert_parallel: int = Field(1, description="EP size for all-to-all volumes (1: TP only)")
    context_tokens: AtLeastOne = Field(1024, description="tokens of context each sequence attends to: the "
                                       "KV-cache bytes of the step's memory floor (02_gemm)")
    moe_skew: float = Field(0.0, description="0 uniform routing; towards 1 all tokens pick the same experts")
    flush_l2: bool = True
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = Field(None, description="host:port of torchrun's rendezvous (multi-node)")
    probe_timeout_s: float = 1800.0

    @field_validator("batches")
    @classmethod
    def _batches_positive(cls, batches: list[int]) -> list[int]:
        if not batches or any(b < 1 for b in batches):
            raise ValueError(f"batches must be a non-empty list of integers >= 1, got {batches}")
        return batches


KNEE = "knee"


class ProfileParams(_Section):
    requests: AtLeastOne = 4
    concurrency: list[Union[int, str]] = Field(
        default_factory=lambda: [1, KNEE],
        description="levels to profile, one capture each, so the step's growth with load is measured; "
                    "'knee' is 01's knee (the level after which throughput grows < 10%; its highest "
                    "level when throughput still grows; left out when 01 did not run). A single integer is one level")
    input_tokens: AtLeastOne = 32
    output_tokens: AtLeastOne = 16
    warmup_requests: NonNegative = Field(2, description="untimed requests before each level, at least one per "
                                         "concurrent slot (serving.sweep.warmup_count); 0: none")
    flush_timeout_s: Positive = 600.0
    @field_validator("concurrency", mode="before")
    @classmethod
    def _levels(cls, v):
        levels = v if isinstance(v, list) else [v]
        if not levels:
            raise ValueError(f"needs at least one level, e.g. [1, {KNEE}]")
        for x in levels:
            if not ((isinstance(x, int) and not isinstance(x, bool) and x >= 1) or x == KNEE):
                raise ValueError(f"{x!r} is not a level: each must be an integer >= 1 or {KNEE!r}, e.g. [1, {KNEE}]")
        return levels

    # Python stacks in the worker traces: the analysis does not read them, and every spin of a waiting
    # worker becomes events (a 15 s window reached 40 MB gzipped per rank and an OOM kill on 2 cores).
    with_stack: bool = False


class WhatIfParams(_Section):
    """What the verdict projects beyond what the measurements name (05_verdict)."""

    tensor_parallel: list[Annotated[int, _at_least(1)]] = Field(
        default_factory=list, description="other tensor-parallel sizes to project, with replicas keeping the "
        "GPU count; 02 also measures their GEMM shapes (first dtype only)")
    spec_k: list[Annotated[int, _at_least(1)]] = Field(default_factory=lambda: [1, 3],
                                                       description="draft tokens per verify step")
    spec_alpha: list[float] = Field(default_factory=lambda: [0.5, 0.7, 0.9],
                                    description="per-token acceptance rates, each in [0, 1)")
    allreduce_us: list[Annotated[float, AfterValidator(_positive)]] = Field(
        default_factory=list, description="given per-call all-reduce latencies to project (e.g. a vendor's figure)")

    @field_validator("spec_alpha")
    @classmethod
    def _alphas(cls, v: list[float]) -> list[float]:
        bad = [a for a in v if not 0.0 <= a < 1.0]
        if bad:
            raise ValueError(f"acceptance rates must be in [0, 1), got {bad}")
        return v


class ExperimentParams(_Section):
    """One variant of the campaign: the server (and optionally the workload) changed, measured by the
    serving sweep (and the profile when asked) into variants/<name>/ of the same run directory."""

    name: str = Field(..., description="a file name: letters, digits and . _ + -")
    tensor_parallel: Optional[Annotated[int, _at_least(1, "tensor_parallel must be")]] = None
    engine_args: dict[str, Any] = Field(default_factory=dict, description="merged over server.engine_args; "
                                        "a value of null removes the flag")
    env: dict[str, Optional[str]] = Field(default_factory=dict, description="merged over server.env; null removes")
    cpus: CpuList = Field(None, description="replaces server.cpus")
    workload: dict[str, Any] = Field(default_factory=dict, description="keys of workload to override")
    profile: bool = Field(False, description="also profile this variant (04_profile)")

    @field_validator("name")
    @classmethod
    def _file_name(cls, name: str) -> str:
        check_run_name(name)
        return name


class PeakOverrides(_Section):
    bf16_tflops: Optional[float] = Field(None, description="dense bf16/fp16 tensor-core peak")
    fp8_tflops: Optional[float] = None
    int4_tflops: Optional[float] = Field(None, description="the int4 GEMMs' compute roofline; default: the "
                                         "bf16 peak (W4A16 kernels dequantize the weights and multiply in 16-bit)")
    fp32_tflops: Optional[float] = Field(None, description="the fp32 GEMMs' compute roofline; default: none "
                                         "(datasheets list tensor-core peaks; on a CPU host the measured matmul)")
    mem_gbps: Optional[float] = None
    link_gbps: Optional[float] = None


class HardwareParams(_Section):
    gpu: Optional[str] = Field(None, description="GPU model name to use for peaks, e.g. 'H200'")
    peaks: PeakOverrides = Field(default_factory=PeakOverrides)


SSH_URL = re.compile(r"^ssh://(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])"
                     r"(?::(?P<port>\d{1,5}))?/?$")


def parse_host_url(url: str) -> Optional[dict]:
    """'ssh://user@gpu-box:2222' -> {'user': 'user', 'host': 'gpu-box', 'port': 2222}; 'local' -> None.
    Raises ValueError saying what a valid host is."""
    if url == "local":
        return None
    m = SSH_URL.match(url)
    if not m:
        raise ValueError(f"{url!r} is not a host; valid: 'local' or 'ssh://[user@]host[:port]', e.g. "
                         "'ssh://me@gpu-box' or 'ssh://root@10.0.0.5:2222'")
    port = int(m.group("port")) if m.group("port") else None
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{url!r}: {port} is not a TCP port; use 1..65535")
    return {"user": m.group("user"), "host": m.group("host").strip("[]"), "port": port}


class HostParams(_Section):
    """Where the server, the probes and the profile capture run (`host: local`, or `host:
    ssh://user@gpu-box[:port]` as a shorthand for `host: {url: ...}`); the notebooks, the analysis and
    the report always run here (decodescope.host)."""
    url: str = Field("local", description="'local' or ssh://[user@]host[:port]; user and port default to "
                     "the user's ssh config")
    python: Optional[str] = Field(None, description="interpreter on the host that has decodescope[gpu]; "
                                  "default: this one (local) or python3 (ssh)")
    workdir: str = Field("~/decodescope-runs", description="where run directories are mirrored on an ssh host")
    identity: Optional[str] = Field(None, description="private key file (ssh -i); default: the user's ssh "
                                    "config and agent")
    known_hosts: Optional[str] = Field(None, description="known_hosts file; default: the user's "
                                       "(~/.ssh/known_hosts). Unknown host keys are refused, never prompted")
    ssh_config: Optional[str] = Field(None, description="ssh config file (ssh -F); default: ~/.ssh/config")
    ssh_options: dict[str, str] = Field(default_factory=dict, description="extra ssh -o options, "
                                        "e.g. {ProxyJump: bastion}")
    connect_timeout_s: Positive = Field(20.0, description="ssh ConnectTimeout and the wait for the connection")
    heartbeat_timeout_s: Positive = Field(60.0, description="the host tears down what decodescope started "
                                          "there when it hears nothing from this side for this long")
    sync_interval_s: Positive = Field(2.0, description="how often result files are copied back while a "
                                      "process runs there")
    loadgen: Literal["local", "remote"] = Field("local", description="where the serving load generator runs: "
                                                 "here (through the tunnel: the network is measured too) or on "
                                                 "the host (its records copied back)")
    trace_dir: Optional[str] = Field(None, description="server.mode attach: where the attached server writes "
                                     "its profiler traces on the host and on each of host.nodes (its "
                                     "--profiler-config torch_profiler_dir); copied into traces/node<i>/ during "
                                     "the profile")
    nodes: list[str] = Field(default_factory=list, description="more hosts (ssh URLs or 'local') for the "
                             "multi-node probes: one torchrun agent each, node ranks 1.. in this order; "
                             "needs microbench.rdzv_endpoint")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        parse_host_url(url)
        return url

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, nodes: list[str]) -> list[str]:
        for n in nodes:
            parse_host_url(n)
        return nodes

    @field_validator("ssh_options")
    @classmethod
    def _no_prompting(cls, opts: dict[str, str]) -> dict[str, str]:
        bad = [k for k in opts if k.lower() in ("batchmode", "controlpath", "controlmaster", "controlpersist")]
        if bad:
            raise ValueError(f"{bad} are set by decodescope (BatchMode=yes so ssh never prompts; one "
                             "ControlMaster connection per run); remove them")
        return opts

    @property
    def is_remote(self) -> bool:
        return self.url != "local"

    def __str__(self) -> str:
        return self.url


class Params(_Section):
    run: RunParams = Field(default_factory=RunParams)
    host: HostParams = Field(default_factory=HostParams)
    server: ServerParams = Field(default_factory=ServerParams)
    model: ModelParams
    workload: WorkloadParams = Field(default_factory=WorkloadParams)
    microbench: MicrobenchParams = Field(default_factory=MicrobenchParams)
    profile: ProfileParams = Field(default_factory=ProfileParams)
    whatif: WhatIfParams = Field(default_factory=WhatIfParams)
    experiments: list[ExperimentParams] = Field(default_factory=list, description="variants measured after the "
                                                "baseline, each into variants/<name>/")
    hardware: HardwareParams = Field(default_factory=HardwareParams)

    # Paths inside the file are relative to the file; these are filled in by load_params.
    source_path: Optional[str] = Field(None, exclude=True)

    def resolve(self, relative: str) -> Path:
        base = Path(self.source_path).parent if self.source_path else Path.cwd()
        p = Path(os.path.expanduser(relative))
        return p if p.is_absolute() else (base / p).resolve()

    @property
    def run_name(self) -> str:
        return self.run.name or (Path(self.source_path).stem if self.source_path else "run")

    def projected_tensor_parallel(self) -> list[int]:
        """Tensor-parallel sizes the verdict projects: whatif.tensor_parallel and every variant's."""
        sizes = set(self.whatif.tensor_parallel) | {e.tensor_parallel for e in self.experiments if e.tensor_parallel}
        return sorted(sizes - {self.server.tensor_parallel})

    def model_config_dict(self) -> dict:
        return json.loads(self.resolve(self.model.config).read_text())

    def output_root(self) -> Path:
        """Output dirs are relative to the repository (the params file's grandparent for params/)."""
        p = Path(os.path.expanduser(self.run.output_dir))
        if p.is_absolute():
            return p
        return (_repo_root_of(self.source_path) / p).resolve()


# Who reads each key: phases, or RUNNER (the runner itself, whatever phases run). The longest dotted
# prefix that names a key decides. tests/test_params.py checks every key of the schema is listed here,
# so a key nothing reads cannot come back unnoticed; `decodescope params validate` warns about keys a
# file sets that none of the phases it runs reads.
RUNNER = "runner"
_SERVER_PHASES = tuple(p for p in PHASES if p in SERVER_PHASES)  # the runner starts (or attaches to) the server for these
READERS: dict[str, tuple[str, ...]] = {
    "run": (RUNNER,),
    "host": (RUNNER,),
    "host.loadgen": ("01_serving",),
    "host.nodes": ("03_collectives", "04_profile"),
    "host.trace_dir": ("04_profile",),
    "server": _SERVER_PHASES,
    "server.tensor_parallel": (*_SERVER_PHASES, "02_gemm", "03_collectives"),  # the probes' shapes, ranks
    "model.name": _SERVER_PHASES,
    "model.path": _SERVER_PHASES,
    "model.tokenizer": _SERVER_PHASES,
    "model.config": (*_SERVER_PHASES, "02_gemm", "03_collectives"),
    "model.weight_dtype": ("02_gemm",),
    "workload": ("01_serving",),
    "workload.request_timeout_s": ("01_serving", "04_profile"),  # the profiled requests use them too
    "workload.seed": ("01_serving", "04_profile"),
    "microbench.batches": ("02_gemm", "03_collectives"),
    "microbench.dtypes": ("02_gemm",),
    "microbench.iterations": ("02_gemm", "03_collectives"),
    "microbench.warmup": ("02_gemm", "03_collectives"),
    "microbench.world_size": ("03_collectives",),
    "microbench.sweep_max_bytes": ("03_collectives",),
    "microbench.sweep_min_bytes": ("03_collectives",),
    "microbench.all_to_all_tokens": ("03_collectives",),
    "microbench.expert_parallel": ("02_gemm", "03_collectives"),
    "microbench.context_tokens": ("02_gemm",),
    "microbench.moe_skew": ("02_gemm",),
    "microbench.flush_l2": ("02_gemm",),
    "whatif": ("05_verdict",),
    "experiments": (RUNNER,),
    "whatif.tensor_parallel": ("02_gemm", "05_verdict"),
    "microbench.nnodes": ("03_collectives",),
    "microbench.node_rank": ("03_collectives",),
    "microbench.rdzv_endpoint": ("03_collectives",),
    "microbench.probe_timeout_s": ("02_gemm", "03_collectives"),
    "profile": ("04_profile",),
    "profile.concurrency": ("04_profile", "05_verdict"),
    "hardware": ("00_host", "02_gemm"),
}
# Keys that were once in the schema and that nothing reads any more: a file that still sets one loads
# (the key is dropped) and `params validate` warns, saying what to use instead.
RETIRED_KEYS: dict[str, str] = {
    "model.dtype": "the server's dtype is server.engine_args.dtype",
    "hardware.gpu_count": "00_host counts the GPUs",
    "hardware.interconnect": "00_host reads the links from nvidia-smi topo -m",
}


def readers_of(key: str) -> tuple[str, ...]:
    """The phases (or RUNNER) that read a dotted key; () when none does."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = READERS.get(".".join(parts[:n]))
        if found is not None:
            return found
    return ()


def schema_keys(model: Optional[type[BaseModel]] = None, prefix: str = "", required: bool = False) -> list[str]:
    """Every leaf key of the schema, dotted (sections are walked into); with `required`, only those a
    file must set."""
    model = model or Params
    keys = []
    for name, field in model.model_fields.items():
        if name == "source_path" or (required and not field.is_required()):
            continue
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += schema_keys(sub, f"{prefix}{name}.", required)
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _file_keys(raw: dict, model: type[BaseModel], prefix: str = "") -> list[str]:
    """The leaf keys a file sets, dotted, as far as the schema knows them (unknown keys are errors)."""
    keys = []
    for name, value in raw.items():
        field = model.model_fields.get(str(name))
        dotted = f"{prefix}{name}"
        if field is None:
            keys.append(dotted)
            continue
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and isinstance(value, dict):
            keys += _file_keys(value, sub, dotted + ".")
        else:
            keys.append(dotted)
    return keys


def _pop_retired(raw: dict) -> list[str]:
    """Removes the retired keys a raw mapping sets; returns them, dotted."""
    found = []
    for key in RETIRED_KEYS:
        section, _, leaf = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and leaf in holder:
            del holder[leaf]
            found.append(key)
    return found


def unread_keys(path: str | Path) -> list[tuple[str, str]]:
    """(dotted key, why) for each key the file sets that no phase it runs reads: retired keys, and keys
    only phases outside `run.phases` read. For `params validate`, after load_params accepted the file."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        return []
    out = [(k, f"it was removed: {RETIRED_KEYS[k]}") for k in _pop_retired(raw)]
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    phases = set(run.get("phases") or PHASES) | {RUNNER}
    required = set(schema_keys(required=True))  # a file cannot leave these out, so no warning
    for key in _file_keys(raw, Params):
        readers = readers_of(key)
        if readers and key not in required and not phases.intersection(readers):
            out.append((key, f"read only by {', '.join(readers)}, which run.phases leaves out"))
    return out


def _repo_root_of(source_path: Optional[str]) -> Path:
    if not source_path:
        return Path.cwd()
    here = Path(source_path).resolve().parent
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").exists() and (candidate / "params").is_dir():
            return candidate
    return Path.cwd()


def _dotted(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _pydantic_problems(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        field = _dotted(e["loc"])
        if e["type"] == "extra_forbidden":
            section = e["loc"][:-1]
            owner = _section_model(section)
            valid = sorted(owner.model_fields) if owner else []
            valid = [v for v in valid if v != "source_path"]
            problems.append((field, f"unknown key; valid keys here: {valid}"))
        elif e["type"] == "missing":
            problems.append((field, "required field is missing"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            problems.append((field, f"{msg} (got {e.get('input')!r})" if "got" not in msg else msg))
    return problems


def _section_model(loc: tuple) -> Optional[type[BaseModel]]:
    model: type[BaseModel] = Params
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _semantic_problems(raw: dict, path: Path) -> list[tuple[str, str]]:
    """Checks across fields and against the filesystem, on the raw mapping so they run even when
    other fields failed type validation (one error lists everything)."""
    problems: list[tuple[str, str]] = []
    base = path.parent
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    server = raw.get("server") if isinstance(raw.get("server"), dict) else {}
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}

    config: Optional[dict] = None
    cfg_rel = model.get("config")
    if isinstance(cfg_rel, str):
        cfg_path = Path(os.path.expanduser(cfg_rel))
        cfg_path = cfg_path if cfg_path.is_absolute() else base / cfg_path
        if not cfg_path.is_file():
            problems.append(("model.config", f"file {str(cfg_path)!r} does not exist; give a path to an "
                             "HF config.json, relative to the params file"))
        else:
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                problems.append(("model.config", f"{str(cfg_path)!r} is not valid JSON: {e}"))
    tok = model.get("tokenizer")
    if isinstance(tok, str) and tok not in ("train", "model"):
        tok_path = Path(os.path.expanduser(tok))
        tok_path = tok_path if tok_path.is_absolute() else base / tok_path
        if not tok_path.exists():
            problems.append(("model.tokenizer", f"{str(tok_path)!r} does not exist; use 'train', 'model' "
                             "or a local tokenizer directory"))
    if tok == "model" and not model.get("path"):
        problems.append(("model.tokenizer", "'model' needs model.path (weights dir or HF id)"))
    if tok == "train" and model.get("path"):
        problems.append(("model.tokenizer", "'train' builds a dummy-weights model dir; with model.path set "
                         "use 'model' or a tokenizer directory"))

    tp = server.get("tensor_parallel", 1)
    if config is not None and isinstance(tp, int) and tp >= 1:
        from decodescope.arch import normalize_config

        arch = normalize_config(config)
        for what, n in (("attention heads", arch.num_attention_heads),
                        ("routed experts", arch.num_experts)):
            if n and n % tp != 0:
                divisors = [d for d in range(1, n + 1) if n % d == 0]
                problems.append(("server.tensor_parallel",
                                 f"{tp} does not divide the model's {n} {what}; valid: {divisors}"))
        kv = arch.num_key_value_heads
        if kv and not (kv % tp == 0 or tp % kv == 0):
            problems.append(("server.tensor_parallel",
                             f"{tp} and the model's {kv} KV heads neither divide the other"))

    if not run.get("name"):
        try:
            check_run_name(path.stem)
        except ValueError as e:
            problems.append(("run.name", f"not set, and the file name stands in for it: {e}"))

    host = raw.get("host") if isinstance(raw.get("host"), dict) else {}
    micro = raw.get("microbench") if isinstance(raw.get("microbench"), dict) else {}
    if host.get("nodes") and not micro.get("rdzv_endpoint"):
        problems.append(("microbench.rdzv_endpoint", "host.nodes runs the probes on several hosts: give the "
                         "rendezvous endpoint every host reaches, host:port on the first host, e.g. 10.0.0.5:29400"))

    if server.get("mode") == "attach" and server.get("cpus"):
        problems.append(("server.cpus", "places a server decodescope starts; with server.mode: attach the server "
                         "runs where it was started: remove cpus, or use server.mode: launch"))
    if server.get("mode") == "attach" and not server.get("url"):
        problems.append(("server.url", "attach mode needs the URL of a running server, "
                         "e.g. http://127.0.0.1:8000"))

    out = run.get("output_dir", "outputs")
    if isinstance(out, str):
        out_path = Path(os.path.expanduser(out))
        out_path = out_path if out_path.is_absolute() else _repo_root_of(str(path)) / out_path
        problem = _not_writable(out_path)
        if problem:
            problems.append(("run.output_dir", problem))
    return problems


def _not_writable(directory: Path) -> Optional[str]:
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} exists and is not a directory; give a writable directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".decodescope-write-test"):
            pass
    except OSError as e:
        return f"{str(directory)!r} is not writable ({e.strerror}); give a writable directory"
    return None


def load_params(path: str | Path) -> Params:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(path, [("", "file does not exist; see params/default.yaml for an example")])
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ParamsError(path, [("", f"not valid YAML: {e}")]) from None
    if not isinstance(raw, dict):
        raise ParamsError(path, [("", f"must be a mapping of sections {sorted(Params.model_fields)}, "
                                      f"got {type(raw).__name__}")])
    if "source_path" in raw:
        raise ParamsError(path, [("source_path", "reserved; remove it")])
    _pop_retired(raw)  # accepted and ignored; `params validate` warns about them
    problems: list[tuple[str, str]] = []
    params = None
    try:
        params = Params.model_validate(raw)
    except ValidationError as e:
        problems += _pydantic_problems(e)
    problems += _semantic_problems(raw, path)
    if params is not None and params.experiments:
        params.source_path = str(path.resolve())
        problems += _experiment_problems(params, path)
    if problems:
        seen, unique = set(), []
        for p in problems:
            if p not in seen:
                seen.add(p)
                unique.append(p)
        raise ParamsError(path, unique)
    params.source_path = str(path.resolve())
    return params


OVERRIDES_ENV = "DECODESCOPE_OVERRIDES"  # JSON {dotted key: value}: the command line's, for every phase


def with_overrides(params: Params, overrides: dict) -> Params:
    """params with dotted keys replaced (e.g. {"workload.repeats": 3} from `run --repeats 3`), validated
    again; an error names the key."""
    if not overrides:
        return params
    data = params.model_dump()
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        out = Params.model_validate(data)
    except ValidationError as e:
        raise ParamsError(params.source_path or "params", [(f, f"{m} (from the command line)")
                                                           for f, m in _pydantic_problems(e)]) from None
    out.source_path = params.source_path
    return out


def _experiment_problems(params: Params, path: Path) -> list[tuple[str, str]]:
    """Each variant checked as the params it will run with, before anything starts."""
    problems: list[tuple[str, str]] = []
    names = [e.name for e in params.experiments]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(("experiments", f"variant name {n!r} is used {names.count(n)} times; names must be unique"))
    if "baseline" in names:
        problems.append(("experiments", "'baseline' names the run itself; choose another variant name"))
    for e in params.experiments:
        if params.server.mode == "attach" and (e.tensor_parallel is not None or e.cpus is not None or e.engine_args
                                               or e.env):
            problems.append((f"experiments[{e.name}]", "changes the server, but server.mode is attach (a server "
                             "decodescope does not start); use server.mode: launch, or vary only `workload`"))
            continue
        try:
            v = with_experiment(params, e.name)
        except ParamsError as pe:
            problems += pe.problems
            continue
        problems += [(f"experiments[{e.name}].{f}", m) for f, m in _semantic_problems(v.model_dump(mode="json"), path)
                     if f.startswith(("server", "workload"))]
    return problems


def with_experiment(params: Params, name: str) -> Params:
    """The params a variant runs with: server.engine_args / env merged (null removes a key),
    tensor_parallel, cpus and workload keys replaced. Validated like a params file; errors name the variant."""
    exp = next((e for e in params.experiments if e.name == name), None)
    if exp is None:
        raise ParamsError(params.source_path or "params", [("experiments", f"no variant named {name!r}; defined: "
                                                            f"{[e.name for e in params.experiments]}")])
    data = params.model_dump()
    server = data["server"]
    for key in ("tensor_parallel", "cpus"):
        if getattr(exp, key) is not None:
            server[key] = getattr(exp, key)
    for key in ("engine_args", "env"):
        merged = dict(server.get(key) or {})
        for k, v in getattr(exp, key).items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        server[key] = merged
    data["workload"] = {**data["workload"], **exp.workload}
    data["experiments"] = []
    data["run"]["name"] = f"{params.run_name}+{name}"
    try:
        out = Params.model_validate(data)
    except ValidationError as e:
        raise ParamsError(params.source_path or "params",
                          [(f"experiments[{name}].{f}", m) for f, m in _pydantic_problems(e)]) from None
    out.source_path = params.source_path
    return out


def redact(obj: Any) -> Any:
    """A copy with secret-looking keys' values replaced, for manifests, logs and reports."""
    if isinstance(obj, dict):
        return {k: (REDACTED if SECRET_KEY_PATTERN.search(str(k)) and v not in (None, "") else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def params_as_dict(params: Params, redact_secrets: bool = True) -> dict:
    data = params.model_dump(mode="json")
    return redact(data) if redact_secrets else data


def dump_yaml(params: Params, redact_secrets: bool = True) -> str:
    return yaml.safe_dump(params_as_dict(params, redact_secrets), sort_keys=False)
