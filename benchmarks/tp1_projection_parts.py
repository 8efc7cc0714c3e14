"""The tensor-parallel 1 projection part by part against a TP=1 server's own profile, on one run directory.

The verdict sets its TP=1 projection (priced from the TP=2 baseline's 02, 03 and 04) against the TP=1
variant's client TPOT only: a miss says how much, not which part. With the variant profiled too
(`profile: true` on the tp1 variant of params/experiments.yaml), both steps are split the same way
(decodescope.verdict.stepmodel.step_samples on each profile), and each projected part is printed beside
what the TP=1 profile measured, at every batch the variant profiled.

    python benchmarks/tp1_projection_parts.py RUN_DIR [--variant tp1]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from decodescope.schema.params import load_params
from decodescope.verdict import stepmodel as sm
from decodescope.verdict.fixes import model_inputs, profile_captures
from decodescope.verdict.verdict import profile_summaries


def measured_parts(sample: sm.StepSample) -> dict[str, float]:
    """A TP=1 profile's step in the model's part names."""
    return {**sample.classes_us, "idle in step": sample.idle_us, "between steps": sample.between_us,
            sm.REST: sample.rest_us, sm.PROFILER_COST: sample.profiler_cost_us or 0.0}


def compare(run_dir: Path, variant: str) -> list[dict]:
    """Per batch the variant profiled: each part projected (from the baseline) and measured (its profile)."""
    params = load_params(run_dir / "params.yaml")
    inp = model_inputs(run_dir, params, profile_summaries(run_dir, params), profile_captures(run_dir))
    if inp is None:
        raise SystemExit(f"{run_dir}: no step model (02, 03 or 04 missing)")
    vdir = run_dir / "variants" / variant
    vparams = load_params(vdir / "params.yaml")
    tp = vparams.server.tensor_parallel
    samples = sm.step_samples(profile_summaries(vdir, vparams), inp.samples[0].context_tokens, profile_captures(vdir))
    if not samples:
        raise SystemExit(f"{vdir}: no profile (set `profile: true` on the variant)")
    rows = []
    for s in samples:
        fix = inp.at_tensor_parallel(tp, s.batch)
        if fix is None:
            raise SystemExit(f"{run_dir}: 02 did not measure tensor-parallel {tp}'s GEMMs (whatif.tensor_parallel)")
        projected = {c.name: c.us for c in fix.prediction.components}
        measured = measured_parts(s)
        for part in dict.fromkeys([*projected, *measured]):
            rows.append({"batch": s.batch, "part": part, "projected_us": projected.get(part, 0.0),
                         "measured_us": measured.get(part, 0.0)})
        # the projection is of the unprofiled step; the profile's period less its measured profiler's cost
        rows.append({"batch": s.batch, "part": "step, unprofiled", "projected_us": fix.prediction.period_us,
                     "measured_us": s.period_us - (s.profiler_cost_us or 0.0)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--variant", default="tp1")
    a = ap.parse_args()
    print(f"# {a.run_dir} (variant {a.variant}): projected from the baseline vs the variant's own profile, us per step")
    for r in compare(a.run_dir, a.variant):
        ratio = r["projected_us"] / r["measured_us"] if r["measured_us"] else float("nan")
        print(f"batch {r['batch']:g}  {r['part'][:44]:44s} projected {r['projected_us']:8.0f}  measured "
              f"{r['measured_us']:8.0f}  projected/measured {ratio:5.2f}")


if __name__ == "__main__":
    main()
