"""`decodescope analyze-trace DIR --critical-path`: each step's critical path, the wall step by category
beside the summed shares, the collectives' waits and what a fix of each category could buy at most."""
from __future__ import annotations

import time
from pathlib import Path

from decodescope.core.io import write_json_atomic, write_parquet_atomic
from decodescope.trace.load import load_trace_dir


def critical_path_command(args, read_or_report) -> int:
    t0 = time.monotonic()
    loaded = read_or_report(load_trace_dir, args, lambda r: r.events.empty)
    if loaded is None:
        return 2
    # imported when the mode runs: analyze-trace starts without pandas (start-up budget, cli/main.py)
    import pandas as pd

    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.trace.critpath_summary import attribution, collective_waits, fix_bounds
    from decodescope.trace.critpath_table import critical_paths

    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    kind = "decode" if (cp.windows["kind"] == "decode").any() else "all"
    shares = attribution(cp, ops, kind)
    waits = collective_waits(cp, kind)
    fixes = fix_bounds(cp, kind, speedup=args.speedup)
    out = Path(args.out) if args.out else Path(args.trace_dir) / "analysis"
    write_parquet_atomic(out / "critical_path.parquet", cp.segments)
    write_json_atomic(out / "critical_path.json", {
        "device": ops.attrs.get("device"), "ranks": loaded.ranks, "step_kind": kind,
        "steps": int((cp.windows["kind"] == kind).sum()) if kind != "all" else len(cp.windows),
        "wall_us_median": float(cp.windows.loc[cp.windows["kind"] == kind, "wall_us"].median())
        if kind != "all" else float(cp.windows["wall_us"].median()),
        "shares": shares.to_dict("records"), "collective_waits": waits.to_dict("records"),
        "fix_bounds": fixes.to_dict("records")})
    fmt = {"float_format": lambda v: f"{v:,.3f}", "index": False}
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"{ops.attrs.get('device')} traces, ranks {loaded.ranks}, {len(cp.windows)} steps "
              f"({kind}: the steps below), critical paths in {time.monotonic() - t0:.1f} s")
        print("\nThe wall step by category: its share on the critical path beside its summed share of op time:")
        print(shares.to_string(**fmt))
        if not waits.empty:
            print("\nCollectives waiting for a later rank (per step, summed over the waiting ranks):")
            print(waits.to_string(**fmt))
        print(f"\nWhat a fix could buy at most (the step replayed with the category {args.speedup:g}x faster):")
        print(fixes.to_string(**fmt))
    print(f"\nwrote {out}/critical_path.parquet and {out}/critical_path.json")
    return 0
