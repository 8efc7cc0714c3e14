"""One profiled window through vLLM's profiler endpoints: /start_profile, a workload, /stop_profile, then
the wait until every rank's trace file is complete (its size stable and, for .gz, a gzip stream that
decompresses to the end), and the move of a window's files into their own directory.

A workload that fails inside the window still stops the profile, as one left running grows the workers'
memory without bound. A /stop_profile that answers with an error fails the window, quoting the server's log;
one that never answers is a problem of the window, and the ranks that arrived within a short wait are kept.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from decodescope.core.io import gzip_complete, write_parquet_atomic
from decodescope.exec.host import mirror_move
from decodescope.exec.server import ServerHTTPError, ServerUnreachable, log_tail
from decodescope.serving.sweep import SERVER_FAILURE_CLASSES, records_frame
from decodescope.trace.load import find_trace_files


class CaptureError(RuntimeError):
    pass


def wait_for_traces(trace_dir: Path, before: set[Path], expected_ranks: int, timeout_s: float,
                    poll_s: float = 2.0, partial_ok: bool = False, check=None,
                    check_every_s: float = 10.0) -> tuple[list[Path], list[Path]]:
    """New rank traces (at least expected_ranks), each complete; on timeout raises CaptureError, or
    with partial_ok returns the complete ones that arrived. `check()` runs every check_every_s and
    raises when the traces can no longer come (the server, or the link to its host, is gone), so a
    dead server does not cost the whole flush timeout."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + check_every_s
    sizes: dict[Path, int] = {}
    while True:
        if check is not None and time.monotonic() >= next_check:
            check()
            next_check = time.monotonic() + check_every_s
        ranks, front = find_trace_files(trace_dir)
        new = [p for p in ranks if p not in before]
        new_front = [p for p in front if p not in before]
        stable = []
        for p in new:
            size = p.stat().st_size
            if size > 0 and sizes.get(p) == size and (p.suffix != ".gz" or gzip_complete(p)):
                stable.append(p)
            sizes[p] = size
        if len(new) >= expected_ranks and len(stable) == len(new):
            return sorted(new), sorted(new_front)
        if time.monotonic() > deadline:
            if partial_ok:
                return sorted(stable), sorted(new_front)
            raise CaptureError(f"after {timeout_s:.0f} s (profile.flush_timeout_s) {trace_dir} holds "
                               f"{len(stable)} complete of {expected_ranks} expected rank traces "
                               f"(new files: {[p.name for p in new]})")
        time.sleep(poll_s)


def _start_profile(server) -> None:
    try:
        server.start_profile()
    except ServerHTTPError as e:
        if e.status == 409:  # vLLM: a profile is running already; stopping another's would lose its trace
            raise CaptureError(f"POST {server.base_url}/start_profile answered HTTP 409: the server's profiler is "
                               "running already (another client, or a run that ended without stopping it). A "
                               "profile left running grows the workers' memory until it is stopped: stop it with "
                               f"POST {server.base_url}/stop_profile, then run again") from None
        raise CaptureError(f"POST {server.base_url}/start_profile answered HTTP {e.status}: the server has no "
                           "profiler configured. Start it with --profiler-config "
                           "'{\"profiler\":\"torch\",\"torch_profiler_dir\":\"/abs/dir\"}' (or "
                           "VLLM_TORCH_PROFILER_DIR on older vLLM)") from None
    except ServerUnreachable:
        server.raise_if_dead("the profile (/start_profile)")
        raise


def _stop_after_failure(server) -> None:
    """A workload that failed (or was interrupted) inside a window: the profile is stopped all the same, as a
    profile left running grows the workers' memory without bound. Its own failure is not the error to report."""
    try:
        server.stop_profile(timeout_s=float(STOP_AFTER_FAILURE_S))
    except Exception:
        pass


# the stop after a failed workload: long enough for a small window's export, short beside Ctrl-C's patience
STOP_AFTER_FAILURE_S = 120


