"""One profiled level's critical paths as a record: data/profile/c<N>/critical_path.json (04), from the
traces profile_for_phase has already loaded and analysed."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.schema.recordbase import write_record
from decodescope.schema.records_critpath import CRITICAL_PATH_RECORD, CriticalPathSummary
from decodescope.critpath.split import collective_split, split_summary
from decodescope.critpath.summary import attribution, collective_waits, fix_bounds
from decodescope.critpath.table import CriticalPaths, critical_paths

log = logging.getLogger(__name__)


def critical_path_summary(cp: CriticalPaths, ops: pd.DataFrame, ranks: list[int],
                          concurrency: Optional[int] = None, speedup: float = float("inf")) -> CriticalPathSummary:
    """The shares, waits and bounds (each category `speedup` times faster; inf: free) over the decode steps,
    all steps where none is decode."""
    w = cp.windows
    kind = "decode" if (w["kind"] == "decode").any() else "all"
    mine = w[w["kind"] == kind] if kind != "all" else w
    fields = {"concurrency": concurrency, "device": str(ops.attrs.get("device", "gpu")),
              "ranks": [int(r) for r in ranks], "step_kind": kind, "steps": len(mine),
              "wall_us_median": float(mine["wall_us"].median()) if len(mine) else None}
    if len(mine):
        fields.update(shares=attribution(cp, ops, kind).to_dict("records"),
                      collective_waits=collective_waits(cp, kind).to_dict("records"),
                      fix_bounds=fix_bounds(cp, kind, speedup=speedup).to_dict("records"),
                      collective_split=split_summary(collective_split(cp, kind), len(mine)).to_dict("records"))
    return CriticalPathSummary.model_validate(fields)


def write_critical_path(events: pd.DataFrame, ops: pd.DataFrame, steps: pd.DataFrame, data_dir: Path,
                        concurrency: Optional[int] = None) -> CriticalPaths:
    """The level's critical paths; their summary written to data_dir/critical_path.json."""
    cp = critical_paths(events, ops, steps)
    rec = critical_path_summary(cp, ops, sorted(int(r) for r in ops["rank"].unique()), concurrency)
    write_record(Path(data_dir) / CRITICAL_PATH_RECORD, rec)
    log.info("critical paths of %d %s steps at concurrency %s -> %s", rec.steps, rec.step_kind, concurrency,
             Path(data_dir) / CRITICAL_PATH_RECORD)
    return cp
