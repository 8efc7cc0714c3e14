"""The verdict's reading of the critical paths (data/profile/c<N>/critical_path.json, 04): the wall-time
share of the largest category and of all-reduce where it differs from the summed share, and each fix's
bound on the path beside the step model's projection of that fix."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from decodescope.schema.records import ProjectionRow
from decodescope.schema.records_critpath import CRITICAL_PATH_RECORD, CriticalPathSummary, CritPathFixRow
from decodescope.schema.rundata import RunDir
from decodescope.trace.categorize import ALLREDUCE_CATEGORIES, class_of

# a projection's name -> the verdict class of the categories its fix speeds up
FIX_CLASSES = {"GEMMs": "gemm", "all-reduce": "communication"}
DIFFERS_PTS = 0.05  # the wall share is said beside the summed one when they differ by this much (share points)


def critical_path_records(run_dir: Path) -> dict[int, CriticalPathSummary]:
    """Every profiled level's record, by concurrency; empty for runs written before them."""
    return RunDir(Path(run_dir)).critical_paths()


def _fix_class(fix: str) -> Optional[str]:
    return next((c for name, c in FIX_CLASSES.items() if fix.startswith(name)), None)


def _nearest(projections: list[ProjectionRow], batch: Optional[int]) -> list[ProjectionRow]:
    """Per fix, its projection at the batch nearest the profiled level."""
    best: dict[str, ProjectionRow] = {}
    for p in projections:
        key = abs((p.batch or 1) - (batch or 1))
        if p.fix not in best or key < abs((best[p.fix].batch or 1) - (batch or 1)):
            best[p.fix] = p
    return list(best.values())


def fix_rows(records: dict[int, CriticalPathSummary], projections: list[ProjectionRow]) -> list[CritPathFixRow]:
    """Per level and category bound: the bound beside each projection of a fix of that category's class.
    A projection's gain past the bound is more than the trace's own dependencies allow; where the class
    has several categories on the path each bound is one category's, so it is compared but not judged."""
    rows = []
    for conc, rec in sorted(records.items()):
        near = _nearest(projections, conc)
        for b in rec.fix_bounds:
            cls = class_of(b.category)
            same_class = [x for x in rec.fix_bounds if class_of(x.category) == cls]
            base = {"concurrency": conc, "bound": f"{b.category} free", "bound_gain_pct": 100 * b.gain_share_median,
                    "bound_wall_us": b.bound_wall_us_median, "wall_us": b.wall_us_median}
            matched = [p for p in near if _fix_class(p.fix) == cls]
            if not matched:
                rows.append(CritPathFixRow.model_validate(base))
            for p in matched:
                gain = -p.gain_pct
                rows.append(CritPathFixRow.model_validate({
                    **base, "fix": p.fix, "projected_gain_pct": gain, "projection_batch": p.batch,
                    "exceeds_bound": gain > 100 * b.gain_share_median if len(same_class) == 1 else None}))
    return rows


def wall_share_sentence(rec: CriticalPathSummary) -> Optional[str]:
    """The largest category's share of the wall step on the path, and all-reduce's where its wall share
    differs from its summed share; None without shares."""
    if not rec.shares:
        return None
    top = max(rec.shares, key=lambda r: r.path_share_median)
    text = (f"On the critical path of a {rec.step_kind} step (concurrency {rec.concurrency}, "
            f"{(rec.wall_us_median or 0.0) / 1e3:.2f} ms wall), {top.category} holds "
            f"{100 * top.path_share_median:.0f}% of the wall time ({100 * top.summed_share_median:.0f}% of summed "
            "op time)")
    ar = [r for r in rec.shares if r.category in ALLREDUCE_CATEGORIES and r.category != top.category]
    shown = [r for r in ar if abs(r.path_share_median - r.summed_share_median) >= DIFFERS_PTS]
    if shown:
        text += "; " + ", ".join(f"{r.category} {100 * r.path_share_median:.0f}% of the wall step against "
                                 f"{100 * r.summed_share_median:.0f}% of summed op time" for r in shown)
    return text + "."


def critical_path_findings(records: dict[int, CriticalPathSummary], rows: list[CritPathFixRow]) -> list[dict]:
    """The verdict's sentences from the records: none for runs without them."""
    if not records:
        return []
    conc = min(records)
    files = [f"data/profile/c{conc}/{CRITICAL_PATH_RECORD}"]
    out = []
    sentence = wall_share_sentence(records[conc])
    if sentence:
        out.append({"topic": "bottleneck", "figure": "profile-critical-path", "files": files, "text": sentence})
    over = [r for r in rows if r.exceeds_bound and r.concurrency == conc]
    for r in over:
        out.append({"topic": "consistency", "figure": "profile-critical-path", "files": files + ["data/verdict.json"],
                    "text": f"{r.fix} is projected to save {r.projected_gain_pct:.0f}% at batch "
                            f"{r.projection_batch or 1:g}, more than the critical path allows: {r.bound} saves at "
                            f"most {r.bound_gain_pct:.0f}% of the wall step."})
    return out
