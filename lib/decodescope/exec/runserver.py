"""The run's server: the one the params describe, launched (or attached to) for the run, recorded in
data/server.json (and data/link.json for an ssh host), and found again from there by each phase.

A phase notebook reaches the server the runner started through server.json; run by itself in JupyterLab,
it starts one for itself and stops it after (phase_server). decodescope.exec.server is the server itself.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, cast
from urllib.parse import urlsplit

from decodescope.exec.host import host_for
from decodescope.exec.hostcore import loopback_for
from decodescope.exec.modeldir import placeholder_dirs, resolve_model_dir
from decodescope.exec.server import VllmServer, _pid_alive
from decodescope.exec.serverlaunch import launch_spec, profiler_style_for
from decodescope.schema.params import Params
from decodescope.schema.records import write_record
from decodescope.schema.records_server import ServerInfo
from decodescope.schema.rundata import LINK, SERVER_INFO, RunDir


def write_server_info(run_dir: Path, server: VllmServer, params: Params) -> None:
    """What later phases (and a kernel in JupyterLab) need to reach the run's server."""
    if server.link is not None:
        # the tunnel's measured cost, beside the numbers of whichever run directory uses this server
        write_record(RunDir(run_dir).file(LINK), server.link)
    write_record(RunDir(run_dir).file(SERVER_INFO), ServerInfo(
        base_url=server.base_url,
        model=params.model.name,
        owned=server.proc is not None,
        owner_pid=os.getpid(),
        pid=server.proc.pid if server.proc and server.remote is None else None,  # a pid of this machine
        host=server.host.name if server.host is not None else "local",
        host_pid=server.remote.pid if server.remote is not None else None,
        link=server.link,
        run_token=server.run_token,
        log_path=str(server.log_path) if server.log_path else None,
        tree_pids=server.tree_pids,
        cores={str(pid): c for pid, c in server.cores.items()},  # where each process may run
        start_s=server.started_s,
        launch=server.spec.describe() if server.spec else None,
    ))


def start_for_params(params: Params, run_dir: Path, profiler_dir: Optional[Path] = None) -> VllmServer:
    """Launch (or attach to) the server the params describe; logs go to run_dir/logs/server.log."""
    host = host_for(params)
    if params.server.mode == "attach":
        assert params.server.url is not None  # params require server.url in attach mode
        server = VllmServer.attach(_url_from_here(params.server.url, host), api_key=params.server.api_key)
    else:
        model, tokenizer = resolve_model_dir(params)
        if host.remote and not params.model.path:  # the dummy-weights model dir built here goes there
            on_host = host.push(Path(model))
            tokenizer, model = (on_host if tokenizer == model else tokenizer), on_host
        dirs = {k: host.push(d) if host.remote else str(d) for k, d in placeholder_dirs(params).items()}
        spec = launch_spec(params, model, tokenizer,
                           profiler_dir=host.path(profiler_dir) if profiler_dir is not None else None,
                           profiler_style=profiler_style_for(params, host), host=host, placeholders=dirs)
        server = VllmServer.launch(spec, Path(run_dir) / "logs" / "server.log", params.server.startup_timeout_s,
                                   run_dir=Path(run_dir), host=host,
                                   sync=(Path(profiler_dir),) if profiler_dir is not None else ())
    if host.remote:
        on_host = (cast(str, params.server.url).rstrip("/") if params.server.mode == "attach" else
                   f"http://{loopback_for(params.server.bind_host)}:{params.server.port}")
        health = server.engine.health_path
        server.link = host.measure_link(server.base_url + health, on_host + health)
    write_server_info(run_dir, server, params)
    return server


def _url_from_here(url: str, host) -> str:
    """An attached server's URL as this side reaches it: directly when it answers from here, else through
    a tunnel to where the host reaches it."""
    if not host.remote or VllmServer(url).healthy(timeout_s=3.0):
        return url

    u = urlsplit(url)
    return f"http://127.0.0.1:{host.forward(u.port or 80, u.hostname or '127.0.0.1')}"


def server_from_info(info: ServerInfo, api_key: Optional[str]) -> VllmServer:
    """The server another process of this run (the runner) started, as written in server.json."""
    return VllmServer(info.base_url, api_key=api_key, pid=info.pid, run_token=info.run_token,
                      log_path=Path(info.log_path) if info.log_path else None)


@contextmanager
def phase_server(params: Params, run_dir: Path, profiler_dir: Optional[Path] = None) -> Iterator[VllmServer]:
    """The run's server when the runner started one (a dead one fails the phase: server_died); else,
    for a notebook run by itself in JupyterLab, one started for this phase alone and stopped after it."""
    info = RunDir(run_dir).server_info()
    if info is not None and info.owner_pid != os.getpid() and _pid_alive(info.owner_pid):
        server = server_from_info(info, params.server.api_key)
        server.raise_if_dead("the start of this phase")
        yield server
        return
    server = start_for_params(params, run_dir, profiler_dir=profiler_dir)
    try:
        yield server
    finally:
        server.stop()
