"""The all-reduce implementations a probe rank can time: torch.distributed's (gloo or NCCL) always, and vLLM
CPU's shared-memory all-reduce where vllm's CPU kernels have it. The collective and step probes both use them.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from decodescope.exec import procs

SHM_PREFIX = procs.PROBE_SHM_PREFIX


@dataclass
class Communicator:
    name: str
    all_reduce: Callable  # in place, on this rank's tensor
    graphable: bool = False
    cleanup: Optional[Callable] = None
    all_gather: Optional[Callable] = None  # (out, part): every rank's part, concatenated in rank order


def torch_communicator(device) -> Communicator:
    if device.type == "cpu":
        return functional_gloo_communicator()
    return Communicator(f"torch_{dist.get_backend()}", lambda t: dist.all_reduce(t), graphable=device.type == "cuda",
                        all_gather=lambda out, part: dist.all_gather_into_tensor(out, part))


def functional_gloo_communicator() -> Communicator:
    """torch.distributed on CPUs called as vLLM CPU's compiled model calls it: the functional collective
    (an async op that enqueues on gloo's thread) then its wait_tensor. A plain dist.all_reduce blocks
    inside the op's work.wait(), which torch.profiler does not trace: the wait then reads as host time
    and the transfer as 0 on the critical path."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers torch.ops._c10d_functional)

    ops = torch.ops._c10d_functional
    world_group = dist.group.WORLD
    assert world_group is not None, "init_process_group first"
    group = world_group.group_name
    world = dist.get_world_size()

    def all_reduce(t):
        ops.wait_tensor(ops.all_reduce_(t, "sum", group))

    def all_gather(out, part):
        out.copy_(ops.wait_tensor(ops.all_gather_into_tensor(part, world, group)))
    return Communicator(f"torch_{dist.get_backend()}", all_reduce, all_gather=all_gather)


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
    # named after the launcher's run token and the run's id (procs.probe_shm_name), so that the launcher and
    # the runner can each sweep them once the ranks are gone, even when the ranks were killed before the unlink
    names = [procs.probe_shm_name(os.environ, str(int(time.time())))]
    dist.broadcast_object_list(names, src=0)
    handle = torch.ops._C.init_shm_manager(names[0], world, rank, torch.get_num_threads())
    hold_for_fault_test(rank, names[0])
    dist.barrier()
    torch.ops._C.join_shm_manager(handle, names[0])
    dist.barrier()
    # every rank has mapped every segment: their names go now, so a rank killed from here on (SIGKILL, the
    # OOM killer) leaves nothing in /dev/shm; the memory lives as long as a rank maps it
    unlink_segments(rank, names[0])

    def cleanup():  # the names went after the join; this finds any that a failed unlink left
        dist.barrier()
        unlink_segments(rank, names[0])
    return Communicator("vllm_shm", lambda t: torch.ops._C.shm_allreduce(handle, t), cleanup=cleanup,
                        all_gather=lambda out, part: torch.ops._C.shm_all_gather(handle, part, out))


def unlink_segments(rank: int, name: str) -> None:
    """Rank 0 removes the group's segments (vLLM names them <name>_<rank>) from /dev/shm."""
    if rank == 0:
        procs.unlink_all(p for p in procs.SHM_DIR.iterdir() if p.name.startswith(name + "_"))


# Fault injection for tests/test_faults.py: with FAULT_HOLD_ENV=<marker> every rank stops where the segments
# exist and their names are not yet removed (after init_shm_manager; at the same point without vllm_shm),
# writes <marker>.rank<r> (the segments it sees) and waits there until it is killed; with FAULT_IGNORE_TERM_ENV
# set it ignores SIGTERM meanwhile, as a rank stuck in a collective on a loaded host is slow to die.
FAULT_HOLD_ENV = "DECODESCOPE_FAULT_HOLD_SHM"
FAULT_IGNORE_TERM_ENV = "DECODESCOPE_FAULT_IGNORE_TERM"


def hold_for_fault_test(rank: int, name: Optional[str]) -> None:
    marker = os.environ.get(FAULT_HOLD_ENV)
    if not marker:
        return
    if os.environ.get(FAULT_IGNORE_TERM_ENV):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    segments = sorted(p.name for p in procs.SHM_DIR.iterdir() if p.name.startswith(name + "_")) if name else []
    tmp = f"{marker}.rank{rank}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "name": name, "segments": segments}, f)
    os.replace(tmp, f"{marker}.rank{rank}")
    while True:
        time.sleep(1)


def vllm_shm_or_why(world: int, rank: int) -> tuple[Optional[Communicator], str]:
    """vLLM CPU's shared-memory communicator, or None and why it cannot be built here."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return None, "the ranks span several hosts (shared memory reaches only one)"
    try:
        return vllm_shm_communicator(world, rank), ""
    except Exception as e:  # no vllm, or not its CPU build: the caller goes on without it, and says so
        hold_for_fault_test(rank, None)
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
