"""data/host.json (00_host): the host's inventory (GPUs, their links, CPU, versions, the engine's all-reduce
path) and the peak rates later phases set their measurements against. decodescope.schema.records says how
records are versioned, read and written."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field

from decodescope.schema.recordbase import Record, _Model, columns_of


# ---- peaks -----------------------------------------------------------------------------------------
class Peaks(Record):
    """Peak rates a measurement is set against: a GPU's datasheet (dense math), params overrides, or
    a CPU matmul measured on the host. None where unknown."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="the device the peaks are for")
    bf16_tflops: Optional[float] = Field(None, description="dense BF16/FP16 TFLOP/s")
    fp8_tflops: Optional[float] = Field(None, description="dense FP8 TFLOP/s")
    fp32_tflops: Optional[float] = Field(None, description="FP32 TFLOP/s (given, or measured on CPU hosts); no fp32 roofline without it")
    int4_tflops: Optional[float] = Field(None, description="INT4 TOP/s, from params overrides only")
    mem_gbps: Optional[float] = Field(None, description="memory bandwidth, GB/s")
    link_gbps: Optional[float] = Field(None, description="GPU-to-GPU bandwidth, one direction, GB/s")
    link: Optional[str] = Field(None, description="what link_gbps is")
    source: str = Field("vendor datasheet, dense", description="where these figures come from")

    def display(self) -> dict:
        """The peaks as one table row: no version, and the FP32/INT4 columns only where known."""
        unknown = {k for k in ("fp32_tflops", "int4_tflops") if getattr(self, k) is None}
        return self.model_dump(exclude={"schema_version"} | unknown)


# ---- host inventory (data/host.json) ---------------------------------------------------------------
class GpuInfo(_Model):
    index: int
    name: str
    memory_mib: Optional[float] = None
    max_sm_clock_mhz: Optional[float] = None
    max_mem_clock_mhz: Optional[float] = None
    driver: str
    pci_bus_id: str


class TopologyPair(_Model):
    """One ordered GPU pair of `nvidia-smi topo -m`."""

    gpu_a: int
    gpu_b: int
    code: str = Field(description="the matrix cell: NV<n>, PIX, PXB, PHB, NODE, SYS, X")
    link_class: str = Field(description="nvlink, pcie_switch, host_bridge, cross_socket, self or unknown")
    nvlinks: int = Field(description="NVLink links between the pair (0 if not NVLink)")


TOPOLOGY_PAIR_COLUMNS = columns_of(TopologyPair)


class CpuInfo(_Model):
    model: str
    logical_cores: Optional[int] = None
    physical_cores: Optional[int] = None
    numa_nodes: int
    memory_gib: float
    avx2: bool
    avx512f: bool
    amx: bool
    kernel: str
    hostname: str


class EngineAllReduce(_Model):
    """Which all-reduce path the host's vLLM takes at tensor parallelism > 1, found as vLLM finds it
    (decodescope.exec.engine_comm): on CPUs the kernel library it loads and whether that has the shared-memory
    all-reduce; on GPUs the device communicators it may pick."""

    vllm: Optional[str] = Field(None, description="vLLM's version; None where vLLM is not installed")
    platform: str = Field(description="cpu or gpu")
    cpu_extension: Optional[str] = Field(None, description="_C, _C_AVX512 or _C_AVX2: the kernel library vLLM CPU loads")
    path: str = Field(description="shm, gloo (vLLM CPU), gpu (vLLM's device communicators), none (no vLLM)")
    communicator: Optional[str] = Field(None, description="the micro-benchmark's name for it: vllm_shm, torch_gloo")
    gpu_communicators: list[str] = Field(default_factory=list, description="on GPUs: the communicators vLLM may pick")
    forced: Optional[str] = Field(None, description="'avx2' when DECODESCOPE_CPU_PATH forced vLLM CPU's AVX2 path")
    why: str = ""


class CpuMatmul(_Model):
    """A CPU matmul measurement: the stand-in roofline of a host without GPUs."""

    n: int
    dtype: str
    threads: int
    reps: int
    best_us: float
    gflops: float
    method: str


class HostInventory(Record):
    """data/host.json (00_host): GPUs, their links, versions, CPU, and the peaks later phases use."""

    has_gpu: bool
    gpus: list[GpuInfo] = Field(default_factory=list)
    topology_text: Optional[str] = Field(None, description="`nvidia-smi topo -m` as printed")
    topology_pairs: list[TopologyPair] = Field(default_factory=list)
    interconnect: Optional[str] = Field(None, description="nvlink, pcie, mixed or single; None without GPUs")
    versions: dict[str, Any] = Field(default_factory=dict, description="package, CUDA, NCCL, python versions")
    cpu: CpuInfo
    peaks: Optional[Peaks] = None
    cpu_matmul: Optional[list[CpuMatmul]] = Field(None, description="measured on hosts without GPUs")
    engine_allreduce: Optional[EngineAllReduce] = Field(
        None, description="which all-reduce path the host's vLLM takes (None in host.json written before 00 recorded it)")
