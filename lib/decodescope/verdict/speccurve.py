"""Speculative decoding across k: the TPOT projected at k = 1..5 for each drafter a profiled variant measured,
beside the TPOT measured where a variant ran that k, and the fix the ranking ("What would move it") takes
from them: the best k at the measured acceptance with the measured drafter.

A drafter here is the method and draft model of a speculative config (speculative.drafter_key). Its
acceptance per position comes from the variant of that drafter with the most draft positions at the
server's own sampling; its cost from the profiled variant nearest in k (variants.drafter_sources).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd

from decodescope.schema.params import with_experiment
from decodescope.schema.rundata import RunDir
from decodescope.verdict import stepmodel as sm
from decodescope.verdict.fixes import Fix, ModelInputs, baseline_tpot, level_tpot
from decodescope.verdict.speculative import (DrafterCost, best_k, drafter_key, drafter_of, drafter_us, nearest_drafter,
                                             tokens_per_verify_at_k)
from decodescope.verdict.variants import drafter_component, variant_spec

SPEC_KS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class MeasuredDrafter:
    """A drafter the variants measured: its name, its acceptance per position at each serving level (the
    server's sampling) and the variant that gave it, its cost by profiled variant, and the variant that ran
    each k at the server's sampling."""

    key: str
    label: str
    acceptance: dict[float, list[float]]
    acceptance_from: str
    costs: dict[str, list[DrafterCost]]
    variants: dict[int, str]

    def at(self, batch: float) -> list[float]:
        """The acceptance per position at the serving level nearest `batch`."""
        return self.acceptance[min(self.acceptance, key=lambda b: abs(b - batch))]

    def drafter_us(self, k: int, batch: float, verify_us: float) -> tuple[float, str]:
        """The drafter's time a verify step at k and `batch`, from the variant that ran k where it was
        profiled, else the profiled variant nearest in k (speculative.nearest_drafter); verify_us: the verify
        step as priced, which a GPU's lead overlaps."""
        return drafter_us(nearest_drafter(self.costs, self.variants.get(k, ""), k) or [], k, batch, verify_us)

    def by_k(self, inp: ModelInputs, batch: float, scale: float) -> tuple[int, dict[int, "AtK"]]:
        """(the best k, each k in SPEC_KS priced): the verify step (the step model at batch x (k + 1), priced
        once a k), the drafter against it, and the TPOT (the verify calibrated by `scale`, plus the drafter,
        over the tokens a verify step yields at the measured acceptance per position: speculative.best_k)."""
        verify = {k: inp.predict(batch * (k + 1)) for k in SPEC_KS}
        drafter = {k: self.drafter_us(k, batch, verify[k].wall_us) for k in SPEC_KS}
        best, tpot = best_k(lambda k: verify[k].period_us * scale, lambda k: drafter[k][0], self.at(batch), SPEC_KS)
        return best, {k: AtK(tpot[k], verify[k], *drafter[k]) for k in SPEC_KS}


class AtK(NamedTuple):
    """One k of a measured drafter at one batch, priced (MeasuredDrafter.by_k)."""

    tpot_us: float
    verify: sm.StepPrediction
    drafter_us: float
    drafter_from: str


def _speculative_variants(params) -> list[tuple[str, dict, bool]]:
    """(name, speculative config, at the server's own sampling) of each variant that has a config."""
    out = []
    for exp in params.experiments:
        vparams = with_experiment(params, exp.name)
        spec = variant_spec(vparams)
        if spec is not None:
            out.append((exp.name, spec, vparams.workload.temperature is None))
    return out


def _acceptance_by_level(run_dir: Path, name: str) -> dict[float, list[float]]:
    """A variant's acceptance per position at each serving level where it drafted (01's telemetry)."""
    lev = RunDir(run_dir).variant(name).serving_levels()
    if lev is None or "server_spec_accepted_per_pos" not in lev:
        return {}
    return {float(r.level): [float(x) for x in str(r.server_spec_accepted_per_pos).split(",")]
            for r in lev.itertuples() if r.server_spec_accepted_per_pos}


def measured_drafters(run_dir: Path, params, sources: dict[str, dict[str, list[DrafterCost]]]
                      ) -> list[MeasuredDrafter]:
    """Each drafter with a profiled cost and a variant at the server's sampling that measured its acceptance."""
    spec_variants = _speculative_variants(params)
    out = []
    for key, costs in sources.items():
        if not any(costs.values()):
            continue
        mine = {int(spec.get("num_speculative_tokens", 1)): (name, spec) for name, spec, own_sampling
                in reversed(spec_variants) if own_sampling and drafter_key(spec) == key}
        best: Optional[tuple[int, str, dict[float, list[float]]]] = None
        for name, spec, own_sampling in spec_variants:
            if not own_sampling or drafter_key(spec) != key:
                continue
            acc = _acceptance_by_level(run_dir, name)
            k = int(spec.get("num_speculative_tokens", 1))
            if acc and (best is None or k > best[0]):
                best = (k, name, acc)
        if best is not None:
            out.append(MeasuredDrafter(key, drafter_of(mine[best[0]][1], None), best[2], best[1], costs,
                                       {k: name for k, (name, _) in mine.items()}))
    return out


def spec_k_rows(run_dir: Path, params, inp: ModelInputs, levels: Optional[pd.DataFrame], captures,
                drafters: list[MeasuredDrafter]) -> list[dict]:
    """Per drafter, serving level and k in 1..5: the projected TPOT, the measured one where a variant ran that
    k, and which k the projection names best at the level."""
    if levels is None or levels.empty:
        return []
    calibration = baseline_tpot(levels, captures)
    rows = []
    for d in drafters:
        measured = {k: RunDir(run_dir).variant(name).serving_levels() for k, name in d.variants.items()}
        for lv in levels.sort_values("level").itertuples():
            b = float(lv.level)
            base = inp.predict(b).period_us
            best, priced = d.by_k(inp, b, calibration.get(b, base) / base)
            for k, at in priced.items():
                row = {"drafter": d.label, "level": int(b), "k": k, "projected_tpot_us": at.tpot_us,
                       "drafter_us": at.drafter_us, "tokens_per_verify": tokens_per_verify_at_k(d.at(b), k),
                       "acceptance_from": d.acceptance_from, "drafter_from": at.drafter_from,
                       "variant": d.variants.get(k, ""), "best_projected": k == best}
                vlev = measured.get(k)
                hit = vlev[vlev["level"] == lv.level] if vlev is not None else None
                if hit is not None and not hit.empty:
                    row["measured_tpot_us"] = level_tpot(next(hit.itertuples()))[0]
                rows.append(row)
    return rows


def measured_spec_fixes(inp: ModelInputs, batch: float, drafters: list[MeasuredDrafter], scale: float) -> list[Fix]:
    """For "What would move it": each measured drafter at its best k for `batch` (calibrated by `scale`, as
    spec_k_rows picks it), the drafter a part measured whole."""
    out = []
    for d in drafters:
        k, priced = d.by_k(inp, batch, scale)
        verify, drafter, how = priced[k].verify, priced[k].drafter_us, priced[k].drafter_from
        tokens = tokens_per_verify_at_k(d.at(batch), k)
        out.append(Fix(f"speculative decoding k={k}, {d.label} drafter (measured acceptance and drafter)",
                       sm.StepPrediction(verify.batch, verify.components + [drafter_component(drafter, how)],
                                         verify.overlap), tokens, inp.tp,
                       [f"the best k of 1..5 at this batch; verify step = the step model at batch {batch:g} x {k + 1}",
                        f"{tokens:.2f} tokens a verify step from {d.acceptance_from}'s acceptance per position",
                        f"drafter: {drafter:,.0f} us a verify step, {how}"], measured_us=drafter))
    return out
