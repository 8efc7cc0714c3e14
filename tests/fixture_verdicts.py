"""The committed fixture runs' verdicts, recomputed from their records through the public entry
(decodescope.verdict.verdict.verdict with the run's own params.yaml), set against each run's committed
data/verdict.json: a fixture whose verdict.json the code no longer writes is stale.

    python -m tests.fixture_verdicts            # which are stale (exit status 1 when any)
    python -m tests.fixture_verdicts --write    # rewrite the stale ones' data/verdict.json

A run's params.yaml names its model config relative to the repository's params/ folder (models/...), so it
is read from a folder where models/ is that folder's.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
FIXTURE_RUNS = REPO / "tests" / "fixtures" / "runs"


def fixture_runs() -> list[Path]:
    """Every fixture run with a committed data/verdict.json."""
    return sorted(d for d in FIXTURE_RUNS.iterdir() if (d / "data" / "verdict.json").is_file())


@contextmanager
def run_params(run_dir: Path) -> Iterator:
    """The run's own params.yaml, its models/ paths resolved against the repository's params/ (the params
    read their model config when asked, so they hold only inside the block)."""
    from decodescope.schema.params import load_params

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "params.yaml").write_text((run_dir / "params.yaml").read_text())
        os.symlink(REPO / "params" / "models", Path(tmp) / "models")
        yield load_params(Path(tmp) / "params.yaml")


def recomputed(run_dir: Path) -> bytes:
    """data/verdict.json as 05_verdict would write it today from the run's records."""
    from decodescope.schema.records import write_record
    from decodescope.verdict.verdict import verdict

    with tempfile.TemporaryDirectory() as tmp, run_params(run_dir) as params:
        out = Path(tmp) / "verdict.json"
        write_record(out, verdict(run_dir, params))
        return out.read_bytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite each stale data/verdict.json")
    args = ap.parse_args(argv)
    stale = []
    for run_dir in fixture_runs():
        now, committed = recomputed(run_dir), (run_dir / "data" / "verdict.json").read_bytes()
        same = now == committed
        print(f"{'current' if same else 'STALE  '} {run_dir.relative_to(REPO)}/data/verdict.json")
        if not same:
            stale.append(run_dir)
            if args.write:
                from decodescope.core.io import write_text_atomic
                write_text_atomic(run_dir / "data" / "verdict.json", now.decode())
    if args.write and stale:
        print(f"rewrote {len(stale)}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
