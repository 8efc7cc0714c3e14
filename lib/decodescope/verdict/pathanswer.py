"""The verdict's reading of the critical paths (data/profile/c<N>/critical_path.json, 04): what holds the
wall-clock step (the headline), where the summed view disagrees, the wall-time share of all-reduce where it
differs from the summed share, and each fix's bound on the path beside the step model's projection of it."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from decodescope.schema.records import Bottleneck, ProjectionRow, ReconcileRow
from decodescope.schema.records_critpath import CRITICAL_PATH_RECORD, CriticalPathSummary, CritPathFixRow
from decodescope.schema.rundata import RunDir
from decodescope.trace.categorize import ALLREDUCE_CATEGORIES, class_of

# a projection's name -> the bounds on the path that free what that fix frees (critpath_summary.path_fixes)
DIFFERS_PTS = 0.05  # the wall share is said beside the summed one when they differ by this much (share points)
GAPS = ("host", "launch", "idle")  # the path's gaps: no op, so no class of the rules file


def _bounds_for_fix(fix: str, rec: CriticalPathSummary) -> list:
    """The path's bounds a projected fix is held to: GEMMs -> the gemm class freed whole (or its one
    category); all-reduce -> the transfer of every all-reduce instance (its waits included)."""
    b = rec.fix_bounds
    if fix.startswith("GEMMs"):
        whole = [x for x in b if x.kind == "class" and x.category == "gemm (all)"]
        return whole or [x for x in b if x.kind == "category" and class_of(x.category) == "gemm"]
    if fix.startswith("all-reduce"):
        return [x for x in b if x.kind == "transfer" and x.category.removesuffix(" transfer") in ALLREDUCE_CATEGORIES]
    return []


def critical_path_records(run_dir: Path) -> dict[int, CriticalPathSummary]:
    """Every profiled level's record, by concurrency; empty for runs written before them."""
    return RunDir(Path(run_dir)).critical_paths()


def _nearest(projections: list[ProjectionRow], batch: Optional[int]) -> list[ProjectionRow]:
    """Per fix, its projection at the batch nearest the profiled level."""
    best: dict[str, ProjectionRow] = {}
    for p in projections:
        key = abs((p.batch or 1) - (batch or 1))
        if p.fix not in best or key < abs((best[p.fix].batch or 1) - (batch or 1)):
            best[p.fix] = p
    return list(best.values())


def fix_rows(records: dict[int, CriticalPathSummary], projections: list[ProjectionRow]) -> list[CritPathFixRow]:
    """Per level and bound: the bound, beside each projection of a fix that frees what it frees. A projection
    past its bound saves more than the trace's own dependencies allow (exceeds_bound); where one fix has
    several bounds (several all-reduce communicators), none of them alone judges it."""
    rows = []
    for conc, rec in sorted(records.items()):
        near = _nearest(projections, conc)
        held: dict[str, list] = {p.fix: _bounds_for_fix(p.fix, rec) for p in near}
        for b in rec.fix_bounds:
            base = {"concurrency": conc, "bound": f"{b.category} free", "bound_gain_pct": 100 * b.gain_share_median,
                    "bound_wall_us": b.bound_wall_us_median, "wall_us": b.wall_us_median}
            matched = [p for p in near if b in held[p.fix]]
            if not matched:
                rows.append(CritPathFixRow.model_validate(base))
            for p in matched:
                gain = -p.gain_pct
                rows.append(CritPathFixRow.model_validate({
                    **base, "fix": p.fix, "projected_gain_pct": gain, "projection_batch": p.batch,
                    "exceeds_bound": gain > 100 * b.gain_share_median if len(held[p.fix]) == 1 else None}))
    return rows


def _cls(category: str) -> str:
    return category if category in GAPS else class_of(category)


def path_bottleneck(records: dict[int, CriticalPathSummary], summed_cls: Optional[str] = None,
                    summed_share: Optional[float] = None) -> Optional[Bottleneck]:
    """What holds the wall step at the lowest profiled level with a path: its category with the largest
    median share of the wall step; the summed view's class beside it. None without shares."""
    recs = [r for _, r in sorted(records.items()) if r.shares]
    if not recs:
        return None
    rec = recs[0]
    top = max(rec.shares, key=lambda r: r.path_share_median)
    return Bottleneck.model_validate({
        "class": _cls(top.category), "share": top.path_share_median, "basis": "critical path",
        "category": top.category, "share_p10": top.path_share_p10, "share_p90": top.path_share_p90,
        "level": rec.concurrency, "wall_us": rec.wall_us_median, "summed_share": top.summed_share_median,
        "summed_cls": summed_cls, "summed_cls_share": summed_share})


