"""Papermill orchestration: the run directory, the manifest, phases in order, the report at the end.

Each phase's status is written to manifest.json (atomically) as it starts and ends, so a crash or
Ctrl-C keeps what was measured; `--resume RUN_DIR` skips the phases already ok.

Which notebooks and how papermill runs one: orchestration.phasenotebooks. The server and the strays around
each phase: orchestration.supervise. The experiment variants: orchestration.runvariants.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from decodescope.exec import server as srv
from decodescope.exec.engine_comm import CpuPathError, apply_cpu_path_here
from decodescope.exec.host import close_all as close_hosts, preflight
from decodescope.exec.hostcore import RUN_ID_ENV
from decodescope.core.io import write_text_atomic
from decodescope.exec.locks import holder_info, run_dir_lock
from decodescope.schema.params import (Params, ParamsError, dump_yaml, load_params, params_as_dict,
                                       relative_config_files, with_experiment, with_overrides)
from decodescope.core.phases import SERVER_PHASES, execution_order
from decodescope.report.html import build_report
from decodescope.report import index as run_index
from decodescope.core.rundir import make_run_dir
from decodescope.exec.server import hold_port, release_port
from decodescope.orchestration.phasenotebooks import NOTEBOOK_DIR, select_phases
from decodescope.orchestration.progress import Progress, run_logging
from decodescope.orchestration.runmanifest import Manifest, ResultsWriteError, RunError, set_fields, utc_now
from decodescope.orchestration.runvariants import _run_variants
from decodescope.orchestration.supervise import _execute_checked, _reap_strays, _start_server, _stop_server


class Terminated(KeyboardInterrupt):
    """SIGTERM (e.g. from a scheduler): handled like Ctrl-C, reported with its own exit status."""


def new_run_dir(params: Params) -> Path:
    """`<output_root>/<UTC stamp>-<run name>` with its subfolders (decodescope.core.rundir)."""
    return make_run_dir(params.output_root(), params.run_name)


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM ends a run the way Ctrl-C does: finally blocks run and the server tree is torn down. SIGINT
    interrupts the run even when it was started with SIGINT ignored (a shell script's background job
    inherits that), so `kill -INT` from a script or a scheduler stops it as Ctrl-C would."""
    def handler(signum, frame):
        raise Terminated(f"signal {signum}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def run(params_path: Path, phases: Optional[list[str]] = None, resume: Optional[Path] = None,
        notebook_dir: Path = NOTEBOOK_DIR, on_server: Optional[Callable] = None,
        overrides: Optional[dict] = None) -> tuple[Path, bool]:
    """Run the phases; returns (run_dir, all_ok). Raises ParamsError before anything starts, LockHeld
    when another run holds the port or the run directory, ResultsWriteError when a result cannot be
    written, KeyboardInterrupt (Terminated for SIGTERM) when interrupted."""
    params = load_params(params_path)

    try:  # DECODESCOPE_CPU_PATH=avx2: every process of the run (server, probes, notebooks) sees an AVX2-only host
        apply_cpu_path_here()
    except CpuPathError as e:
        raise RunError(str(e)) from None
    if resume and (Path(resume) / "manifest.json").is_file():
        # as the run began, with this command's overrides over them (--variants a first run did not list):
        # the phases' notebooks read them from the manifest, so they must see what this run measures
        overrides = _resumed_overrides(Manifest.load(Path(resume)).record.overrides, overrides or {})
    params = with_overrides(params, overrides or {})
    selected = select_phases(params, phases, notebook_dir)
    _check_variants(params, overrides or {}, selected)
    needs_port = params.server.mode == "launch" and any(p in SERVER_PHASES for p in selected)

    # an ssh host: one connection for the run, its decodescope checked, before anything is made (HostError);
    # on --resume, what finished there while the link was down is copied back first
    preflight(params, Path(resume).resolve() if resume else None, selected)
    if needs_port:  # before the run directory exists: a second run makes nothing
        hold_port(params.server.port)
    try:
        if resume:
            run_dir = Path(resume).resolve()
            Manifest.load(run_dir)  # refuses a directory with no readable manifest before taking its lock
            dir_lock = run_dir_lock(run_dir).acquire(holder_info(run_dir))
        else:
            try:
                run_dir = new_run_dir(params)
            except OSError as e:
                raise ResultsWriteError(getattr(e, "filename", None) or params.output_root(), e) from None
            dir_lock = run_dir_lock(run_dir).acquire(holder_info(run_dir))
        if needs_port:
            hold_port(params.server.port, run_dir)  # the holder line now names the run directory
        try:
            with run_logging(run_dir):
                return _run_locked(params, selected, run_dir, resume, notebook_dir, on_server, overrides or {})
        finally:
            dir_lock.release()
    finally:
        if needs_port:
            release_port(params.server.port)
        close_hosts()


def _resumed_overrides(first: dict, now: dict) -> dict:
    """The overrides a resumed run goes on with: the first run's, with this command's over them; the variants
    (experiments) of both, this command's replacing one of the same name, so the verdict still sees the
    variants the first run measured (those already ok are skipped)."""
    out = {**first, **now}
    if "experiments" in first and "experiments" in now:
        names = {e["name"] for e in now["experiments"]}
        out["experiments"] = [e for e in first["experiments"] if e["name"] not in names] + list(now["experiments"])
    return out


