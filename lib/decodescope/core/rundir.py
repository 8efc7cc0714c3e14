"""The run directory's layout: its subfolders and how a new one is made (docs/DESIGN.md, "Run directory
contract"). The runner and a notebook opened alone both make theirs here."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

NOTEBOOKS = "notebooks"   # the executed notebooks
DATA = "data"             # each phase's result files
TRACES = "traces"         # the profiler traces, as the server wrote them
LOGS = "logs"             # server.log, probe logs
VARIANTS = "variants"     # variants/<name>/: each variant of params.experiments, laid out like a run
SUBDIRS = (NOTEBOOKS, DATA, TRACES, LOGS)


def ensure_layout(run_dir: Path) -> Path:
    """Make the run directory's subfolders (those missing); returns run_dir."""
    run_dir = Path(run_dir)
    for sub in SUBDIRS:
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    return run_dir


def make_run_dir(root: Path, name: str, now: Optional[datetime] = None) -> Path:
    """A new `<root>/<UTC stamp>-<name>` (then `-2`, `-3`, ... when taken) with its subfolders. The
    directory is created atomically, so two runs started in the same second never share one."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        run_dir = root / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            n += 1
            continue
        return ensure_layout(run_dir)


def level_file(level: int, repeat: int = 1) -> str:
    """A serving level's file name, as 01's records and its telemetry both name them: level_<c>.parquet;
    a repeat after the first: level_<c>_r<n>.parquet."""
    return f"level_{level:05d}.parquet" if repeat == 1 else f"level_{level:05d}_r{repeat}.parquet"
