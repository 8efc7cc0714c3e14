"""04_profile's work, level by level: capture every level of profile.concurrency through the engine's profiler
(profiling.capturephase), analyse each level's traces (trace.profile), and write each level's records to
data/profile/c<N>/ (its summary, drafter, critical path and the path as a Chrome trace); the growth of the
step across the levels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from decodescope.critpath.chrome import CHROME_TRACE, write_chrome_trace
from decodescope.critpath.record import write_critical_path
from decodescope.critpath.table import CriticalPaths
from decodescope.profiling.capture import CaptureResult, host_ops_prompt_tokens
from decodescope.profiling.capturephase import capture_for_phase
from decodescope.schema.phasecontext import PhaseContext
from decodescope.schema.records import ProfileSummary, StepCategoryRow, frame, write_record
from decodescope.schema.rundata import RunDir
from decodescope.trace.classtime import class_time_per_step
from decodescope.trace.draftsteps import DRAFTER_STEPS
from decodescope.trace.hostops import HOST_OPS_RECORD, host_op_costs, read_host_events
from decodescope.trace.load import load_trace_dir
from decodescope.trace.profile import ProfileResult, analyze_traces, level_drafter, write_profile


@dataclass
class ProfiledLevel:
    capture: CaptureResult
    result: ProfileResult
    summary: ProfileSummary
    critical_path: Optional[CriticalPaths] = None  # the level's paths (critical_path.json holds their summary)


def profile_for_phase(ctx: PhaseContext) -> tuple[list[ProfiledLevel], list[str]]:
    """04_profile's work: capture every level of profile.concurrency, analyse each level's traces and
    write its files to data/profile/c<N>/; the first level is also written to data/ (the detailed
    sections of 04 and the verdict's reconciliation read it there); the un-graphed step's custom ops to
    data/profile/host_ops.json."""
    captures, notes, host = capture_for_phase(ctx)
    if host is not None and host.rank_files:
        write_record(RunDir(ctx.run_dir).file(HOST_OPS_RECORD),
                     host_op_costs(read_host_events(host.rank_files[0]), host_ops_prompt_tokens(ctx.params)))
    out = []
    for cap in captures:
        loaded = load_trace_dir(cap.trace_dir)
        result = analyze_traces(loaded, ctx.params.model_config_dict(), ctx.params.server.tensor_parallel,
                                batch=cap.concurrency)
        level_dir = RunDir(ctx.run_dir).level_dir(cap.concurrency)
        summary = write_profile(result, level_dir, cap.concurrency)
        drafter = level_drafter(loaded, result, cap.concurrency)
        if drafter is not None:  # a speculative step: its drafter's passes, for the verdict's pricing
            write_record(level_dir / DRAFTER_STEPS, drafter)
        out.append(ProfiledLevel(cap, result, summary))
        out[-1].critical_path = write_critical_path(loaded.events, result.ops, result.steps, level_dir,
                                                    cap.concurrency)
        # the path as a Chrome trace, to open beside the level's rank traces (Perfetto, chrome://tracing)
        write_chrome_trace(out[-1].critical_path, level_dir / CHROME_TRACE, source=str(cap.trace_dir))
    write_profile(out[0].result, RunDir(ctx.run_dir).data, out[0].capture.concurrency)
    return out, notes


def growth_table(levels: list[ProfiledLevel]) -> pd.DataFrame:
    """The step at each profiled level, median rank: batch, wall, period (with the host's time
    between steps), and the time per step of each verdict class."""
    rows = []
    for lv in levels:
        ps = lv.summary.per_step
        row = {"concurrency": lv.capture.concurrency, "batch": ps.batch_median, "wall_us": ps.wall_us_median,
               "period_us": ps.period_us_median, "between_steps_us": ps.between_steps_us_median,
               "summed_us": ps.summed_us_median, "busy_us": ps.busy_us_median}
        cats = frame(lv.summary.per_step_categories, StepCategoryRow)
        if not cats.empty:
            by = class_time_per_step(cats).groupby("cls").median()
            row.update({f"{c}_us": float(v) for c, v in by.items()})
        rows.append(row)
    return pd.DataFrame(rows)
