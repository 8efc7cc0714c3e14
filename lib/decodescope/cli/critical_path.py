"""`decodescope analyze-trace DIR --critical-path`: each step's critical path, the wall step by category
beside the summed shares, the collectives' waits and what a fix of each category could buy at most."""
from __future__ import annotations

import math

import time
from pathlib import Path

from decodescope.core.io import write_parquet_atomic
from decodescope.trace.load import load_trace_dir


def critical_path_command(args, read_or_report) -> int:
    t0 = time.monotonic()
    loaded = read_or_report(load_trace_dir, args, lambda r: r.events.empty)
    if loaded is None:
        return 2
    # imported when the mode runs: analyze-trace starts without pandas (start-up budget, cli/main.py)
    import pandas as pd

    from decodescope.schema.recordbase import write_record
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.chrome import CHROME_TRACE, write_chrome_trace
    from decodescope.critpath.record import critical_path_summary
    from decodescope.critpath.table import critical_paths

    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    rec = critical_path_summary(cp, ops, [int(r) for r in loaded.ranks], speedup=args.speedup)
    out = Path(args.out) if args.out else Path(args.trace_dir) / "analysis"
    write_parquet_atomic(out / "critical_path.parquet", cp.segments)
    write_record(out / "critical_path.json", rec)
    write_chrome_trace(cp, out / CHROME_TRACE, source=str(args.trace_dir))

    def table(rows: list) -> pd.DataFrame:
        return pd.DataFrame([r.model_dump() for r in rows])

    shares, waits, fixes = table(rec.shares), table(rec.collective_waits), table(rec.fix_bounds)
    fmt = {"float_format": lambda v: f"{v:,.3f}", "index": False}
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"{rec.device} traces, ranks {rec.ranks}, {len(cp.windows)} steps "
              f"({rec.step_kind}: the steps below), critical paths in {time.monotonic() - t0:.1f} s")
        print("\nThe wall step by category: its share on the critical path beside its summed share of op time:")
        print(shares.to_string(**fmt))
        if not waits.empty:
            print("\nCollectives waiting for a later rank (per step, summed over the waiting ranks):")
            print(waits.to_string(**fmt))
        split = table(rec.collective_split)
        if not split.empty:
            print("\nEach collective instance split into arrival skew (first rank in to last rank in) and transfer "
                  "(last rank in to end), per step:")
            print(split.to_string(**fmt))
        how = "free" if math.isinf(args.speedup) else f"{args.speedup:g}x faster"
        print(f"\nWhat a fix could buy at most (the step replayed with the category {how}):")
        print(fixes.to_string(**fmt))
    print(f"\nwrote {out}/critical_path.parquet, {out}/critical_path.json and {out}/{CHROME_TRACE} (the path as a "
          "trace: open it in Perfetto or chrome://tracing beside the rank traces)")
    return 0
