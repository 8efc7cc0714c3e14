"""The params schema (pydantic): every section of a params file, its fields, defaults and checks.
decodescope.schema.params loads and validates a file into it (load_params) and re-exports the names importers use."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from decodescope.engines import ENGINES
from decodescope.core.phases import PHASES


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
NonNegativeUs = Annotated[float, _at_least(0.0)]
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
    engine: str = Field("vllm", description="the serving engine (decodescope.engines): what it is launched, "
                        "profiled and read as")
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

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        if name not in ENGINES:
            raise ValueError(f"{name!r} is not an engine decodescope knows; valid: {', '.join(sorted(ENGINES))}")
        return name

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
        "32 weights (decodescope.core.dtypes)")


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
    temperature: Optional[Annotated[float, _at_least(0.0, "temperature must be")]] = Field(
        None, description="sampling temperature sent with every request; None: the server's default (a "
                          "speculative variant sets it: 0 accepts nearly every draft)")
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


ProbeDtype = Literal["bf16", "fp16", "fp32", "fp8", "int4"]


def _default_probe_dtypes() -> list[ProbeDtype]:
    # a named factory: mypy infers a lambda's ["bf16"] as list[str], not the Literal list the field holds
    return ["bf16"]


class MicrobenchParams(_Section):
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    dtypes: list[ProbeDtype] = Field(default_factory=_default_probe_dtypes)
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
    skew_calibration_us: list[NonNegativeUs] = Field(
        default_factory=lambda: [0.0, 250.0],
        description="03: delays (us) one rank waits before every collective of the step replay, each read back "
                    "through the critical path to check its arrival skew on this host (the report's methods); "
                    "[]: not run")
    skew_calibration_steps: AtLeastOne = Field(4, description="steps profiled per skew_calibration_us delay")

    @field_validator("batches")
    @classmethod
    def _batches_positive(cls, batches: list[int]) -> list[int]:
        if not batches or any(b < 1 for b in batches):
            raise ValueError(f"batches must be a non-empty list of integers >= 1, got {batches}")
        return batches


KNEE = "knee"


def _default_profile_levels() -> list[Union[int, str]]:
    # a named factory: mypy infers a lambda's [1, KNEE] as list[object]
    return [1, KNEE]


class ProfileParams(_Section):
    requests: AtLeastOne = 4
    concurrency: list[Union[int, str]] = Field(
        default_factory=_default_profile_levels,
        description="levels to profile, one capture each, so the step's growth with load is measured; "
                    "'knee' is 01's knee (the level after which throughput grows < 10%; its highest "
                    "level when throughput still grows; left out when 01 did not run). A single integer is one level")
    input_tokens: AtLeastOne = 32
    output_tokens: AtLeastOne = 16
    warmup_requests: NonNegative = Field(2, description="untimed requests before each level, at least one per "
                                         "concurrent slot (serving.sweep.warmup_count); 0: none")
    flush_timeout_s: Positive = 600.0
    host_ops_tokens: Optional[NonNegative] = Field(
        None, description="the prompt of one more profiled request, longer than the largest CUDA graph the engine "
        "captures (vLLM's default: 512 tokens), whose prefill runs the ops graphs hide on the host (the verdict's "
        "eager and piecewise projections); capped by max-model-len. null: 1024 where the engine runs CUDA graphs "
        "(its log) or its modes are unknown, none where it runs none; 0: never")

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
    the report always run here (decodescope.exec.host)."""
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


def _repo_root_of(source_path: Optional[str]) -> Path:
    if not source_path:
        return Path.cwd()
    here = Path(source_path).resolve().parent
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").exists() and (candidate / "params").is_dir():
            return candidate
    return Path.cwd()
