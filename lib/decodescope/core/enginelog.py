"""What the vLLM engine says of itself in its log: the CUDA-graph and compilation modes it runs with.

vLLM (V1, GPU 0.2x and CPU 0.3x alike) logs its whole config once per engine start, in the line
"Initializing a V1 LLM engine (vX) with config: ...", with `enforce_eager=...` and the compilation
config's `'mode': <CompilationMode.NAME: n>` and `'cudagraph_mode': <CUDAGraphMode.NAME: ...>`. On the GPU
the default is FULL_AND_PIECEWISE graphs with VLLM_COMPILE; `--enforce-eager` gives NONE and NONE; the CPU
build runs no CUDA graphs (NONE) and compiles with DYNAMO_TRACE_ONCE.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine \((?P<version>[^)]*)\) with config: (?P<config>.*)")
_CUDAGRAPH = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(?P<mode>[A-Z_]+)")
_COMPILATION = re.compile(r"'mode': <CompilationMode\.(?P<mode>[A-Z_]+)")
_EAGER = re.compile(r"enforce_eager=(?P<eager>True|False)")


@dataclass(frozen=True)
class EngineModes:
    vllm_version: str
    cudagraph_mode: Optional[str]      # FULL_AND_PIECEWISE, PIECEWISE, FULL, NONE, ...
    compilation_mode: Optional[str]    # VLLM_COMPILE, DYNAMO_TRACE_ONCE, NONE, ...
    enforce_eager: Optional[bool]

    def describe(self) -> str:
        graphs = "no CUDA graphs" if self.cudagraph_mode in (None, "NONE") else f"CUDA graphs {self.cudagraph_mode}"
        compiled = ("no torch.compile" if self.compilation_mode in (None, "NONE")
                    else f"torch.compile {self.compilation_mode}")
        return f"vLLM {self.vllm_version}: {graphs}, {compiled}"


def engine_modes(log_text: str) -> list[EngineModes]:
    """Each engine start's modes, in the order the log has them."""
    out = []
    for line in log_text.splitlines():
        m = _ENGINE_LINE.search(line)
        if not m:
            continue
        config = m.group("config")
        graph, comp, eager = _CUDAGRAPH.search(config), _COMPILATION.search(config), _EAGER.search(config)
        out.append(EngineModes(vllm_version=m.group("version").lstrip("v"),
                               cudagraph_mode=graph.group("mode") if graph else None,
                               compilation_mode=comp.group("mode") if comp else None,
                               enforce_eager=(eager.group("eager") == "True") if eager else None))
    return out


def last_engine_modes(log_path: Path) -> Optional[EngineModes]:
    """The modes of the last engine start logged in log_path; None where the file or the line is missing."""
    try:
        found = engine_modes(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    return found[-1] if found else None
