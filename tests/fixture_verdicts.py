"""The committed fixture runs' verdicts, recomputed from their records through the public entry
(decodescope.verdict.verdict.verdict with the run's own params.yaml), set against each run's committed
data/verdict.json: a fixture whose verdict.json the code no longer writes is stale.

Numbers are the same where they agree to REL_TOL, everything else (keys, lengths, strings, flags) exactly:
numpy picks its summation kernels by the CPU's SIMD (AVX-512 or AVX2), and a sum's last bit follows, so a
verdict written on one CI machine read 296.6525189349112 us where another computes 296.6525189349113
(2026-12-07, seven fixtures, every difference in the 16th digit). A change to the verdict's code moves a
number by far more than REL_TOL.

    python -m tests.fixture_verdicts            # which are stale (exit status 1 when any)
    python -m tests.fixture_verdicts --write    # rewrite the stale ones' data/verdict.json

A run's params.yaml names its model config relative to the repository's params/ folder (models/...), so it
is read from a folder where models/ is that folder's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.snapshot_outputs import FIXTURE_RUNS, REPO

REL_TOL = 1e-9


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


def differences(now, committed, path: str = "") -> list[str]:
    """Where two parsed JSON documents part, as `path: now != committed`; floats within REL_TOL agree."""
    if isinstance(now, dict) and isinstance(committed, dict):
        return [d for k in sorted(set(now) | set(committed), key=str)
                for d in differences(now.get(k, "<absent>"), committed.get(k, "<absent>"), f"{path}.{k}")]
    if isinstance(now, list) and isinstance(committed, list) and len(now) == len(committed):
        return [d for i, (a, b) in enumerate(zip(now, committed)) for d in differences(a, b, f"{path}[{i}]")]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (now, committed))
    if numbers and (isinstance(now, float) or isinstance(committed, float)):
        same = math.isclose(now, committed, rel_tol=REL_TOL, abs_tol=0.0) or (math.isnan(now) and math.isnan(committed))
    else:
        same = now == committed and type(now) is type(committed)
    return [] if same else [f"{path or '.'}: {str(now)[:120]} != {str(committed)[:120]}"]


def stale_paths(run_dir: Path, now: bytes) -> list[str]:
    """Where the recomputed verdict `now` parts from the run's committed data/verdict.json."""
    return differences(json.loads(now), json.loads((run_dir / "data" / "verdict.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite each stale data/verdict.json")
    args = ap.parse_args(argv)
    stale = []
    for run_dir in fixture_runs():
        now = recomputed(run_dir)
        same = not stale_paths(run_dir, now)
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
