"""Papermill orchestration: the run directory, the manifest, phases in order, the report at the end.

Each phase's status is written to manifest.json (atomically) as it starts and ends, so a crash or
Ctrl-C keeps what was measured; `--resume RUN_DIR` skips the phases already ok.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from decodescope.io import read_json, write_json_atomic, write_text_atomic
from decodescope.params import PHASES, Params, dump_yaml, load_params, params_as_dict

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
# Phases that talk to the inference server; the runner starts it once for all of them.
SERVER_PHASES = {"01_serving", "04_profile"}


class RunError(RuntimeError):
    pass


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def notebook_for(phase: str, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    return notebook_dir / f"{phase}.ipynb"


def available_phases(notebook_dir: Path = NOTEBOOK_DIR) -> list[str]:
    return [p for p in PHASES if notebook_for(p, notebook_dir).is_file()]


def select_phases(params: Params, requested: Optional[list[str]], notebook_dir: Path = NOTEBOOK_DIR) -> list[str]:
    wanted = requested or params.run.phases or available_phases(notebook_dir)
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        raise RunError(f"unknown phase(s) {unknown}; valid: {list(PHASES)}")
    missing = [p for p in wanted if not notebook_for(p, notebook_dir).is_file()]
    if missing:
        raise RunError(f"no notebook for phase(s) {missing} in {notebook_dir}; available: "
                       f"{available_phases(notebook_dir)}")
    return [p for p in PHASES if p in wanted]  # always in phase order


def git_commit(repo: Path = REPO_ROOT) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def new_run_dir(params: Params) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = params.output_root()
    run_dir = root / f"{stamp}-{params.run_name}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = root / f"{stamp}-{params.run_name}-{n}"
    for sub in ("notebooks", "data", "traces", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    return run_dir


class Manifest:
    """manifest.json of one run, rewritten atomically at every change."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self._lock = threading.Lock()

    @classmethod
    def create(cls, run_dir: Path, params: Params, phases: list[str]) -> "Manifest":
        from decodescope.hardware import cpu_summary, package_versions

        data = {
            "run_id": run_dir.name,
            "params_name": params.run_name,
            "params_path": params.source_path,
            "params": params_as_dict(params),
            "git_commit": git_commit(),
            "versions": {**package_versions(), "python": sys.version.split()[0]},
            "host": {"kind": params.host, **{k: v for k, v in cpu_summary().items()
                                               if k in ("hostname", "model", "logical_cores", "memory_gib")}},
            "created": utc_now(),
            "status": "running",
            "phases": {p: {"status": "pending"} for p in phases},
        }
        m = cls(run_dir / "manifest.json", data)
        m.save()
        return m

    @classmethod
    def load(cls, run_dir: Path) -> "Manifest":
        path = run_dir / "manifest.json"
        if not path.is_file():
            raise RunError(f"{run_dir} has no manifest.json; --resume needs a run directory made by "
                           "`decodescope run`")
        return cls(path, read_json(path))

    def save(self) -> None:
        with self._lock:
            write_json_atomic(self.path, self.data)

    def phase(self, name: str) -> dict:
        return self.data["phases"].setdefault(name, {"status": "pending"})

    def update_phase(self, name: str, **fields) -> None:
        self.phase(name).update(fields)
        self.save()


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM ends a run the way Ctrl-C does: finally blocks run and the server tree is torn down."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Progress:
    """One line per phase on the terminal with elapsed time; a ticker keeps long phases visibly alive."""

    def __init__(self, total: int, stream=sys.stderr, tick_s: float = 15.0):
        self.total, self.stream, self.tick_s = total, stream, tick_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, i: int, phase: str) -> None:
        self.t0 = time.monotonic()
        self.label = f"[{i}/{self.total}] {phase}"
        print(f"{self.label} ... started", file=self.stream, flush=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            print(f"{self.label} ... {time.monotonic() - self.t0:.0f} s", file=self.stream, flush=True)

    def end(self, status: str, detail: str = "") -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        print(f"{self.label} ... {status} ({time.monotonic() - self.t0:.1f} s){detail}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def execute_phase(phase: str, run_dir: Path, params_path: Path, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    import papermill as pm

    out = run_dir / "notebooks" / f"{phase}.ipynb"
    pm.execute_notebook(str(notebook_for(phase, notebook_dir)), str(out),
                        parameters={"params_path": str(params_path), "run_dir": str(run_dir)},
                        kernel_name="python3", progress_bar=False, log_output=False,
                        cwd=str(notebook_dir), request_save_on_cell_execute=True)
    return out


def _short_error(exc: BaseException) -> str:
    text = str(exc)
    # papermill's PapermillExecutionError carries ename/evalue: the part worth putting in a table
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        text = f"{ename}: {evalue}"
    return text[:4000]


def run(params_path: Path, phases: Optional[list[str]] = None, resume: Optional[Path] = None,
        notebook_dir: Path = NOTEBOOK_DIR, on_server: Optional[Callable] = None) -> tuple[Path, bool]:
    """Run the phases; returns (run_dir, all_ok). Raises ParamsError before anything starts."""
    from decodescope import server as srv
    from decodescope.report.html import build_report

    params = load_params(params_path)
    selected = select_phases(params, phases, notebook_dir)
    if resume:
        run_dir = Path(resume).resolve()
        manifest = Manifest.load(run_dir)
        for p in selected:
            manifest.phase(p)
        manifest.data["status"] = "running"
        manifest.data.setdefault("resumed", []).append(utc_now())
        manifest.save()
    else:
        run_dir = new_run_dir(params)
        manifest = Manifest.create(run_dir, params, selected)
    run_params_path = run_dir / "params.yaml"
    if not run_params_path.exists():
        # The params as run, secrets redacted; notebooks read the original file for secrets.
        write_text_atomic(run_params_path, dump_yaml(params))
    # Notebooks read the source params (with secrets and relative paths intact).
    notebook_params = Path(params.source_path)

    todo = [p for p in selected if manifest.phase(p).get("status") != "ok"]
    progress = Progress(len(selected))
    progress.note(f"decodescope run {run_dir}")
    server: Optional[srv.VllmServer] = None
    server_error: Optional[str] = None
    interrupted = False
    with sigterm_as_interrupt():
        try:
            for i, phase in enumerate(selected, 1):
                if phase not in todo:
                    progress.note(f"[{i}/{len(selected)}] {phase} ... skipped (ok in a previous run)")
                    continue
                if phase not in SERVER_PHASES and server is not None and server.proc is not None:
                    # micro-benchmarks need the host to themselves: on a GPU host the server holds
                    # most of the GPUs' memory and its workers compete for the same cores
                    progress.note("stopping the inference server while this phase runs ...")
                    server.stop()
                    server = None
                if phase in SERVER_PHASES and server is None and server_error is None:
                    server, server_error = _start_server(params, run_dir, manifest, selected, progress)
                    if server is not None and on_server:
                        on_server(server)
                progress.start(i, phase)
                manifest.update_phase(phase, status="running", start=utc_now(), end=None, error=None)
                t0 = time.monotonic()
                if phase in SERVER_PHASES and server is None:
                    manifest.update_phase(phase, status="failed", end=utc_now(), duration_s=0.0,
                                          error=f"server did not start: {server_error}")
                    progress.end("failed", " - server did not start")
                    continue
                try:
                    nb = execute_phase(phase, run_dir, notebook_params, notebook_dir)
                    manifest.update_phase(phase, status="ok", end=utc_now(), duration_s=time.monotonic() - t0,
                                          notebook=str(nb.relative_to(run_dir)))
                    progress.end("ok")
                except KeyboardInterrupt:
                    manifest.update_phase(phase, status="failed", end=utc_now(),
                                          duration_s=time.monotonic() - t0, error="interrupted (Ctrl-C/SIGTERM)")
                    progress.end("interrupted")
                    raise
                except Exception as e:  # a failed phase is recorded and the run goes on
                    manifest.update_phase(phase, status="failed", end=utc_now(), duration_s=time.monotonic() - t0,
                                          error=_short_error(e),
                                          notebook=f"notebooks/{phase}.ipynb")
                    progress.end("failed", f" - {_short_error(e).splitlines()[0][:200]}")
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if server is not None and server.proc is not None:
                progress.note("stopping the vLLM server and its workers ...")
                server.stop()
                manifest.data.setdefault("server", {})["stopped"] = utc_now()
            ok = all(manifest.phase(p).get("status") == "ok" for p in selected)
            manifest.data["status"] = "interrupted" if interrupted else ("ok" if ok else "failed")
            manifest.data["finished"] = utc_now()
            manifest.save()
    if interrupted:
        raise KeyboardInterrupt
    report = build_report(run_dir)
    manifest.data["report"] = str(report.relative_to(run_dir))
    manifest.save()
    return run_dir, ok


def _start_server(params, run_dir, manifest, selected, progress):
    from decodescope import server as srv

    profiler_dir = run_dir / "traces" if "04_profile" in selected else None
    progress.note(f"starting the inference server ({params.server.mode}) ...")
    t0 = time.monotonic()
    try:
        server = srv.start_for_params(params, run_dir, profiler_dir=profiler_dir)
    except (srv.ServerError, OSError) as e:
        manifest.data["server"] = {"status": "failed", "error": str(e)[:4000]}
        manifest.save()
        progress.note(f"server failed: {str(e).splitlines()[0]}")
        return None, str(e)
    manifest.data["server"] = {"status": "up", "base_url": server.base_url, "start_s": time.monotonic() - t0,
                               "pids": server.tree_pids, "profiler_dir": str(profiler_dir) if profiler_dir else None,
                               "launch": server.spec.describe() if server.spec else None}
    # every server this run started, for the record (and for checking that none outlived it)
    manifest.data.setdefault("servers", []).append({"started": utc_now(), "start_s": time.monotonic() - t0,
                                                    "pids": server.tree_pids})
    manifest.save()
    progress.note(f"server healthy at {server.base_url} after {time.monotonic() - t0:.1f} s")
    return server, None