def _check_variants(params: Params, overrides: dict, selected: list[str]) -> None:
    """Every variant this run will measure, as its phases' notebooks will load it (the params file, the
    overrides, then the variant); ParamsError naming each that fails, before anything starts."""
    if not params.experiments or "01_serving" not in selected or params.source_path is None:
        return
    seen = with_overrides(load_params(params.source_path), overrides)
    bad = []
    for exp in params.experiments:
        try:
            with_experiment(seen, exp.name)
        except ParamsError as e:
            bad.append((f"experiments[{exp.name}]", f"the variant's phases could not load it: {e}"))
    if bad:
        raise ParamsError(params.source_path, bad)


def _run_locked(params: Params, selected: list[str], run_dir: Path, resume: Optional[Path],
                notebook_dir: Path, on_server: Optional[Callable], overrides: dict) -> tuple[Path, bool]:
    # every process of this run (kernels, probes, servers) inherits the run id: tests and operators can
    # find them all by walking /proc
    os.environ[RUN_ID_ENV] = run_dir.name
    manifest = _open_manifest(params, selected, run_dir, resume, overrides)
    progress = Progress(len(selected))
    progress.note(f"decodescope run {run_dir}")
    for change in (c for c in manifest.record.params_changes if resume and c.resumed == manifest.record.resumed[-1]):
        progress.note(f"params changed since the run began ({'; '.join(change.changed[:5])}): kept as {change.before}")
    # Notebooks read the source params (with secrets and relative paths intact).
    assert params.source_path is not None  # set by load_params; Path(None) would raise here anyway
    loop = _PhaseLoop(params, selected, run_dir, Path(params.source_path), notebook_dir, manifest, progress, on_server)
    interrupted: Optional[KeyboardInterrupt] = None
    write_error: Optional[ResultsWriteError] = None
    with sigterm_as_interrupt():
        try:
            loop.run_all()
        except KeyboardInterrupt as e:
            interrupted = e
        except ResultsWriteError as e:
            write_error = e
        finally:
            ok, write_error = loop.finish(interrupted, write_error)
    try:
        if interrupted:
            raise interrupted
        if write_error:
            raise write_error
        _write_report(run_dir, manifest)
    finally:
        manifest.release_reserve()
    _rebuild_index(run_dir.parent, progress)
    return run_dir, ok


def _open_manifest(params: Params, selected: list[str], run_dir: Path, resume: Optional[Path],
                   overrides: dict) -> Manifest:
    """The run's manifest, created or (on --resume) reopened with the selected phases, its disk reserve
    taken, and the params as run written beside it."""
    if resume:
        manifest = Manifest.load(run_dir)
        for p in selected:
            manifest.phase(p)
        manifest.record.status = "running"
        manifest.record.resumed = [*manifest.record.resumed, utc_now()]
        manifest.record.overrides = overrides  # the first run's, with this command's over them (run())
        manifest.record_params_change(params_as_dict(params), params.source_path)
        manifest.save()
    else:
        manifest = Manifest.create(run_dir, params, selected)

        if overrides:  # each phase's notebook gets them as a papermill parameter (execute_phase)
            manifest.record.overrides = overrides
            manifest.save()
    manifest.reserve_space()
    run_params_path = run_dir / "params.yaml"
    if not run_params_path.exists():
        # The params as run, secrets redacted; notebooks read the original file for secrets.
        try:
            write_text_atomic(run_params_path, dump_yaml(params))
        except OSError as e:
            raise ResultsWriteError(run_params_path, e) from None
    try:  # a resume's new variants may name drafts the first run did not
        _copy_config_files(params, run_dir)
    except OSError as e:
        raise ResultsWriteError(run_dir / "models", e) from None
    return manifest


def _copy_config_files(params: Params, run_dir: Path) -> None:
    """The model configs the params name relative to themselves, beside the run's params.yaml at the same
    relative paths, so that the run's own params load (a later verdict, compare or resume of it)."""
    if params.source_path is None:
        return
    for rel in relative_config_files(params):
        src, dest = params.resolve(rel), run_dir / rel
        if src.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(dest, src.read_text())


def _write_report(run_dir: Path, manifest: Manifest) -> None:
    try:
        report = build_report(run_dir)
    except OSError as e:
        err = ResultsWriteError(getattr(e, "filename", None) or run_dir / "report.html", e)
        set_fields(manifest.record, status="failed", error=f"report: {err}")
        manifest.try_save()
        raise err from None
    manifest.record.report = str(report.relative_to(run_dir))
    manifest.save()


