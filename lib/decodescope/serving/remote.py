"""The serving client and the network between it and an ssh host's server.

With `host: ssh://...` the client runs here and reaches the server through an ssh tunnel, so every request
also crosses the network: `link_note` says how much the tunnel adds (measured when the server started,
data/link.json). With `host.loadgen: remote` the same sweep (serving.sweep.run_sweep) runs on the host
itself, next to the server, and its per-level files are copied back as each level finishes; the tables
here are then combined from them as from a local sweep.

    python -m decodescope.serving.remote DATA_DIR      (on the host; the config in DECODESCOPE_SWEEP_CONFIG)
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.core.logsetup import run_program
from decodescope.exec.host import host_for
from decodescope.exec.hostcore import LinkDropped
from decodescope.schema.records import read_record
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.records_server import LinkMeasure
from decodescope.schema.rundata import LINK
from decodescope.exec.server import log_tail
from decodescope.serving.sweep import SweepConfig, combine, run_sweep
from decodescope.serving.telemetry_read import TELEMETRY_DIR

CONFIG_ENV = "DECODESCOPE_SWEEP_CONFIG"


def url_on_host(params) -> str:
    """The server's URL as its own host reaches it."""
    if params.server.mode == "attach":
        return params.server.url
    bind = params.server.bind_host
    return f"http://{'127.0.0.1' if bind in ('0.0.0.0', '::', '') else bind}:{params.server.port}"


def sweep_on_host(ctx: PhaseContext, server) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phase's sweep run by the load generator on the server's host; levels already finished here are
    skipped there too (they are copied there first), each finished level comes back as it is written."""
    params = ctx.params
    host = host_for(params)
    cfg = dataclasses.replace(SweepConfig.from_params(params, url_on_host(params)), telemetry_gpu=True)
    serving, telemetry = ctx.data_dir / "serving", ctx.data_dir / TELEMETRY_DIR
    for d in (serving, telemetry):
        d.mkdir(parents=True, exist_ok=True)
    host.push(serving)
    log = ctx.run_dir / "logs" / "loadgen.log"
    # the config (its api key too) goes on the supervisor's stdin, never a command line
    handle = host.start([host.python, "-m", "decodescope.serving.remote", host.path(ctx.data_dir)], log,
                        env={CONFIG_ENV: json.dumps(dataclasses.asdict(cfg))}, grace_s=5.0,
                        sync=[serving, telemetry])
    try:
        while handle.poll() is None:
            time.sleep(2.0)
            server.raise_if_dead("the serving sweep (load generator on the host)")
    finally:
        handle.stop()
    if handle.link_lost:
        raise LinkDropped(f"the ssh link to {host.name} dropped during the serving sweep; the levels that "
                          "finished were copied back; `decodescope run --resume RUN_DIR` measures the rest")
    if handle.returncode != 0:
        raise RuntimeError(f"the load generator on {host.name} exited with {handle.returncode}; last lines of "
                           f"{log}:\n{log_tail(log, 25)}")
    return combine(ctx.data_dir, cfg.slo)


def _ms(value: Optional[float]) -> str:
    return f"{float('nan') if value is None else value:.2f}"


def link_note(data_dir: Path, params) -> str:
    """What the network between this client and the server adds to the figures ('' for a local host)."""
    path = Path(data_dir) / LINK
    if not path.is_file():
        return ""
    link = read_record(path, LinkMeasure)
    added = link.added_p50_ms
    measured = (f"GET /health p50 {_ms(link.via_tunnel_p50_ms)} ms through the tunnel, {_ms(link.on_host_p50_ms)} "
                f"ms on the host itself, {link.n} round trips each ({path.parent.parent.name}/data/link.json)")
    if params.host.loadgen == "remote":
        return (f"**Network:** the load generator ran on {link.host}, next to the server, and its records "
                f"were copied back: these figures carry no network. (The ssh tunnel from here would add about "
                f"{added:.2f} ms per round trip: {measured}.)") if added is not None else ""
    return (f"**Network:** the server runs on {link.host} and this client reaches it through an ssh tunnel, "
            f"which adds about {_ms(added)} ms to every round trip "
            f"({measured}). TTFT and E2E below include it once per request; ITL and TPOT carry only its jitter. "
            "A client far from the server measures the network too: to leave it out, set `host.loadgen: remote` "
            "(the load generator then runs on the host and its records are copied back).")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    doc = json.loads(os.environ.pop(CONFIG_ENV))
    fields = {f.name for f in dataclasses.fields(SweepConfig)}
    run_sweep(SweepConfig(**{k: v for k, v in doc.items() if k in fields}), Path(argv[0]), progress=True)
    return 0


if __name__ == "__main__":  # the load generator on the host: its progress as plain lines on stderr (loadgen.log)
    run_program(main)
