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
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

PHASES = ("00_host", "01_serving", "02_gemm", "03_collectives", "04_profile", "05_verdict")
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
    input_tokens: AtLeastOne = 64
    output_tokens: AtLeastOne = 32
    requests_per_level: AtLeastOne = 8
    warmup_requests: NonNegative = 2
    request_timeout_s: Positive = 300.0
    seed: int = 0
    request_rate: Optional[float] = Field(None, description="requests/s (open loop); None: closed loop at "
                                          "each concurrency level. The level is then the concurrency cap")
    burstiness: float = Field(1.0, description="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    compare_with: list[str] = Field(default_factory=list, description="`vllm bench serve --save-result` JSON "
                                    "files to show beside our levels (relative to the params file)")
    slo: SloParams = Field(default_factory=SloParams)

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


class ProfileParams(_Section):
    requests: AtLeastOne = 4
    concurrency: AtLeastOne = 2
    input_tokens: AtLeastOne = 32
    output_tokens: AtLeastOne = 16
    warmup_requests: NonNegative = 2
    flush_timeout_s: Positive = 600.0
    # Python stacks in the worker traces: the analysis does not read them, and every spin of a waiting
    # worker becomes events (a 15 s window reached 40 MB gzipped per rank and an OOM kill on 2 cores).
    with_stack: bool = False


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


class Params(_Section):
    run: RunParams = Field(default_factory=RunParams)
    host: str = "local"
    server: ServerParams = Field(default_factory=ServerParams)
    model: ModelParams
    workload: WorkloadParams = Field(default_factory=WorkloadParams)
    microbench: MicrobenchParams = Field(default_factory=MicrobenchParams)
    profile: ProfileParams = Field(default_factory=ProfileParams)
    hardware: HardwareParams = Field(default_factory=HardwareParams)

    @field_validator("host")
    @classmethod
    def _host_kind(cls, host: str) -> str:
        if host == "local":
            return host
        if host.startswith("ssh://"):
            raise ValueError(f"{host!r}: remote hosts over ssh are not supported yet; use 'local' "
                             "and run decodescope on the GPU host")
        raise ValueError(f"{host!r} is not a host; valid: 'local'")

    # Paths inside the file are relative to the file; these are filled in by load_params.
    source_path: Optional[str] = Field(None, exclude=True)

    def resolve(self, relative: str) -> Path:
        base = Path(self.source_path).parent if self.source_path else Path.cwd()
        p = Path(os.path.expanduser(relative))
        return p if p.is_absolute() else (base / p).resolve()

    @property
    def run_name(self) -> str:
        return self.run.name or (Path(self.source_path).stem if self.source_path else "run")

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
_SERVER_PHASES = ("01_serving", "04_profile")  # the runner starts (or attaches to) the server for these
READERS: dict[str, tuple[str, ...]] = {
    "run": (RUNNER,),
    "host": (RUNNER,),
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
        raise ParamsError(path, [("", f"file does not exist; see params/default.yaml for an example")])
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
    if problems:
        seen, unique = set(), []
        for p in problems:
            if p not in seen:
                seen.add(p)
                unique.append(p)
        raise ParamsError(path, unique)
    params.source_path = str(path.resolve())
    return params


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
