"""Give a run directory's profile summaries the step period's trimmed mean (per_step.period_us_trimmed_mean), as 04 writes it
since the field came in, from each level's own profile_steps.parquet through the same function 04 uses
(trace.profile.step_periods); a summary whose median does not match its steps is refused. For runs measured
before the field (the H200 runs whose traces did not come back), so that 05 can be run again on them:
    python benchmarks/device/fill_period_trimmed_mean.py RUN_DIR
    decodescope run RUN_DIR/params.yaml --resume RUN_DIR --phases 05_verdict"""
import sys
from pathlib import Path

import pandas as pd

from decodescope.schema.records import ProfileSummary, read_record, write_record
from decodescope.trace.profile import step_periods


def fill(run_dir: Path) -> list[str]:
    done = []
    for summary_path in sorted(run_dir.glob("data/**/profile_summary.json")):
        steps_path = summary_path.parent / "profile_steps.parquet"
        if not steps_path.is_file():
            continue
        summary = read_record(summary_path, ProfileSummary)
        periods = step_periods(pd.read_parquet(steps_path), summary.step_kind or "decode")
        recorded = summary.per_step.period_us_median
        if recorded is None or abs(recorded - (periods["period_us_median"] or 0.0)) > 1e-6:
            raise SystemExit(f"{summary_path}: period_us_median {recorded} is not its steps' "
                             f"({periods['period_us_median']}): not the summary of these steps")
        summary.per_step.period_us_trimmed_mean = periods["period_us_trimmed_mean"]
        write_record(summary_path, summary)
        done.append(f"{summary_path.relative_to(run_dir)}: period median {recorded:,.0f} us, "
                    f"trimmed mean {periods['period_us_trimmed_mean']:,.0f} us")
    return done


if __name__ == "__main__":
    for line in fill(Path(sys.argv[1])):
        print(line)
