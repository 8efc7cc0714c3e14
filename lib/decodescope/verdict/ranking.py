""""What would move it", ranked on what was measured: each projection's rank (break-even ones have none),
its break-even condition where an input was assumed, and its bound on the critical path beside it."""
from __future__ import annotations

import re
from typing import Optional

from decodescope.schema.records import ProjectionRow
from decodescope.schema.records_critpath import CritPathFixRow

_K = re.compile(r"\bk=(\d+)")


def _k_of(name: str) -> Optional[int]:
    m = _K.search(name)
    return int(m.group(1)) if m else None


def rank_projections(projections: list[ProjectionRow], ranked: list[dict],
                     bounds: list[CritPathFixRow]) -> list[ProjectionRow]:
    """The projections (ranked ones first, by projected TPOT, then the break-even ones) with their rank; a
    break-even one gets its condition from speccurve.ranked_fixes' rows (`ranked`, matched by k); each gets
    the critical path's bound of what it frees (critpath_view.fix_rows' rows naming it, at the lowest level
    profiled), and whether it saves more than that bound."""
    conditions = {_k_of(r["fix"]): r["text"] for r in ranked if r.get("status") == "break-even"}
    out, rank = [], 0
    for p in sorted(projections, key=lambda p: (p.status == "break-even", p.gain_pct)):
        update: dict = {}
        if p.status == "break-even":
            update.update(rank=None, condition=conditions.get(_k_of(p.fix), ""))
        else:
            rank += 1
            update["rank"] = rank
        mine = sorted((b for b in bounds if b.fix == p.fix), key=lambda b: (b.concurrency or 0))
        if mine:
            b = mine[0]
            update.update(bound=f"{b.bound} (c{b.concurrency})", bound_gain_pct=b.bound_gain_pct,
                          beyond_bound=b.exceeds_bound)
        out.append(p.model_copy(update=update))
    return out
