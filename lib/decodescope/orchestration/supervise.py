"""What the runner watches around each phase: the server it starts and stops between phases (each start
and teardown recorded in the manifest), the processes a phase's kernel leaves behind (stopped), and a server
that died under a phase (which fails the phase, even when the phase itself finished).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from decodescope.core.phases import SERVER_PHASES
from decodescope.exec import procs, runserver, server as srv
from decodescope.exec.hostcore import RUN_ID_ENV
from decodescope.exec.locks import LockHeld
from decodescope.orchestration.phasenotebooks import _short_error, execute_phase
from decodescope.orchestration.progress import Progress
from decodescope.orchestration.runmanifest import Manifest, utc_now
from decodescope.schema.records_manifest import (PhaseEntry, RunManifest, ServerLaunch, ServerState, Teardown,
                                                 VariantEntry)

log = logging.getLogger(__name__)


def _execute_checked(phase: str, run_dir: Path, notebook_params: Path, notebook_dir: Path, server, manifest: Manifest,
                     progress: "Progress", entry: PhaseEntry | VariantEntry, variant: str = ""):
    """One notebook, then what it may have left behind: stray processes are stopped, and a server that
    died fails the phase even when the phase finished first. Returns (error or None, the executed
    notebook, the server or None when it died)."""
    error: Optional[str] = None
    nb = run_dir / "notebooks" / f"{phase}.ipynb"
    try:
        nb = execute_phase(phase, run_dir, notebook_params, notebook_dir, variant, manifest.record.overrides)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a failed phase is recorded and the run goes on
        error = _short_error(e)
    _reap_strays(os.environ.get(RUN_ID_ENV, run_dir.name), server, manifest, entry)
    if phase in SERVER_PHASES and server is not None:
        reason = server.dead_reason()
        if reason:
            died = server.died_error(reason, f"phase {phase}" + (f" of variant {variant}" if variant else ""))
            if not error or srv.SERVER_DIED not in error:
                error = str(died)[:4000] + (f"\n(the phase's own error: {error})" if error else "")
            progress.note(f"the inference server died: {reason}; tearing down what is left of it")
            _stop_server(server, manifest)
            server = None
    return error, nb, server


def _reap_strays(run_id: str, server, manifest: Manifest, entry: PhaseEntry | VariantEntry | None = None) -> None:
    """A phase's kernel is gone when the phase ends; anything it started (a probe, a torchrun rank, a
    server of its own) that is still alive would outlive the run, and is stopped here. The run's own
    server is kept."""
    keep = set(server.process_tree()) if server is not None and server.proc is not None else set()
    stopped = 0
    for _ in range(3):  # a stray being stopped (a kernel, a torchrun agent) may have started another meanwhile
        strays = [p for p in procs.run_processes(run_id, env_name=RUN_ID_ENV) if p not in keep]
        if not strays:
            break
        procs.terminate_pids(strays)  # returns once they are dead
        stopped += len(strays)
    if stopped:
        held: PhaseEntry | VariantEntry | RunManifest = entry if entry is not None else manifest.record
        held.stray_processes_stopped = stopped + (held.stray_processes_stopped or 0)
    # No process of the run but its server is alive now, so no probe rank can make a segment any more: the run's
    # probe segments are swept by the run's key. The launcher sweeps its own when it can, but a launcher that
    # is itself stopped mid-teardown (a phase's kernel: jupyter kills it 5 s after an interrupt, before ranks
    # that are slow to die are gone) cannot.
    removed = procs.unlink_all(procs.probe_shm_of_run(run_id))
    if removed:
        log.info("removed %d probe segment(s) of the run from /dev/shm: %s", len(removed),
                 ", ".join(p.name for p in removed))


def _stop_server(server, manifest: Manifest) -> None:
    """Tear the server down and record what teardown found (processes signalled, shm files removed)."""
    server.stop()
    record = manifest.record
    record.teardowns = [*record.teardowns, Teardown(
        at=utc_now(), signalled=len(server.teardown.get("signalled", [])),
        shm_removed=len(server.teardown.get("shm_removed", [])), left=server.teardown.get("left", []))]
    if record.server is None:
        record.server = ServerState()
    record.server.stopped = utc_now()
    manifest.try_save()  # a full disk must not stop the teardown from being reported by the caller


def _start_server(params, run_dir, manifest, progress, profiler_dir: Optional[Path]):
    progress.note(f"starting the inference server ({params.server.mode}) ...")
    t0 = time.monotonic()
    try:
        server = runserver.start_for_params(params, run_dir, profiler_dir=profiler_dir)
    except (srv.ServerError, OSError, LockHeld) as e:
        manifest.record.server = ServerState(status="failed", error=str(e)[:4000])
        manifest.save()
        progress.note(f"server failed: {str(e).splitlines()[0]}")
        return None, str(e)
    manifest.record.server = ServerState(status="up", base_url=server.base_url, start_s=time.monotonic() - t0,
                                         pids=server.tree_pids, profiler_dir=str(profiler_dir) if profiler_dir else None,
                                         launch=server.spec.describe() if server.spec else None)
    # every server this run started, for the record (and for checking that none outlived it)
    manifest.record.servers = [*manifest.record.servers, ServerLaunch(
        started=utc_now(), start_s=time.monotonic() - t0, pids=server.tree_pids, pgid=server.pgid,
        run_token=server.run_token, shm_files=sorted(map(str, server.shm_files)))]
    manifest.save()
    progress.note(f"server healthy at {server.base_url} after {time.monotonic() - t0:.1f} s")
    return server, None
