"""04's analysis again from a run's own traces, after the analyser changed (e.g. a fix found on a run
that can't be repeated): each profiled level's traces/c<N>/ analysed as 04 does, its files in
data/profile/c<N>/ and the first level's in data/ replaced; then 05 is marked to run again
(`decodescope run PARAMS --resume RUN_DIR --phases 05_verdict` rebuilds the verdict and the report).
The captures themselves (profile_capture.json, the traces) are left as they were.

    python benchmarks/device/reanalyse_profile.py RUN_DIR PARAMS
"""
import sys
from pathlib import Path

from decodescope.core.io import read_json, write_json_atomic
from decodescope.schema.params import load_params
from decodescope.trace.load import load_trace_dir
from decodescope.trace.profile import analyze_traces, write_profile


def main(run_dir: Path, params_path: str) -> None:
    params = load_params(params_path)
    levels = sorted(int(p.name[1:]) for p in (run_dir / "data" / "profile").glob("c*") if p.name[1:].isdigit())
    first = None
    for c in levels:
        result = analyze_traces(load_trace_dir(run_dir / "traces" / f"c{c}"), params.model_config_dict(),
                                params.server.tensor_parallel, batch=c)
        s = write_profile(result, run_dir / "data" / "profile" / f"c{c}", c)
        first = first or (result, c)
        print(f"c{c}: steps {s.steps}, decode step summed {s.per_step.summed_us_median:,.0f} us, busy "
              f"{s.per_step.busy_us_median:,.0f} us, wall {s.per_step.wall_us_median:,.0f} us, "
              f"period {s.per_step.period_us_median:,.0f} us")
    write_profile(first[0], run_dir / "data", first[1])
    manifest = read_json(run_dir / "manifest.json")
    manifest["phases"]["05_verdict"]["status"] = "stale"
    manifest.setdefault("notes", []).append("04's analysis re-derived from the run's traces by "
                                            "benchmarks/device/reanalyse_profile.py; 05 to run again")
    write_json_atomic(run_dir / "manifest.json", manifest)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
