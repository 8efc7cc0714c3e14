"""Progress is logged, never printed: a phase writes nothing to stdout or stderr, the runner shows its
records on the terminal, and a phase's kernel sends them to the run's logs/decodescope.log, so none
reaches an executed notebook or report.html."""
from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from decodescope.core import logsetup
from decodescope.core.rundir import ensure_layout
from decodescope.orchestration.notebook import PhaseContext
from decodescope.schema.params import load_params

REPO = Path(__file__).resolve().parent.parent
# what a progress line in a report looks like: the phases' own lines, and a line as the file handler formats it
PROGRESS_LINES = re.compile(r"profile: concurrency|serving sweep: level|\[\d+/\d+\] \S+ \.\.\. "
                            r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) decodescope\.")


def progress_lines_in(html: str) -> list[str]:
    """The progress lines a report holds (none, when progress stays out of it)."""
    return [m.group(0) for m in PROGRESS_LINES.finditer(html)]


@pytest.fixture
def decodescope_logs(caplog):
    caplog.set_level(logging.INFO, logger=logsetup.ROOT)
    return caplog


def _fake_capture(concurrency: int):
    return SimpleNamespace(concurrency=concurrency, rank_files=[Path("rank0.json")], to_record=lambda: None)


def test_the_profile_phase_logs_each_level_and_prints_nothing(tmp_path, monkeypatch, capsys, decodescope_logs):
    from decodescope.profiling import capturephase as cp

    ctx = PhaseContext(params=load_params(REPO / "params" / "default.yaml"), run_dir=ensure_layout(tmp_path))
    monkeypatch.setattr(cp, "profile_levels", lambda params, path: ([1, 2], []))
    monkeypatch.setattr(cp, "phase_server", lambda *a, **kw: contextlib.nullcontext(object()))
    monkeypatch.setattr(cp, "itl_before_profiles", lambda server, params, levels: {})
    monkeypatch.setattr(cp, "capture_profile", lambda server, params, trace_dir, concurrency, **kw:
                        _fake_capture(concurrency))
    monkeypatch.setattr(cp, "_file_level", lambda result, *a, **kw: result)
    monkeypatch.setattr(cp, "write_record", lambda path, record: None)
    monkeypatch.setattr(cp, "ProfileCaptures", lambda **kw: None)
    monkeypatch.setattr(cp, "capture_host_ops", lambda *a, **kw: None)
    results, _, host = cp.capture_for_phase(ctx)
    assert [r.concurrency for r in results] == [1, 2] and host is None
    assert capsys.readouterr() == ("", "")
    logged = [r.getMessage() for r in decodescope_logs.records if r.name == "decodescope.profiling.capturephase"]
    assert logged[:3] == ["profile: concurrency 2 unprofiled, before the first profile",
                          "profile: concurrency 1 (1 of 2)", "profile: concurrency 2 (2 of 2)"]
    assert len(logged) == 4 and logged[3].startswith("profile: ")   # the un-graphed step's


def test_sweep_progress_is_plain_log_lines_with_elapsed_and_time_left(decodescope_logs, capsys):
    from decodescope.serving.sweep import SweepProgress

    t = iter([0.0, 0.0, 4.0, 4.0, 9.0, 9.0, 11.0])
    p = SweepProgress([1, 2, 4], clock=lambda: next(t))
    for level in (1, 2, 4):
        p.start(level)
        p.end(level)
    assert [r.getMessage() for r in decodescope_logs.records] == [
        "serving sweep: 3 level(s) to measure: concurrency 1, 2, 4",
        "serving sweep: level 1/3 (concurrency 1) done in 4.0 s, elapsed 4.0 s, about 8 s left",
        "serving sweep: level 2/3 (concurrency 2) done in 5.0 s, elapsed 9.0 s, about 4 s left",
        "serving sweep: level 3/3 (concurrency 4) done in 2.0 s, elapsed 11.0 s, done"]
    assert capsys.readouterr() == ("", "")
    decodescope_logs.clear()
    q = SweepProgress([1], enabled=False)
    q.start(1)
    q.end(1)
    assert decodescope_logs.records == []


def test_the_runner_shows_plain_lines_on_the_terminal_and_keeps_them_in_the_run_log(tmp_path):
    from decodescope.orchestration.progress import Progress, run_logging

    ensure_layout(tmp_path)
    logger = logging.getLogger(logsetup.ROOT)
    before = list(logger.handlers)
    terminal = io.StringIO()
    shown = logsetup.stream_handler(terminal)
    with logsetup.logging_to(shown), run_logging(tmp_path):
        p = Progress(2, tick_s=60)
        p.start(1, "00_host")
        p.end("ok")
        p.warn("could not rebuild index.html")
    lines = terminal.getvalue().splitlines()
    assert lines[0] == "[1/2] 00_host ... started" and re.fullmatch(r"\[1/2\] 00_host \.\.\. ok \(\d+\.\d s\)", lines[1])
    assert lines[2] == "warning: could not rebuild index.html"
    kept = (tmp_path / "logs" / logsetup.LOG_FILE).read_text()
    assert "INFO decodescope.orchestration.progress: [1/2] 00_host ... started" in kept
    assert logger.handlers == before   # the run's handlers are gone with the run


def test_a_kernels_records_go_to_the_run_log_alone(tmp_path, capsys):
    logger = logging.getLogger(logsetup.ROOT)
    before, propagate = list(logger.handlers), logger.propagate
    try:
        handler = logsetup.log_only_to_file(tmp_path / "logs" / logsetup.LOG_FILE)
        logging.getLogger("decodescope.profiling.capturephase").warning("profile: concurrency 1 (1 of 1)")
        handler.flush()
        assert capsys.readouterr() == ("", "")
        assert "profile: concurrency 1 (1 of 1)" in (tmp_path / "logs" / logsetup.LOG_FILE).read_text()
        assert not logger.propagate   # no root handler turns a record into a cell's output
    finally:
        logsetup.remove_handler(handler)
        logger.handlers[:], logger.propagate = before, propagate


def test_progress_lines_are_found_in_a_report():
    html = "<pre>profile: concurrency 1 (1 of 2)\n2026-01-02 03:04:05,678 INFO decodescope.serving.sweep: x</pre>"
    assert progress_lines_in(html) == ["profile: concurrency", "2026-01-02 03:04:05,678 INFO decodescope."]
    assert progress_lines_in("<p>concurrency 1: 12.3 tok/s</p>") == []
