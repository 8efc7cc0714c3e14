"""The run's experiment variants (params.experiments): each measured into variants/<name>/ after the
baseline's server phases, against a server with the variant's settings, restarted only when they change.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from decodescope.core.io import write_text_atomic
from decodescope.core.rundir import ensure_layout
from decodescope.exec.runserver import write_server_info
from decodescope.orchestration.progress import Progress
from decodescope.orchestration.runmanifest import Manifest, set_fields, utc_now
from decodescope.orchestration.supervise import _execute_checked, _start_server, _stop_server
from decodescope.schema.params import Params, dump_yaml, redact, with_experiment


def _run_variants(params: Params, run_dir: Path, manifest: Manifest, progress: "Progress", server,
                  notebook_params: Path, notebook_dir: Path):
    """Each variant of params.experiments into variants/<name>/: its serving sweep (and profile when
    asked) against a server with its settings, restarted only when those change. A variant whose
    server does not start, or whose phases fail, is recorded failed and the next one runs. Returns the
    server left running (or None)."""
    key = None  # the baseline's server: its settings (and profiler) are the baseline's, not a variant's
    t_start, done = time.monotonic(), []
    for n, exp in enumerate(params.experiments, 1):
        entry = manifest.variant(exp.name)
        label = f"variant {exp.name} ({n} of {len(params.experiments)})"
        if entry.status == "ok":
            progress.note(f"{label} ... skipped (ok in a previous run)")
            continue
        vparams = with_experiment(params, exp.name)
        vdir = ensure_layout(run_dir / "variants" / exp.name)
        write_text_atomic(vdir / "params.yaml", dump_yaml(vparams))
        set_fields(entry, status="running", start=utc_now(), error=None, params=redact(exp.model_dump(mode="json")))
        manifest.save()
        t0 = time.monotonic()
        profiler_dir = vdir / "traces" if exp.profile else None
        want = json.dumps({"server": vparams.server.model_dump(mode="json"), "profiler": str(profiler_dir)},
                          sort_keys=True)
        if server is not None and server.proc is not None and key != want:
            progress.note(f"{label}: its server settings differ; stopping the running server ...")
            _stop_server(server, manifest)
            server = None
        if server is None:
            server, err = _start_server(vparams, vdir, manifest, progress, profiler_dir)
            key = want if server is not None else None
            if server is None:
                set_fields(entry, status="failed", end=utc_now(), error=f"server did not start: {err}"[:4000],
                           duration_s=time.monotonic() - t0)
                manifest.save()
                done.append(entry.duration_s or 0.0)
                progress.note(f"{label} ... failed: server did not start ({entry.duration_s:.1f} s)")
                continue
        else:
            write_server_info(vdir, server, vparams)
            progress.note(f"{label}: the running server has its settings; reused")
        errors = {}
        for phase in ["01_serving"] + (["04_profile"] if exp.profile else []):
            progress.note(f"{label}: {phase} ...")
            error, _, server = _execute_checked(phase, vdir, notebook_params, notebook_dir, server, manifest,
                                                progress, entry, variant=exp.name)
            if error:
                errors[phase] = error
                if server is None:
                    key = None
                    break
        set_fields(entry, status="failed" if errors else "ok", end=utc_now(), duration_s=time.monotonic() - t0,
                   error="; ".join(f"{k}: {v}" for k, v in errors.items())[:4000] if errors else None)
        manifest.save()
        done.append(entry.duration_s or 0.0)
        left = len(params.experiments) - n
        eta = f"about {sum(done) / len(done) * left:.0f} s left" if left else "done"
        progress.note(f"{label} ... {entry.status} ({entry.duration_s:.1f} s; variants elapsed "
                      f"{time.monotonic() - t_start:.0f} s, {eta})"
                      + (f" - {next(iter(errors.values())).splitlines()[0][:200]}" if errors else ""))
    return server
