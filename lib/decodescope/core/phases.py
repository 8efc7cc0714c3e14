"""The one phase registry: each phase's name (its notebook's stem), title, whether the runner gives it the
inference server, whether it runs anything on the host (the others only read files here), and the files
it writes that others read. Everything that names phases reads them from here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    needs_server: bool = False    # the runner starts (or attaches to) the server for it
    on_host: bool = True          # runs something on the run's host (local or over ssh)
    writes: tuple[str, ...] = ()  # data files of its own that another phase or a comparison reads
    host_alone: bool = False      # measures the host with no server up: run before the server phases


REGISTRY = (
    Phase("00_host", "Host inventory", writes=("host.json",)),
    Phase("01_serving", "Serving sweep", needs_server=True, writes=("serving_levels.parquet",)),
    Phase("02_gemm", "GEMM micro-benchmarks", writes=("gemm.parquet",), host_alone=True),
    Phase("03_collectives", "Collective micro-benchmarks", writes=("collectives.parquet",), host_alone=True),
    Phase("04_profile", "Profile of decode steps", needs_server=True, writes=("profile_summary.json",)),
    Phase("05_verdict", "Verdict", on_host=False, writes=("verdict.json",)),
)

PHASES = tuple(p.name for p in REGISTRY)
SERVER_PHASES = frozenset(p.name for p in REGISTRY if p.needs_server)
HOST_PHASES = tuple(p.name for p in REGISTRY if p.on_host)
PHASE_TITLES = {p.name: p.title for p in REGISTRY}
PHASE_OF = {f: p.name for p in REGISTRY for f in p.writes}  # data file -> the phase that writes it
HOST_ALONE = frozenset(p.name for p in REGISTRY if p.host_alone)


def execution_order(selected: list[str]) -> list[str]:
    """The order the runner executes the selected phases in: the micro-benchmarks, which need the host to
    themselves and read nothing a server phase writes, before the first server phase, so that one server
    start serves 01 and 04 (a start is 45-130 s on 2 CPU cores, 112-134 s on the H200); otherwise as
    listed."""
    first_server = next((i for i, p in enumerate(selected) if p in SERVER_PHASES), len(selected))
    return sorted(selected, key=lambda p: (0 if p in HOST_ALONE or selected.index(p) < first_server else 1,
                                           selected.index(p)))
