"""`decodescope analyze-trace DIR`: the per-rank breakdown of any directory of traces.

Start-up is kept to what parsing needs (numpy, orjson): pandas, the analyses and the typed records
(pydantic) are imported once the traces are read, when the results are built.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from decodescope.trace.load import load_trace_dir
from decodescope.trace.reader import TraceError


def analyze_trace_command(args) -> int:
    if args.workers is not None and args.workers < 1:
        print(f"error: --workers {args.workers}: give 1 or more rank files to read at once (default: the cores)",
              file=sys.stderr)
        return 2
    if getattr(args, "breakdown", False):
        return _breakdown(args)
    from decodescope.trace.parse import small_pages

    with small_pages():  # for the whole command: its analyses allocate as much again as the parse
        if getattr(args, "critical_path", False):
            from decodescope.cli.critical_path import critical_path_command

            return critical_path_command(args, _read_or_report)
        return _analyze(args)


def _read_or_report(read, args, empty):
    """read(trace_dir, workers=) with its warnings printed, or None after printing why nothing can be
    analysed (a missing directory, no trace, no rank parsed)."""
    try:
        result = read(Path(args.trace_dir), workers=args.workers)
    except (TraceError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if empty(result):
        print("error: no rank trace could be parsed", file=sys.stderr)
        return None
    return result


def _analyze(args) -> int:
    t0 = time.monotonic()
    loaded = _read_or_report(load_trace_dir, args, lambda r: r.events.empty)
    if loaded is None:
        return 2
    config = None
    if args.model_config:
        try:
            config = json.loads(Path(args.model_config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: --model-config {args.model_config}: {e}", file=sys.stderr)
            return 2
    import pandas as pd

    from decodescope.schema.records import write_record
    from decodescope.trace.draftsteps import DRAFTER_STEPS
    from decodescope.trace.profile import analyze_traces, level_drafter, write_profile

    result = analyze_traces(loaded, config, args.tp)
    out = Path(args.out) if args.out else Path(args.trace_dir) / "analysis"
    summary = write_profile(result, out)
    drafter = level_drafter(loaded, result, None)
    if drafter is not None:  # speculative steps: their drafter, as 04 writes it per level
        write_record(out / DRAFTER_STEPS, drafter)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"{result.device} traces, ranks {summary.ranks}, steps {summary.steps}, "
              f"parsed and analysed in {time.monotonic() - t0:.1f} s")
        print("\nTime by category (per rank):")
        print(result.breakdown.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
        if not result.expected.empty:
            print(f"\nCollectives per {result.step_kind} step, expected vs observed:")
            print(result.expected.to_string(index=False))
        ps = summary.per_step
        if ps.summed_us_median is not None:
            print(f"\nMedian {result.step_kind} step: summed {ps.summed_us_median:,.1f} us, busy (union) "
                  f"{ps.busy_us_median:,.1f} us, wall {ps.wall_us_median:,.1f} us")
        if drafter is not None:
            print(f"\nDrafter after each verify step (median of {drafter.steps}): {drafter.passes} passes, lead "
                  f"{drafter.lead_us:,.1f} us, first pass {drafter.first_pass_us:,.1f} us, whole {drafter.drafter_us:,.1f} us")
    print(f"\nwrote {out}/kernels.parquet and {out}/profile_summary.json"
          + (f" and {out}/{DRAFTER_STEPS}" if drafter is not None else ""))
    return 0


def _breakdown(args) -> int:
    """--breakdown: time by category per rank and by name, reduced as the files are read
    (breakdown.breakdown_dir); tables printed as plain text, breakdown.json written."""
    import gc

    from decodescope.trace.breakdown import breakdown_dir
    from decodescope.trace.breakdown_file import BreakdownFile

    # what the imports made lives to the end: out of the collector's sweeps (~20 ms of a 0.3 s run)
    gc.freeze()
    t0 = time.monotonic()
    bd = _read_or_report(breakdown_dir, args, lambda r: not r.ranks)
    if bd is None:
        return 2
    out = Path(args.out) if args.out else Path(args.trace_dir) / "analysis"
    BreakdownFile.of(bd).write(out / "breakdown.json")
    print(f"{bd.device} traces, ranks {bd.ranks}, {sum(m.bytes_json for m in bd.metas) / 1e6:,.0f} MB of JSON "
          f"read in {time.monotonic() - t0:.2f} s")
    print("\nTime by category (per rank; " + ("self time of CPU ops" if bd.device == "cpu" else "GPU kernels") + "):")
    print(f"{'rank':>4}  {'category':<28} {'time_us':>14} {'share':>7} {'calls':>9} {'mean_us':>10}")
    for r in bd.categories:
        print(f"{r['rank']:>4}  {r['category']:<28} {r['time_us']:>14,.1f} {r['share']:>7.1%} {r['calls']:>9,} "
              f"{r['mean_us']:>10,.2f}")
    print(f"\nwrote {out}/breakdown.json")
    return 0
