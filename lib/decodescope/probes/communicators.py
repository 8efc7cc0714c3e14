"""The all-reduce implementations a probe rank can time: torch.distributed's (gloo or NCCL) always, and vLLM
CPU's shared-memory all-reduce where vllm's CPU kernels have it. The collective and step probes both use them.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

SHM_PREFIX = "decodescope-probe-"


@dataclass
class Communicator:
    name: str
    all_reduce: Callable  # in place, on this rank's tensor
    graphable: bool = False
    cleanup: Optional[Callable] = None
    all_gather: Optional[Callable] = None  # (out, part): every rank's part, concatenated in rank order


def torch_communicator(device) -> Communicator:
    return Communicator(f"torch_{dist.get_backend()}", lambda t: dist.all_reduce(t), graphable=device.type == "cuda",
                        all_gather=lambda out, part: dist.all_gather_into_tensor(out, part))


def vllm_cpu_extension() -> str:
    """The kernel library vLLM CPU loads on this host, chosen as vllm/platforms/cpu.py (import_kernels)
    chooses it: `_C` or `_C_AVX512` with AVX-512, `_C_AVX2` without (no shared-memory all-reduce there)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def vllm_shm_communicator(world: int, rank: int) -> Communicator:
    """vLLM CPU's shared-memory all-reduce, set up as its CpuCommunicator does (one segment per group,
    named by rank 0); raises when vllm or its CPU kernels are not there."""
    # vllm: the cpu/gpu extras only; without it this says so instead of failing the import
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "init_shm_manager"):
        if current_platform.device_type == "cpu":
            raise RuntimeError(f"vLLM CPU's vllm.{vllm_cpu_extension()} (loaded on a host without AVX-512) has no "
                               "shared-memory all-reduce: the engine all-reduces through gloo here")
        raise RuntimeError("this vllm build has no torch.ops._C.init_shm_manager (not the CPU build)")
    # named after the run token that the launcher (microbench._run) gives its probes, so it can remove
    # the segments even when the ranks were killed
    names = [f"{SHM_PREFIX}{os.environ.get('DECODESCOPE_RUN_TOKEN', str(os.getpid()))[:12]}-{int(time.time())}"]
    dist.broadcast_object_list(names, src=0)
    handle = torch.ops._C.init_shm_manager(names[0], world, rank, torch.get_num_threads())
    dist.barrier()
    torch.ops._C.join_shm_manager(handle, names[0])
    dist.barrier()

    def cleanup():  # the segments live in /dev/shm; vLLM's own server removes them at shutdown
        dist.barrier()
        if rank == 0:
            for f in os.listdir("/dev/shm"):
                if f.startswith(names[0]):
                    try:
                        os.unlink(os.path.join("/dev/shm", f))
                    except OSError:
                        pass
    return Communicator("vllm_shm", lambda t: torch.ops._C.shm_allreduce(handle, t), cleanup=cleanup,
                        all_gather=lambda out, part: torch.ops._C.shm_all_gather(handle, part, out))


def vllm_shm_or_why(world: int, rank: int) -> tuple[Optional[Communicator], str]:
    """vLLM CPU's shared-memory communicator, or None and why it cannot be built here."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return None, "the ranks span several hosts (shared memory reaches only one)"
    try:
        return vllm_shm_communicator(world, rank), ""
    except Exception as e:  # no vllm, or not its CPU build: the caller goes on without it, and says so
        return None, f"{type(e).__name__}: {e}"[:300]


def communicators(device, world: int, rank: int) -> tuple[list[Communicator], dict[str, str]]:
    """Every all-reduce implementation this host offers, and why any was skipped."""
    comms = [torch_communicator(device)]
    skipped: dict[str, str] = {}
    if device.type == "cpu":
        shm, why = vllm_shm_or_why(world, rank)
        if shm is not None:
            comms.append(shm)
        else:
            skipped["vllm_shm"] = why
    return comms, skipped
