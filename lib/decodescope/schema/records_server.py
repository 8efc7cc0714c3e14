"""Typed records of the run's server: data/server.json (how later phases and a JupyterLab kernel reach
it) and data/link.json (what an ssh tunnel adds to each round trip). decodescope.schema.records says how
records are versioned, read and written."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model


class LinkMeasure(Record):
    """data/link.json: GET /health round trips to the server through the tunnel (from here) and on the
    host itself; their p50 difference is what the link adds to a request's TTFT and E2E."""

    host: str = Field(description="the ssh host's name")
    path: str = Field("ssh tunnel", description="how this side reaches the server")
    n: int = Field(description="round trips each way")
    via_tunnel_p50_ms: Optional[float] = Field(None, description="from here, through the tunnel; None: none answered")
    via_tunnel_p90_ms: Optional[float] = None
    on_host_p50_ms: Optional[float] = Field(None, description="on the host itself; None: none answered")
    on_host_p90_ms: Optional[float] = None
    added_p50_ms: Optional[float] = Field(None, description="via_tunnel_p50_ms - on_host_p50_ms, where both are known")


class ProcessCores(_Model):
    role: str = Field(description="what the process is: api server, engine core, worker ...")
    cpus: Optional[str] = Field(description="the cores it may run on, a cpu list such as 0-15 (None: unreadable)")


class ServerInfo(Record):
    """data/server.json: the run's server as the process that started it (the runner) wrote it."""

    base_url: str = Field(description="the server's URL as this side reaches it (a tunnel's for an ssh host)")
    model: str = Field(description="the served model name requests name")
    owned: bool = Field(description="started by this run (else attached to)")
    owner_pid: int = Field(description="the process that started or attached it; a phase of another process reuses it")
    pid: Optional[int] = Field(None, description="the server's pid on this machine (None: attached or on a host)")
    host: str = Field("local", description="where it runs: 'local' or the ssh host's name")
    host_pid: Optional[int] = Field(None, description="its pid on the ssh host")
    link: Optional[LinkMeasure] = Field(None, description="the tunnel's measured cost (ssh hosts)")
    run_token: Optional[str] = Field(None, description="the token every process of its tree carries")
    log_path: Optional[str] = None
    tree_pids: list[int] = Field(default_factory=list, description="its process tree at start")
    cores: dict[str, ProcessCores] = Field(default_factory=dict, description="pid -> where it may run, at start")
    start_s: Optional[float] = Field(None, description="launch to healthy, seconds")
    launch: Optional[dict[str, Any]] = Field(None, description="the launch spec as described (argv, env keys)")
