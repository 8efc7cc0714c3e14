"""The step model at the serving levels between two profiled ones, against the baseline's measured TPOT there
(verdict.fixes.baseline_tpot), beside a candidate it does not use yet: the longer of the step at the profiled
level below (host-bound) and the kernels at the batch vLLM runs (padded up to its next CUDA-graph capture size)
with the idle and profiler cost of the profiled level above (GPU-bound).

    python benchmarks/step_model_between_levels.py [RUN_DIR ..]   # default: every committed GPU fixture run

Prints per level the measurement, the model and the candidate with their errors, and per run how many of its
levels between profiled ones each holds within 10%. Profiled levels are the model's own inputs: marked, not counted.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from decodescope.schema.rundata import RunDir  # noqa: E402
from decodescope.verdict import fixes  # noqa: E402
from tests.fixture_verdicts import FIXTURE_RUNS, run_params  # noqa: E402

# vLLM's default CUDA-graph capture sizes (its server log lists a run's own): a decode batch runs padded up to one
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 1025, 8))
HOST_PARTS = ("idle in step", "between steps", "rest of the profiled period", "profiler's own cost")
WITHIN = 0.10


def padded(batch: float) -> int:
    return next(s for s in CAPTURE_SIZES if s >= batch)


def candidate_us(inp, batch: float, below: int, above: int) -> float:
    """max(the step at the profiled level below, the kernels at the padded batch + the host's parts at the
    batch with the level above's idle and profiler cost)."""
    parts = {c.name: c.us for c in inp.predict(padded(batch)).components}
    above_parts = {c.name: c.us for c in inp.predict(above).components}
    kernels = sum(v for k, v in parts.items() if k not in HOST_PARTS)
    gpu_bound = (kernels + above_parts.get("idle in step", 0.0) + parts.get("between steps", 0.0)
                 + parts.get("rest of the profiled period", 0.0) - above_parts.get("profiler's own cost", 0.0))
    return max(inp.predict(below).period_us, gpu_bound)


def compare(run: Path) -> tuple[int, int, int]:
    """Print the run's table; (levels between profiled ones, the model's within 10%, the candidate's)."""
    with run_params(run) as params:
        captures = fixes.profile_captures(run)
        summaries = fixes.profile_summaries(run, params)
        inp = fixes.model_inputs(run, params, summaries, captures)
        measured = fixes.baseline_tpot(RunDir(run).serving_levels(), captures)
    profiled = sorted(int(c) for c in summaries)
    print(f"\n{run.name} (profiled at {', '.join(map(str, profiled))})")
    print(f"{'level':>6} {'measured us':>12} {'model us':>10} {'error':>8} {'candidate us':>13} {'error':>8}")
    n = ok_model = ok_candidate = 0
    for level, tpot in sorted(measured.items()):
        model = inp.predict(level).period_us
        below = max((c for c in profiled if c <= level), default=None)
        above = min((c for c in profiled if c >= level), default=None)
        between = below is not None and above is not None and below != above
        cand = candidate_us(inp, level, below, above) if between else model
        mark = "" if between else ("  profiled" if level in profiled else "  outside")
        print(f"{int(level):>6} {tpot:>12,.0f} {model:>10,.0f} {model / tpot - 1:>+8.1%} {cand:>13,.0f} "
              f"{cand / tpot - 1:>+8.1%}{mark}")
        if between:
            n += 1
            ok_model += abs(model / tpot - 1) <= WITHIN
            ok_candidate += abs(cand / tpot - 1) <= WITHIN
    return n, ok_model, ok_candidate


def main(argv: list[str]) -> int:
    runs = [Path(a) for a in argv] or sorted(d for d in FIXTURE_RUNS.glob("vllm_gpu_*") if (d / "data").is_dir())
    totals = [0, 0, 0]
    for run in runs:
        for i, v in enumerate(compare(run)):
            totals[i] += v
    n, m, c = totals
    print(f"\nlevels between two profiled ones: {n}; within {WITHIN:.0%}: the model {m}, the candidate {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
