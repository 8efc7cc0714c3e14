"""03's step probe jobs (the replay, then the skew calibration at each microbench.skew_calibration_us delay)
as one torchrun launch (`probes/step.py --then`, what 03 runs) against one launch a job (what 03 ran before
2026-12-08), on the run's params and host, in one process, alternated ABBA over ROUNDS rounds so a drift of
the host falls on both. Prints each launch's wall, the medians and the ratio one/separate.

    python benchmarks/step_probe_launches.py [params/default.yaml] [ROUNDS]
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

from decodescope.micro import skewcal
from decodescope.micro.bench import run_torchrun_probe
from decodescope.schema.params import load_params

ROUNDS = 2
MODULE = "decodescope.probes.step"


def jobs(params, run_dir: Path) -> list[list]:
    """03's jobs on run_dir, as 03 builds them (micro.skewcal.phase_jobs)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return skewcal.phase_jobs(params, run_dir, skewcal.calibration_record(params))[0]


def launch(params, run_dir: Path, job_list: list[list]) -> float:
    t0 = time.monotonic()
    run_torchrun_probe(params, run_dir, MODULE, skewcal.one_launch(job_list), params.server.tensor_parallel,
                       log_name="step_probe")
    return time.monotonic() - t0


def main() -> None:
    params = load_params(Path(sys.argv[1] if len(sys.argv) > 1 else "params/default.yaml"))
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else ROUNDS
    walls: dict[str, list[float]] = {"one launch": [], "a launch a job": []}
    with tempfile.TemporaryDirectory(prefix="step-launches-") as tmp:
        for r in range(rounds):
            order = ("one launch", "a launch a job") if r % 2 == 0 else ("a launch a job", "one launch")
            for how in order:
                run_dir = Path(tmp) / f"r{r}-{how.replace(' ', '_')}"
                job_list = jobs(params, run_dir)
                wall = (launch(params, run_dir, job_list) if how == "one launch" else
                        sum(launch(params, run_dir, [job]) for job in job_list))
                walls[how].append(wall)
                print(f"round {r}: {how:>15}: {len(job_list)} jobs, {wall:6.1f} s", flush=True)
    one, each = (statistics.median(walls[k]) for k in ("one launch", "a launch a job"))
    print(f"median: one launch {one:.1f} s, a launch a job {each:.1f} s; ratio one/separate {one / each:.2f} "
          f"({each - one:.1f} s saved a run of 03)")


if __name__ == "__main__":
    main()
