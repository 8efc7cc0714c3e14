import os
import subprocess
import sys
import textwrap

import numpy as np

import pytest
import yaml

from decodescope.cli.main import _variants_kept, main as cli_main
from decodescope.schema.params import (REDACTED, ParamsError, dump_yaml, load_params, params_as_dict, redact,
                                       with_overrides)

MINIMAL = """
model:
  name: tiny
  config: models/tiny-qwen3-moe.json
server:
  tensor_parallel: 2
run:
  output_dir: {out}
"""


def test_embedded_default_validates(repo):
    p = load_params(repo / "params/default.yaml")
    assert p.server.tensor_parallel == 2
    assert p.model.tokenizer == "train"
    assert p.server.engine_args["load-format"] == "dummy"


def test_mission_params_validate_with_kimi_architecture(repo):
    p = load_params(repo / "params/kimi-k2.5-int4-8x-pcie.yaml")
    assert p.server.tensor_parallel == 8
    assert p.model.weight_dtype == "int4" and p.hardware.gpu == "RTX PRO 6000 Blackwell"
    cfg = p.model_config_dict()
    assert cfg["text_config"]["num_hidden_layers"] == 61 and cfg["text_config"]["hidden_size"] == 7168


# Each bad file, the field the error must name, and a fragment of what it must say.
BAD_FILES = [
    ("server:\n  port: 70000\n", "server.port", "1..65535"),
    ("server:\n  port: 0\n", "server.port", "1..65535"),
    ("server:\n  tensor_parallel: 3\n", "server.tensor_parallel", "does not divide"),
    ("server:\n  tensor_parallel: 0\n", "server.tensor_parallel", ">= 1"),
    ("workload:\n  concurrency: [0, 4]\n", "workload.concurrency", ">= 1"),
    ("workload:\n  concurrency: []\n", "workload.concurrency", "at least one"),
    ("workload:\n  input_tokens: many\n", "workload.input_tokens", "integer"),
    ("server:\n  bogus_key: 1\n", "server.bogus_key", "unknown key"),
    ("surprise_section: {}\n", "surprise_section", "unknown key"),
    ("server:\n  mode: attach\n", "server.url", "attach mode"),
    ("server:\n  mode: sideways\n", "server.mode", "launch"),
    ("server:\n  url: ftp://x\n", "server.url", "http"),
    ("host: ftp://user@gpu-box\n", "host.url", "ssh://[user@]host[:port]"),
    ("host: ssh://user@gpu-box:99999\n", "host.url", "not a TCP port"),
    ("host:\n  url: ssh://gpu-box\n  ssh_options: {BatchMode: \"no\"}\n", "host.ssh_options", "never prompts"),
    ("host:\n  url: ssh://gpu-box\n  nodes: [ssh://other]\n", "microbench.rdzv_endpoint", "rendezvous"),
    ("run:\n  phases: [00_host, 07_magic]\n", "run.phases", "07_magic"),
    ("model:\n  tokenizer: /no/such/tokenizer\n", "model.tokenizer", "does not exist"),
    ("profile:\n  requests: 0\n", "profile.requests", ">= 1"),
    ("microbench:\n  batches: [1, -2]\n", "microbench.batches", ">= 1"),
    ("server:\n  cpus: core one\n", "server.cpus", "'1', '2-3' or '0,4-7'"),
    ("server:\n  cpus: 1-\n", "server.cpus", "as taskset -c does"),
    ("server:\n  mode: attach\n  url: http://127.0.0.1:8000\n  cpus: '1'\n", "server.cpus", "server.mode: launch"),
]


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


@pytest.mark.parametrize("extra,field,fragment", BAD_FILES, ids=[b[1] + ":" + b[2] for b in BAD_FILES])
def test_bad_params_give_an_error_naming_file_and_field(write_params, tmp_path, extra, field, fragment):
    doc = _merge(yaml.safe_load(MINIMAL.format(out=tmp_path / "out")), yaml.safe_load(extra))
    path = write_params(yaml.safe_dump(doc))
    with pytest.raises(ParamsError) as e:
        load_params(path)
    msg = str(e.value)
    assert str(path) in msg
    assert any(f == field and fragment in m for f, m in e.value.problems), msg


