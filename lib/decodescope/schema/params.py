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
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from decodescope.model.arch import normalize_config
from decodescope.core.phases import PHASES, SERVER_PHASES
from decodescope.schema.params_schema import (REDACTED, SECRET_KEY_PATTERN, Params, ParamsError, _repo_root_of,
                                              check_run_name)
# re-exported (__all__): the tests name HostParams as params's
from decodescope.schema.params_schema import HostParams


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
    "microbench.skew_calibration_us": ("03_collectives",),
    "microbench.skew_calibration_steps": ("03_collectives",),
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


def _section(raw: dict, name: str) -> dict:
    """The mapping under `name`, or {} where the file leaves it out or gives something else."""
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def unread_keys(path: str | Path) -> list[tuple[str, str]]:
    """(dotted key, why) for each key the file sets that no phase it runs reads: retired keys, and keys
    only phases outside `run.phases` read. For `params validate`, after load_params accepted the file."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        return []
    out = [(k, f"it was removed: {RETIRED_KEYS[k]}") for k in _pop_retired(raw)]
    run = _section(raw, "run")
    phases = set(run.get("phases") or PHASES) | {RUNNER}
    required = set(schema_keys(required=True))  # a file cannot leave these out, so no warning
    for key in _file_keys(raw, Params):
        readers = readers_of(key)
        if readers and key not in required and not phases.intersection(readers):
            out.append((key, f"read only by {', '.join(readers)}, which run.phases leaves out"))
    return out


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
    model = _section(raw, "model")
    server = _section(raw, "server")
    run = _section(raw, "run")

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

    host = _section(raw, "host")
    micro = _section(raw, "microbench")
    if host.get("nodes") and not micro.get("rdzv_endpoint"):
        problems.append(("microbench.rdzv_endpoint", "host.nodes runs the probes on several hosts: give the "
                         "rendezvous endpoint every host reaches, host:port on the first host, e.g. 10.0.0.5:29400"))

    problems += _placeholder_problems(raw, base)
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


# in an engine argument's value (a speculative config's "model"): a model directory built from an HF config
CONFIG_PLACEHOLDER = re.compile(r"@config:([^\"'\\\s,}]+)")


def placeholder_configs(engine_args: dict) -> list[str]:
    """The config paths named as '@config:<path>' anywhere in the engine arguments' values, each once."""
    found = [m.group(1) for v in engine_args.values() for m in CONFIG_PLACEHOLDER.finditer(json.dumps(v))]
    return list(dict.fromkeys(found))


def relative_config_files(params: "Params") -> list[str]:
    """The files the params name relative to their own folder: model.config and each '@config:' draft of the
    server and of every variant, each once, where it stays inside that folder (no absolute path, no '..')."""
    names = [params.model.config] if params.model.config else []
    names += placeholder_configs(params.server.engine_args)
    for exp in params.experiments:
        names += placeholder_configs(exp.engine_args)
    return [n for n in dict.fromkeys(names)
            if not Path(os.path.expanduser(n)).is_absolute() and ".." not in Path(n).parts]


def _placeholder_problems(raw: dict, base: Path) -> list[tuple[str, str]]:
    """Each '@config:<path>' in server.engine_args must name a readable HF config (the experiments' are
    checked as each variant's merged params)."""
    args = _section(raw, "server").get("engine_args")
    problems = []
    for rel in placeholder_configs(args) if isinstance(args, dict) else []:
        cfg = Path(os.path.expanduser(rel))
        cfg = cfg if cfg.is_absolute() else base / cfg
        try:
            json.loads(cfg.read_text())
        except (OSError, ValueError) as e:
            problems.append(("server.engine_args", f"'@config:{rel}' names {str(cfg)!r}, which is not a "
                             f"readable JSON HF config ({type(e).__name__}); give a config.json relative to the "
                             "params file"))
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
    # a failed validation added problems and raised above, so params is set here
    assert params is not None
    params.source_path = str(path.resolve())
    return params




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


def flatten_dotted(d: Any, prefix: str = "") -> dict[str, str]:
    """A nested mapping (params, versions) as its leaves by dotted key, each value as text (lists as JSON,
    None as null, an empty mapping as {})."""
    if isinstance(d, dict):
        out: dict[str, str] = {}
        for k, v in d.items():
            out.update(flatten_dotted(v, f"{prefix}{k}."))
        if not d and prefix:
            out[prefix[:-1]] = "{}"
        return out
    value = json.dumps(d, default=str) if isinstance(d, (list, tuple)) else ("null" if d is None else str(d))
    return {prefix[:-1]: value}


__all__ = ["dump_yaml", "flatten_dotted", "HostParams", "load_params", "params_as_dict", "placeholder_configs", "READERS",
           "readers_of", "redact", "RETIRED_KEYS", "RUNNER", "schema_keys", "unread_keys", "with_experiment",
           "with_overrides"]