class _PhaseLoop:
    """The selected phases in execution order (decodescope.core.phases), the server started for the first
    phase that needs it and stopped before one that needs the host alone, the variants after the last
    server phase; each phase's outcome in the manifest as it ends."""

    def __init__(self, params: Params, selected: list[str], run_dir: Path, notebook_params: Path,
                 notebook_dir: Path, manifest: Manifest, progress: Progress, on_server: Optional[Callable]):
        self.params, self.selected, self.run_dir = params, selected, run_dir
        self.notebook_params, self.notebook_dir = notebook_params, notebook_dir
        self.manifest, self.progress, self.on_server = manifest, progress, on_server
        self.todo = [p for p in selected if manifest.phase(p).status != "ok"]
        self.server: Optional[srv.VllmServer] = None
        self.server_error: Optional[str] = None

    def run_all(self) -> None:
        order = execution_order(self.selected)
        variants_due = bool(self.params.experiments) and "01_serving" in self.selected
        last_server_phase = max((i for i, p in enumerate(order, 1) if p in SERVER_PHASES), default=0)
        for i, phase in enumerate(order, 1):
            if variants_due and i > last_server_phase:
                # the variants run after the baseline's measurements and before the verdict reads them
                self._variants()
                variants_due = False
            self._phase(i, phase)
        if variants_due:
            self._variants()

    def _variants(self) -> None:
        self.server = _run_variants(self.params, self.run_dir, self.manifest, self.progress, self.server,
                                    self.notebook_params, self.notebook_dir)

    def _phase(self, i: int, phase: str) -> None:
        manifest, progress, n = self.manifest, self.progress, len(self.selected)
        if phase not in self.todo:
            progress.note(f"[{i}/{n}] {phase} ... skipped (ok in a previous run)")
            return
        if phase not in SERVER_PHASES and self.server is not None and self.server.proc is not None:
            # micro-benchmarks need the host to themselves: on a GPU host the server holds
            # most of the GPUs' memory and its workers compete for the same cores
            progress.note("stopping the inference server while this phase runs ...")
            _stop_server(self.server, manifest)
            self.server = None
        if phase in SERVER_PHASES and self.server is None and self.server_error is None:
            self.server, self.server_error = _start_server(
                self.params, self.run_dir, manifest, progress,
                self.run_dir / "traces" if "04_profile" in self.selected else None)
            if self.server is not None and self.on_server:
                self.on_server(self.server)
        progress.start(i, phase)
        manifest.update_phase(phase, status="running", start=utc_now(), end=None, error=None)
        t0 = time.monotonic()
        if phase in SERVER_PHASES and self.server is None:
            manifest.update_phase(phase, status="failed", end=utc_now(), duration_s=0.0,
                                  error=f"server did not start: {self.server_error}")
            progress.end("failed", " - server did not start")
            return
        try:
            error, nb, self.server = _execute_checked(phase, self.run_dir, self.notebook_params, self.notebook_dir,
                                                      self.server, manifest, progress, manifest.phase(phase))
        except KeyboardInterrupt as e:
            what = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C/SIGTERM"
            manifest.update_phase(phase, status="failed", end=utc_now(),
                                  duration_s=time.monotonic() - t0, error=f"interrupted ({what})")
            progress.end("interrupted")
            raise
        if error is None:
            manifest.update_phase(phase, status="ok", end=utc_now(), duration_s=time.monotonic() - t0,
                                  notebook=str(nb.relative_to(self.run_dir)))
            progress.end("ok")
        else:
            manifest.update_phase(phase, status="failed", end=utc_now(), duration_s=time.monotonic() - t0,
                                  error=error, notebook=f"notebooks/{phase}.ipynb")
            progress.end("failed", f" - {error.splitlines()[0][:200]}")

    def finish(self, interrupted: Optional[KeyboardInterrupt],
               write_error: Optional[ResultsWriteError]) -> tuple[bool, Optional[ResultsWriteError]]:
        """Whatever happened: the server stopped, strays reaped, the run's status saved (through the
        disk reserve after a failed write). Returns (every phase ok, the write error to raise)."""
        manifest = self.manifest
        if self.server is not None and self.server.proc is not None:
            self.progress.note("stopping the vLLM server and its workers ...")
            _stop_server(self.server, manifest)
        _reap_strays(self.run_dir.name, None, manifest)
        ok = all(manifest.phase(p).status == "ok" for p in self.selected) and not phase_failed_variants(manifest)
        manifest.record.status = "interrupted" if interrupted else "failed" if write_error or not ok else "ok"
        if write_error:
            manifest.record.error = str(write_error)
        manifest.record.finished = utc_now()
        final_save_error = manifest.try_save()  # always: after a failed write it uses the reserve
        return ok, write_error or final_save_error


def phase_failed_variants(manifest: Manifest) -> list[str]:
    """The variants whose phases ran and failed (a variant whose server did not start is recorded failed and
    the run goes on; one whose 01 or 04 failed fails the run: no run says ok with a failed phase)."""
    return [name for name, v in manifest.record.variants.items()
            if v.status == "failed" and not (v.error or "").startswith("server did not start")]


def _rebuild_index(output_dir: Path, progress: "Progress") -> None:
    """The output folder's index.html, with this run in it; a failure only warns: the run is done."""
    try:
        run_index.build_index(output_dir)  # through the module: a test stands a failing one in
    except OSError as e:
        progress.warn(f"could not rebuild {output_dir / 'index.html'}: {e}")