def _pct(x: Optional[float]) -> str:
    return f"{100 * (x or 0.0):.0f}%"


def headline(records: dict[int, CriticalPathSummary], b: Bottleneck) -> str:
    """The verdict's first sentence from the path: what holds the wall step at each profiled level (median
    and p10-p90 over the steps), the summed op share beside it, then the collectives' split on the path."""
    per_level = []
    for conc, rec in sorted(records.items()):
        mine = next((r for r in rec.shares if r.category == b.category), None)
        if mine is None:
            continue
        per_level.append(f"{_pct(mine.path_share_median)} (p10-p90 {_pct(mine.path_share_p10)}-"
                         f"{_pct(mine.path_share_p90)}) of the {(rec.wall_us_median or 0) / 1e3:.2f} ms wall step at "
                         f"concurrency {conc}")
    what = f"{b.category} ({b.cls})" if b.category != b.cls else str(b.category)
    text = (f"{what} holds the critical path of a decode step: " + "; ".join(per_level)
            + f"; {_pct(b.summed_share)} of summed op time" + (" (a gap between ops: no op time)" if b.category in GAPS
                                                               else "") + ".")
    at = records.get(b.level) if b.level is not None else None
    if at is not None and at.collective_split and at.wall_us_median:
        wall = at.wall_us_median
        parts = [f"{s.category}: transfer {_pct(s.transfer_on_path_us_per_step / wall)} and arrival skew "
                 f"{_pct(s.skew_on_path_us_per_step / wall)} of the wall step on the path "
                 f"({_pct(s.share_skew_bound)} of instances skew-bound)" for s in at.collective_split[:2]]
        text += " Its collectives at concurrency " + f"{b.level}: " + "; ".join(parts) + "."
    return text


def disagreement(b: Bottleneck, summed_us: Optional[float], wall_us: Optional[float]) -> Optional[str]:
    """One sentence where the path and the summed shares name different classes: which holds, and why."""
    if b.summed_cls is None or b.summed_cls == b.cls:
        return None
    why = (f"summed op time ({summed_us / 1e3:.2f} ms per step) exceeds the wall step ({wall_us / 1e3:.2f} ms) because "
           "streams and ranks overlap" if summed_us and wall_us and summed_us > wall_us else
           "summed op time leaves out the host's time between ops and counts every rank's waiting as its own")
    return (f"The two views disagree: summed op time puts {b.summed_cls} first ({_pct(b.summed_cls_share)} of op time "
            f"on the median rank), the critical path {b.category} ({_pct(b.share)} of the wall step); the path holds, "
            f"since it attributes the wall-clock step exactly, while {why}.")


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


def transfer_reconcile_row(rows: list[ReconcileRow], records: dict[int, CriticalPathSummary],
                           batch: int) -> Optional[ReconcileRow]:
    """03's all-reduces per step beside the profile's transfer part alone, like for like: 03 times the calls
    with the ranks in together (no arrival skew), the split takes the skew out of the profile's side. The
    micro-benchmark side is the all-reduce row reconcile() priced (its communicator and timing); None where
    there is no such row or no split at the profiled level (the nearest profiled level's otherwise)."""
    micro = next((r for r in rows if r.piece.startswith("all-reduces per step") and r.micro_benchmark_us
                  and r.micro_benchmark_us == r.micro_benchmark_us), None)
    if micro is None or not records:
        return None
    conc = min(records, key=lambda c: (abs(c - batch), c))
    split = [x for x in records[conc].collective_split if x.category in ALLREDUCE_CATEGORIES]
    if not split:
        return None
    transfer = sum(x.transfer_us_per_step for x in split)
    skew = sum(x.skew_us_per_step for x in split)
    assert micro.micro_benchmark_us is not None  # chosen above for a figure
    return ReconcileRow(
        piece="all-reduce transfer per step (critical path split)", micro_benchmark_us=micro.micro_benchmark_us,
        micro_source=micro.micro_source, profile_us=transfer,
        profile_source=(f"profile/c{conc}/critical_path.json collective_split: each all-reduce from its last rank's "
                        "entry to its end, summed over a step's instances (median over the steps)"),
        profile_over_micro=transfer / micro.micro_benchmark_us,
        note=(f"like for like: 03 runs the calls with the ranks in together; the profile's arrival skew "
              f"({skew:,.0f} us per step, first rank in to last) is set apart, not priced as transfer"))


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
