"""Summary of repeated timings, shared by the probes (plain programs: torch and the stdlib only)."""
from __future__ import annotations

import statistics


def median_spread(times_us: list[float]) -> dict:
    """Median with p10/p90 (nearest rank) and the count: what every probe row reports."""
    s = sorted(times_us)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"time_us": statistics.median(s), "p10_us": pick(0.10), "p90_us": pick(0.90), "n": len(s)}