def profiled_window(server, params, trace_dir: Path, expected_ranks: int, workload: Callable[[], tuple[list, Any]],
                    what: str, records_path: Optional[Path] = None,
                    arrival_timeout_s: Optional[float] = None) -> tuple[Any, dict]:
    """/start_profile, `workload()` (-> its request records and anything else), /stop_profile, then wait for
    every rank's trace: (the workload's anything else, the CaptureResult fields of the window). The records
    are written to records_path before the stop, so a server that fails there leaves them. A stop that never
    completes is a problem, not an error: the ranks that arrived within a short wait are kept.
    arrival_timeout_s: the wait for the traces once /stop_profile answered (default profile.flush_timeout_s)."""
    prof = params.profile
    before = set(p for group in find_trace_files(trace_dir) for p in group)
    problems: list[str] = []
    t0 = time.monotonic()
    _start_profile(server)
    t1 = time.monotonic()
    try:
        records, extra = workload()
    except BaseException:
        _stop_after_failure(server)
        raise
    t2 = time.monotonic()
    df = records_frame(records)
    if records_path is not None:
        write_parquet_atomic(records_path, df)
    if df["error_class"].isin(SERVER_FAILURE_CLASSES).any():
        server.raise_if_dead(what)
    try:
        server.stop_profile(timeout_s=prof.flush_timeout_s)
    except ServerHTTPError as e:
        server.raise_if_dead("the profile (/stop_profile)")
        raise stop_profile_error(server, e.status, time.monotonic() - t2) from None
    except ServerUnreachable as e:
        server.raise_if_dead("the profile (/stop_profile)")
        problems.append(f"{e} (profile.flush_timeout_s); the rank traces that arrived were analysed")
    t3 = time.monotonic()
    # after a /stop_profile that never completed, wait only briefly for files still being written
    wait_s = min(prof.flush_timeout_s, 30.0) if problems else (arrival_timeout_s or prof.flush_timeout_s)
    ranks, front = wait_for_traces(trace_dir, before, expected_ranks, wait_s, partial_ok=bool(problems),
                                   # after a /stop_profile that failed the server may be stuck but alive:
                                   # then the short wait above is the limit, not its health
                                   check=None if problems else
                                   (lambda: server.raise_if_dead("the wait for the profiler's traces")))
    if len(ranks) < expected_ranks:
        problems.append(f"{len(ranks)} of {expected_ranks} rank traces arrived complete in {trace_dir}")
    fields = dict(trace_dir=trace_dir, rank_files=ranks, frontend_files=front,
                  tables=sorted(trace_dir.glob("*profiler_out*")), requests_ok=int(df["ok"].sum()),
                  requests_failed=int((~df["ok"]).sum()), start_profile_s=t1 - t0, workload_s=t2 - t1,
                  stop_profile_s=t3 - t2, flush_wait_s=time.monotonic() - t3, expected_ranks=expected_ranks,
                  problems=problems)
    return extra, fields


def stop_profile_error(server, http_code: int, waited_s: float) -> CaptureError:
    """/stop_profile failed: the workers died or failed writing their traces; the server log says why."""
    log_path = getattr(server, "log_path", None)
    where = (f"last lines of {log_path}:\n{log_tail(log_path)}" if log_path and Path(log_path).is_file()
             else "see the server's own log")
    return CaptureError(f"POST {server.base_url}/stop_profile answered HTTP {http_code} after {waited_s:.0f} s: "
                        "the server failed while writing its traces (a worker killed for memory is the usual "
                        "cause: keep profile.requests small and profile.with_stack false); " + where)


def file_into(files: list[Path], dest: Path, params=None) -> list[Path]:
    """Move a capture's files into `dest` (an earlier capture there is replaced); on an ssh host the same
    move there first, or copying traces/ back would bring them back."""
    if params is not None:
        mirror_move(params, files, dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return [Path(shutil.move(str(p), dest / Path(p).name)) for p in files]
