"""What the vLLM engine says of itself in its log: the CUDA-graph and compilation modes it runs with.

vLLM (V1, GPU 0.2x and CPU 0.3x alike) logs its whole config once per engine start.
It does so in the line "Initializing a V1 LLM engine (vX) with config: ...".
That line holds `enforce_eager=...` and the compilation config's `'mode': <CompilationMode.NAME: n>`.
It also holds the compilation config's `'cudagraph_mode': <CUDAGraphMode.NAME: ...>`.
On the GPU the default is FULL_AND_PIECEWISE graphs with VLLM_COMPILE.
`--enforce-eager` gives NONE and NONE.
The CPU build runs no CUDA graphs (NONE) and compiles with DYNAMO_TRACE_ONCE.
vLLM 0.2x also says whether it schedules asynchronously.
The API server and the engine core each log "Asynchronous scheduling is enabled/disabled.".
N-gram speculative decoding turns it off ("Async scheduling not supported with ngram-based speculative decoding").
The host's scheduling of a step then no longer overlaps the GPU's work on the one before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

_ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine \((?P<version>[^)]*)\) with config: (?P<config>.*)")
_CUDAGRAPH = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(?P<mode>[A-Z_]+)")
_COMPILATION = re.compile(r"'mode': <CompilationMode\.(?P<mode>[A-Z_]+)")
_EAGER = re.compile(r"enforce_eager=(?P<eager>True|False)")
_ASYNC = re.compile(r"Asynchronous scheduling is (?P<state>enabled|disabled)")
_SPLITTING = re.compile(r"'splitting_ops': \[(?P<ops>[^\]]*)\]")


@dataclass(frozen=True)
class EngineModes:
    vllm_version: str
    cudagraph_mode: Optional[str]      # FULL_AND_PIECEWISE, PIECEWISE, FULL, NONE, ...
    compilation_mode: Optional[str]    # VLLM_COMPILE, DYNAMO_TRACE_ONCE, NONE, ...
    enforce_eager: Optional[bool]
    async_scheduling: Optional[bool] = None   # None: the log does not say (vLLM CPU, older versions)
    # the ops piecewise CUDA graphs leave out and run on the host (attention, KV-cache updates), as configured
    splitting_ops: tuple = ()

    def describe(self) -> str:
        graphs = "no CUDA graphs" if self.cudagraph_mode in (None, "NONE") else f"CUDA graphs {self.cudagraph_mode}"
        compiled = ("no torch.compile" if self.compilation_mode in (None, "NONE")
                    else f"torch.compile {self.compilation_mode}")
        return f"vLLM {self.vllm_version}: {graphs}, {compiled}" + (", async scheduling off"
                                                                     if self.async_scheduling is False else "")


def engine_modes(log_text: str) -> list[EngineModes]:
    """Each engine start's modes, in the order the log has them."""
    out: list[EngineModes] = []
    scheduling: Optional[bool] = None   # the latest statement, which the API server makes before the engine line
    for line in log_text.splitlines():
        a = _ASYNC.search(line)
        if a:
            state = a.group("state") == "enabled"
            if "APIServer" in line or not out:   # the API server speaks before the engine it starts
                scheduling = state
            else:  # the engine core's own statement, after its engine line, is the one that holds
                out[-1] = replace(out[-1], async_scheduling=state)
            continue
        m = _ENGINE_LINE.search(line)
        if not m:
            continue
        config = m.group("config")
        graph, comp, eager = _CUDAGRAPH.search(config), _COMPILATION.search(config), _EAGER.search(config)
        split = _SPLITTING.search(config)
        out.append(EngineModes(vllm_version=m.group("version").lstrip("v"),
                               cudagraph_mode=graph.group("mode") if graph else None,
                               compilation_mode=comp.group("mode") if comp else None,
                               enforce_eager=(eager.group("eager") == "True") if eager else None,
                               async_scheduling=scheduling,
                               splitting_ops=tuple(re.findall(r"'([^']+)'", split.group("ops"))) if split else ()))
        scheduling = None
    return out


def last_engine_modes(log_path: Path) -> Optional[EngineModes]:
    """The modes of the last engine start logged in log_path; None where the file or the line is missing."""
    try:
        found = engine_modes(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    return found[-1] if found else None