def test_missing_model_config_file_is_named(write_params, tmp_path):
    path = write_params(f"model:\n  name: x\n  config: models/nope.json\nrun:\n  output_dir: {tmp_path}\n")
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert any(f == "model.config" and "nope.json" in m for f, m in e.value.problems)


def test_unwritable_output_dir_is_reported(write_params, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    path = write_params(MINIMAL.format(out=blocker / "sub"))
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert any(f == "run.output_dir" for f, _ in e.value.problems)


def test_all_problems_are_listed_in_one_error(write_params, tmp_path):
    path = write_params(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path}}}
        server: {{port: 99999, tensor_parallel: 3, extra: 1}}
        model: {{name: x, config: models/tiny-qwen3-moe.json}}
        workload: {{concurrency: [0]}}
        """))
    with pytest.raises(ParamsError) as e:
        load_params(path)
    fields = {f for f, _ in e.value.problems}
    assert {"server.port", "server.tensor_parallel", "server.extra", "workload.concurrency"} <= fields


def test_missing_model_section_is_required(write_params):
    path = write_params("server: {port: 8000}\n")
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert ("model", "required field is missing") in e.value.problems


def test_not_yaml_mapping_is_rejected(write_params):
    with pytest.raises(ParamsError, match="mapping"):
        load_params(write_params("- just\n- a list\n"))


def test_show_redacts_api_key(write_params, tmp_path):
    path = write_params(MINIMAL.format(out=tmp_path) + "  name: x\n".replace("  name: x\n", "") +
                        "")
    doc = yaml.safe_load(path.read_text())
    doc["server"]["api_key"] = "sk-very-secret"
    doc["server"]["env"] = {"HF_TOKEN": "hf_secret"}
    path.write_text(yaml.safe_dump(doc))
    p = load_params(path)
    text = dump_yaml(p)
    assert "sk-very-secret" not in text and "hf_secret" not in text
    assert REDACTED in text
    assert p.server.api_key == "sk-very-secret"  # the in-memory params keep it for the client


@pytest.mark.parametrize("key,secret", [("HF_TOKEN", True), ("api_key", True), ("VLLM_API_KEY", True),
                                        ("auth-token", True), ("token", True), ("db_password", True),
                                        ("Authorization", True), ("input_tokens", False), ("tokenizer", False),
                                        ("all_to_all_tokens", False), ("max_num_batched_tokens", False)])
def test_only_secret_keys_are_redacted(key, secret):
    assert (redact({key: "v"})[key] == REDACTED) is secret


def test_redacted_params_keep_the_workload(repo):
    shown = params_as_dict(load_params(repo / "params/default.yaml"))
    assert shown["workload"]["input_tokens"] == 64 and shown["model"]["tokenizer"] == "train"
    assert shown["microbench"]["all_to_all_tokens"] != REDACTED


def test_cli_validate_and_show(repo, capsys):
    assert cli_main(["params", "validate", str(repo / "params/default.yaml")]) == 0
    assert cli_main(["params", "show", str(repo / "params/default.yaml")]) == 0
    shown = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])
    # defaults are filled in
    assert shown["workload"]["request_timeout_s"] == 300
    assert shown["server"]["bind_host"] == "127.0.0.1"


def test_cli_validate_bad_file_exits_2(write_params, capsys):
    path = write_params("server: {port: -1}\nmodel: {name: x, config: models/tiny-qwen3-moe.json}\n")
    assert cli_main(["params", "validate", str(path)]) == 2
    assert "server.port" in capsys.readouterr().err


@pytest.mark.parametrize("style", ["config", "env"])
def test_profiler_launch_flags_leave_python_stacks_out_unless_asked(repo, tmp_path, style):
    import json as _json

    from decodescope.exec.serverlaunch import launch_spec

    params = load_params(repo / "params/default.yaml")
    for with_stack in (False, True):
        params.profile.with_stack = with_stack
        spec = launch_spec(params, "m", "t", profiler_dir=tmp_path / "traces", profiler_style=style)
        if style == "config":
            cfg = _json.loads(spec.argv[spec.argv.index("--profiler-config") + 1])
            assert cfg == {"profiler": "torch", "torch_profiler_dir": str((tmp_path / "traces").resolve()),
                           "torch_profiler_with_stack": with_stack, "torch_profiler_dump_cuda_time_total": False}
        else:
            assert spec.env["VLLM_TORCH_PROFILER_WITH_STACK"] == ("1" if with_stack else "0")
            assert "--profiler-config" not in spec.argv


# ---- keys no phase reads (issue 9) ---------------------------------------------------------------
def test_every_schema_key_is_read_by_a_phase_or_the_runner():
    from decodescope.schema.params import PHASES, RUNNER, readers_of, schema_keys

    keys = schema_keys()
    assert "microbench.context_tokens" in keys and "hardware.peaks.int4_tflops" in keys
    unread = [k for k in keys if not readers_of(k)]
    assert unread == [], f"keys nothing reads: wire them or remove them from the schema ({unread})"
    assert {r for k in keys for r in readers_of(k)} <= set(PHASES) | {RUNNER}


def test_retired_keys_load_and_validate_warns_about_them(write_params, tmp_path, capsys):
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["model"]["dtype"] = "bfloat16"
    doc["hardware"] = {"gpu_count": 8, "interconnect": "pcie", "gpu": "H200"}
    path = write_params(yaml.safe_dump(doc))
    p = load_params(path)
    assert p.hardware.gpu == "H200"
    assert cli_main(["params", "validate", str(path)]) == 0
    out = capsys.readouterr()
    for key in ("model.dtype", "hardware.gpu_count", "hardware.interconnect"):
        assert f"warning: {path}: {key} is read by no phase" in out.err
    assert "hardware.gpu is" not in out.err and ": ok" in out.out


def test_validate_warns_about_keys_only_phases_left_out_read(write_params, tmp_path, capsys):
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["run"]["phases"] = ["00_host", "02_gemm"]
    doc["workload"] = {"concurrency": [1, 8]}
    doc["microbench"] = {"sweep_max_bytes": 1024, "dtypes": ["bf16"]}
    path = write_params(yaml.safe_dump(doc))
    assert cli_main(["params", "validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {path}: workload.concurrency is read by no phase" in err
    assert f"warning: {path}: microbench.sweep_max_bytes is read by no phase" in err
    assert f"warning: {path}: server.tensor_parallel" not in err  # 02_gemm reads it too
    assert f"warning: {path}: model.name" not in err               # required: the file cannot leave it out
    assert f"warning: {path}: run.phases" not in err and "microbench.dtypes" not in err


def test_shipped_params_files_warn_about_nothing(repo, capsys):
    for name in ("default.yaml", "kimi-k2.5-int4-8x-pcie.yaml"):
        assert cli_main(["params", "validate", str(repo / "params" / name)]) == 0
    assert "warning" not in capsys.readouterr().err


# ---- params that now do something: weight_dtype, context_tokens, int4/fp32 peaks ------------------
def test_weight_dtype_and_context_tokens_set_the_step_memory_floor(repo):
    from decodescope.model import arch
    from decodescope.micro.bench import memory_floor_note, step_memory_floor
    from decodescope.schema.records_host import Peaks

    p = load_params(repo / "params/kimi-k2.5-int4-8x-pcie.yaml")
    peaks = Peaks(name="X", source="test", mem_gbps=1000.0)
    p.microbench.batches = [1]
    int4 = step_memory_floor(p, peaks).iloc[0]
    a = arch.normalize_config(p.model_config_dict())
    w = arch.weight_bytes_per_step(arch.gemm_shapes(a, 8, 1), "int4")
    kv = arch.kv_cache_bytes_per_step(a, 8, 1, 1024)
    assert int4["total_bytes"] == pytest.approx(w["total"] + kv)
    assert int4["floor_us"] == pytest.approx((w["total"] + kv) / 1e9 * 1e3)
    p.model.weight_dtype = "bf16"
    p.microbench.context_tokens = 4096
    bf16 = step_memory_floor(p, peaks).iloc[0]
    assert bf16["weight_bytes"] > int4["weight_bytes"] and bf16["kv_bytes"] == pytest.approx(4 * kv)
    assert "no memory bandwidth peak" in memory_floor_note(step_memory_floor(p, None), None)


def test_int4_and_fp32_rooflines_are_explicit_and_in_the_method_note():
    from decodescope.micro.bench import gemm_table
    from decodescope.report.micro_view import gemm_method_note
    from decodescope.schema.records_host import Peaks

    rows = [{"op": "o_proj", "batch": 1, "dtype": d, "m": 1, "n": 64, "k": 64, "count": 1, "status": "ok",
             "method": "m", "time_us": 1.0, "tflops": 1.0, "gbps": 1.0} for d in ("bf16", "int4", "fp32")]
    peaks = Peaks(name="GPU", source="datasheet", bf16_tflops=100.0, mem_gbps=1000.0)
    t = gemm_table(rows, peaks).set_index("dtype")
    assert t.loc["int4", "peak_tflops"] == 100.0 and "W4A16" in t.loc["int4", "peak_source"]
    assert np.isnan(t.loc["fp32", "peak_tflops"])      # not bf16/2: no fp32 peak is known
    note = gemm_method_note(t.reset_index())
    assert "int4 100.0 TFLOP/s" in note and "fp32: none" in note and "hardware.peaks.fp32_tflops" in note
    t = gemm_table(rows, peaks.model_copy(update={"int4_tflops": 400.0, "fp32_tflops": 20.0})).set_index("dtype")
    assert (t.loc["int4", "peak_tflops"], t.loc["fp32", "peak_tflops"]) == (400.0, 20.0)


def test_ssh_host_shorthand_and_mapping_load_the_same(write_params, tmp_path):
    short = load_params(write_params(MINIMAL.format(out=tmp_path / "out") + "host: ssh://me@gpu-box:2222\n"))
    assert short.host.url == "ssh://me@gpu-box:2222" and short.host.is_remote
    full = load_params(write_params(MINIMAL.format(out=tmp_path / "out") + "host:\n  url: ssh://me@gpu-box:2222\n"
                                    "  python: /opt/venv/bin/python\n  workdir: /scratch/ds\n", name="q.yaml"))
    assert full.host.python == "/opt/venv/bin/python" and full.host.workdir == "/scratch/ds"
    again = yaml.safe_load(dump_yaml(full))["host"]
    assert again["url"] == "ssh://me@gpu-box:2222" and again["python"] == "/opt/venv/bin/python"
    assert not load_params(write_params(MINIMAL.format(out=tmp_path / "out"), name="r.yaml")).host.is_remote


def test_a_variant_runs_with_its_server_settings_merged_over_the_baseline(write_params, tmp_path):
    from decodescope.schema.params import with_experiment

    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["server"].update(engine_args={"max-num-seqs": 16, "load-format": "dummy"}, env={"A": "1", "B": "2"})
    doc["experiments"] = [{"name": "tp1", "tensor_parallel": 1, "env": {"A": "0", "B": None},
                           "engine_args": {"max-num-seqs": None, "enforce-eager": True},
                           "workload": {"concurrency": [1]}}]
    p = load_params(write_params(yaml.safe_dump(doc)))
    v = with_experiment(p, "tp1")
    assert v.server.tensor_parallel == 1 and v.server.env == {"A": "0"}               # null removes B
    assert v.server.engine_args == {"load-format": "dummy", "enforce-eager": True}    # null removes a flag
    assert v.workload.concurrency == [1] and v.experiments == [] and v.run_name.endswith("+tp1")
    assert p.server.tensor_parallel == 2 and p.projected_tensor_parallel() == [1]      # the baseline untouched
    assert v.server.cpus is None


def test_server_cpus_start_the_servers_processes_there_and_a_variant_replaces_them(write_params, tmp_path):
    """server.cpus: the server's argv starts with taskset -c (its workers then bind their own threads);
    a variant's cpus replace the baseline's; cores this process may not use are refused, named, before
    a server starts."""
    import os

    from decodescope.schema.params import with_experiment
    from decodescope.exec.server import ServerError, _check_cpus
    from decodescope.exec.serverlaunch import launch_spec

    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["experiments"] = [{"name": "tp1", "tensor_parallel": 1, "cpus": "1"}]
    p = load_params(write_params(yaml.safe_dump(doc)))
    assert p.server.cpus is None and launch_spec(p, "m", "t").argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    v = with_experiment(p, "tp1")
    spec = launch_spec(v, "m", "t")
    assert spec.argv[:4] == ["taskset", "-c", "1", p.server.python or sys.executable] and spec.cpus == "1"
    assert spec.describe()["argv"][:3] == ["taskset", "-c", "1"]    # the manifest says where it ran
    have = sorted(os.sched_getaffinity(0))
    _check_cpus(",".join(map(str, have)))
    with pytest.raises(ServerError, match=rf"server.cpus '{have[-1] + 1}' names cores \[{have[-1] + 1}\]"):
        _check_cpus(str(have[-1] + 1))


def test_each_server_has_a_temporary_folder_of_its_own_here_and_on_an_ssh_host(write_params, tmp_path):
    """vLLM binds its ZMQ sockets as files in VLLM_RPC_BASE_PATH and its workers' init file (vllm_dist_*) in
    the temporary folder, and leaves them when it stops: 11 sockets a server, and the init file on the gloo
    path, 2026-12-07. A launch gives the tree a folder of its run token (TMPDIR and that variable), which its
    teardown removes; an ssh host's is in its own /tmp, and both variables go there with the spec; a TMPDIR
    in server.env is where the folder goes."""
    import tempfile

    from decodescope.exec.serverlaunch import HOST_ENV_KEYS, launch_spec

    p = load_params(write_params(MINIMAL.format(out=tmp_path / "out")))
    here, again = launch_spec(p, "m", "t"), launch_spec(p, "m", "t")
    assert here.tmp_dir == here.env["VLLM_RPC_BASE_PATH"] == here.env["TMPDIR"]
    assert here.tmp_dir == f"{tempfile.gettempdir()}/decodescope-tmp-{here.run_token[:12]}"
    assert again.tmp_dir != here.tmp_dir
    assert len(here.tmp_dir) + 1 + 36 < 108  # a socket's path (ipc://<dir>/<uuid4>) fits sun_path
    # inductor's cache folder under TMPDIR is linked from the folder to beside it (tests/test_procs.py)
    assert here.tmp_caches == ["torchinductor_{user}"]
    assert "TORCHINDUCTOR_CACHE_DIR" not in set(here.env) - set(os.environ)

    class Remote:
        remote, python = True, "/usr/bin/python3"
    there = launch_spec(p, "m", "t", host=Remote())
    assert there.tmp_dir == f"/tmp/decodescope-tmp-{there.run_token[:12]}" == there.env["VLLM_RPC_BASE_PATH"]
    assert {"VLLM_RPC_BASE_PATH", "TMPDIR"} <= set(HOST_ENV_KEYS)
    assert "VLLM_RPC_BASE_PATH" not in there.describe()["env"]
    assert there.tmp_caches == ["torchinductor_{user}"]  # the host's supervisor links it there, with its user
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["server"].setdefault("env", {})["TMPDIR"] = str(tmp_path / "scratch")
    mine = launch_spec(load_params(write_params(yaml.safe_dump(doc))), "m", "t")
    assert mine.tmp_dir == f"{tmp_path / 'scratch'}/decodescope-tmp-{mine.run_token[:12]}" == mine.env["TMPDIR"]


@pytest.mark.parametrize("experiments,field,fragment", [
    ([{"name": "a"}, {"name": "a"}], "experiments", "used 2 times"),
    ([{"name": "a/b"}], "experiments.0.name", ""),
    ([{"name": "x", "workload": {"concurrency": [0]}}], "experiments[x].workload.concurrency", ">= 1"),
    ([{"name": "x", "workload": {"no_such_key": 1}}], "experiments[x].workload.no_such_key", ""),
    ([{"name": "x", "tensor_parallel": 3}], "experiments[x].server.tensor_parallel", ""),
])
def test_a_bad_variant_is_refused_before_anything_runs(write_params, tmp_path, experiments, field, fragment):
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["experiments"] = experiments
    path = write_params(yaml.safe_dump(doc))
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert any(f == field and fragment in m for f, m in e.value.problems), str(e.value)


@pytest.mark.parametrize("given,levels", [(2, [2]), ([1, "knee"], [1, "knee"])])
def test_profile_concurrency_is_a_list_of_levels_or_knee(write_params, tmp_path, given, levels):
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["profile"] = {"concurrency": given}
    assert load_params(write_params(yaml.safe_dump(doc))).profile.concurrency == levels
    doc["profile"] = {"concurrency": [1, "elbow"]}
    with pytest.raises(ParamsError) as e:
        load_params(write_params(yaml.safe_dump(doc)))
    assert "'elbow' is not a level" in str(e.value)


def test_knee_resolves_against_the_serving_levels(write_params, tmp_path):
    import pandas as pd

    from decodescope.schema.rundata import SERVING_LEVELS, RunDir
    from decodescope.profiling.capturephase import profile_levels

    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["profile"] = {"concurrency": [1, "knee"]}
    p = load_params(write_params(yaml.safe_dump(doc)))
    run = RunDir(tmp_path)
    lv = run.file(SERVING_LEVELS)
    lv.parent.mkdir()
    # throughput +80%, +5%: the knee is 2 (the level after which it grows < 10%)
    pd.DataFrame({"level": [1, 2, 4], "output_throughput_tok_s": [100.0, 180.0, 189.0]}).to_parquet(lv)
    assert profile_levels(p, run)[0] == [1, 2]
    # still growing: the highest level
    pd.DataFrame({"level": [1, 2, 4], "output_throughput_tok_s": [100.0, 180.0, 300.0]}).to_parquet(lv)
    assert profile_levels(p, run)[0] == [1, 4]
    # the knee is 1, already listed: the next level up, and the note says so
    pd.DataFrame({"level": [1, 2, 4], "output_throughput_tok_s": [100.0, 101.0, 102.0]}).to_parquet(lv)
    levels, notes = profile_levels(p, run)
    assert levels == [1, 2] and "profiled already" in notes[0]
    # no sweep: the knee is left out, with a note
    levels, notes = profile_levels(p, RunDir(tmp_path / "absent"))
    assert levels == [1] and "01_serving did not run" in notes[0]


def test_a_variant_cannot_change_a_server_it_does_not_start(write_params, tmp_path):
    doc = yaml.safe_load(MINIMAL.format(out=tmp_path / "out"))
    doc["server"].update(mode="attach", url="http://127.0.0.1:9")
    doc["experiments"] = [{"name": "tp1", "tensor_parallel": 1}, {"name": "more", "workload": {"concurrency": [8]}},
                          {"name": "pinned", "cpus": "1"}]
    with pytest.raises(ParamsError) as e:
        load_params(write_params(yaml.safe_dump(doc)))
    assert [f for f, _ in e.value.problems] == ["experiments[tp1]", "experiments[pinned]"]
    assert "server.mode is attach" in str(e.value)


def test_run_measures_only_the_variants_named_and_refuses_an_unknown_one(repo):
    """`run --variants`: the params' experiments narrowed to the names given (none: the baseline alone),
    applied as an override every phase sees; an unknown name is refused before anything starts."""
    path = str(repo / "params/h200-qwen3moe.yaml")
    p = load_params(path)
    kept = with_overrides(p, {"experiments": _variants_kept(path, ["seqs16", "eager"])})
    assert [e.name for e in kept.experiments] == ["eager", "seqs16"]
    assert kept.experiments[0].engine_args == {"enforce-eager": True}
    assert with_overrides(p, {"experiments": _variants_kept(path, ["none"])}).experiments == []
    out = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "run", path, "--variants", "eager", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--variants nope: no such variant; valid: spec-ngram, eager, seqs16, or none" in out.stderr
