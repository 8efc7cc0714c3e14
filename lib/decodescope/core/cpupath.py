"""The switch that puts vLLM CPU on its AVX2 path on any x86 host (decodescope.exec.engine_comm says which
all-reduce path each library gives). The standard library only: the tests' conftest applies it in every
session, on a GPU host's image without pydantic too.

DECODESCOPE_CPU_PATH=avx2 in decodescope's environment (or `pytest --cpu-path=avx2`) puts
decodescope/_avx2_only (a sitecustomize that makes torch report no AVX-512 and no AMX) on PYTHONPATH,
with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, so every process of the run (the server
and its workers, the probes, the notebooks) runs as on an AVX2-only host. An ssh host keeps its own.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import MutableMapping, Optional

CPU_PATH_ENV = "DECODESCOPE_CPU_PATH"
CPU_PATHS = ("native", "avx2")
AVX2_ONLY_DIR = Path(__file__).resolve().parents[1] / "_avx2_only"  # decodescope/_avx2_only
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


class CpuPathError(ValueError):
    pass


def cpu_path(environ: Optional[MutableMapping[str, str]] = None) -> str:
    """The CPU path asked for: 'native' (the host's own, the default) or 'avx2' (forced)."""
    value = (environ if environ is not None else os.environ).get(CPU_PATH_ENV, "native") or "native"
    if value not in CPU_PATHS:
        raise CpuPathError(f"{CPU_PATH_ENV}={value!r}: expected one of {', '.join(CPU_PATHS)}")
    return value


def apply_cpu_path(path: Optional[str] = None, environ: Optional[MutableMapping[str, str]] = None) -> str:
    """Put `path` (default: what CPU_PATH_ENV asks for) into `environ` (default os.environ), so that every
    process started from it inherits it; idempotent. Returns the path."""
    env = os.environ if environ is None else environ
    path = path or cpu_path(env)
    if path not in CPU_PATHS:
        raise CpuPathError(f"cpu path {path!r}: expected one of {', '.join(CPU_PATHS)}")
    env[CPU_PATH_ENV] = path
    if path == "avx2":
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(AVX2_ONLY_DIR) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(AVX2_ONLY_DIR), *parts])
        env.update(AVX2_ENV)
    return path


def apply_cpu_path_here(path: Optional[str] = None) -> str:
    """apply_cpu_path into os.environ, and into this process too: under 'avx2' torch here reports no
    AVX-512 from now on, so a vLLM kernel library this process loads later is _C_AVX2, the one its children
    load. A process that loaded vLLM's native library first and _C_AVX2 after aborts (both register the
    TORCH_LIBRARY namespace _C), which a forced-AVX2 test session on an AVX-512 host did."""
    path = apply_cpu_path(path)
    if path == "avx2":
        force_avx2_in_process()
    return path


def force_avx2_in_process() -> None:
    """This process too sees no AVX-512 (the sitecustomize's patch, for a process already started)."""
    if importlib.util.find_spec("torch") is None:
        return  # an analysis-only install: this process loads no vLLM kernels, nothing to patch
    # torch: the cpu/gpu extras only; the analysis side imports this module without it
    import torch.cpu

    for name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
