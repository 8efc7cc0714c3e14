"""Speculative decoding across k: the TPOT projected at k = 1..5 for each drafter a profiled variant measured,
beside the TPOT measured where a variant ran that k, and the fix the ranking ("What would move it") takes
from them: the best k at the measured acceptance with the measured drafter.

A drafter here is the method and draft model of a speculative config (speculative.drafter_key). Its
acceptance per position comes from the variant of that drafter with the most draft positions at the
server's own sampling; its cost from the profiled variant nearest in k (variants.drafter_sources).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.schema.rundata import RunDir
from decodescope.exec.serverlaunch import dashed
from decodescope.schema.params import with_experiment
from decodescope.verdict.fixes import Fix, ModelInputs, baseline_tpot, level_tpot
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import stepparts as sp
from decodescope.verdict.speculative import (DrafterCost, drafter_key, drafter_of, drafter_us, nearest_drafter,
                                             tokens_per_verify_at_k)

SPEC_KS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class MeasuredDrafter:
    """A drafter the variants measured: its name, its acceptance per position at each serving level (the
    server's sampling), the variant that gave it, and its cost by profiled variant."""

    key: str
    label: str
    acceptance: dict[float, list[float]]
    acceptance_from: str
    costs: dict[str, list[DrafterCost]]

    def at(self, batch: float) -> list[float]:
        """The acceptance per position at the serving level nearest `batch`."""
        return self.acceptance[min(self.acceptance, key=lambda b: abs(b - batch))]


def _spec(params, name: str) -> Optional[dict]:
    raw = dashed(with_experiment(params, name).server.engine_args).get("speculative-config")
    try:
        return raw if isinstance(raw, dict) else (json.loads(raw) if raw else None)
    except ValueError:
        return None


def measured_drafters(run_dir: Path, params, sources: dict[str, dict[str, list[DrafterCost]]]
                      ) -> list[MeasuredDrafter]:
    """Each drafter with a profiled cost and a variant at the server's sampling that measured its acceptance."""
    out = []
    for key, costs in sources.items():
        if not any(costs.values()):
            continue
        best: Optional[tuple[int, str, dict[float, list[float]]]] = None
        for exp in params.experiments:
            spec = _spec(params, exp.name)
            if spec is None or drafter_key(spec) != key or with_experiment(params, exp.name).workload.temperature is not None:
                continue
            lev = RunDir(run_dir).variant(exp.name).serving_levels()
            if lev is None or "server_spec_accepted_per_pos" not in lev:
                continue
            acc = {float(r.level): [float(x) for x in str(r.server_spec_accepted_per_pos).split(",")]
                   for r in lev.itertuples() if r.server_spec_accepted_per_pos}
            k = int(spec.get("num_speculative_tokens", 1))
            if acc and (best is None or k > best[0]):
                best = (k, exp.name, acc)
        if best is not None:
            spec = _spec(params, best[1]) or {}
            out.append(MeasuredDrafter(key, drafter_of(spec, None), best[2], best[1], costs))
    return out


def _variant_of(params, key: str, k: int) -> Optional[str]:
    """The variant of this drafter at k draft tokens and the server's sampling, if one ran."""
    for exp in params.experiments:
        spec = _spec(params, exp.name)
        if (spec is not None and drafter_key(spec) == key and int(spec.get("num_speculative_tokens", 1)) == k
                and with_experiment(params, exp.name).workload.temperature is None):
            return exp.name
    return None


def projected_tpot_us(inp: ModelInputs, d: MeasuredDrafter, own: Optional[str], k: int, batch: float,
                      scale: float) -> tuple[float, float, str]:
    """(TPOT, the drafter's time a verify step, where it came from) at k and `batch`: the verify step (the step
    model at batch x (k + 1), calibrated by `scale`) plus the measured drafter, over the tokens a verify step
    yields at the measured acceptance per position."""
    costs = nearest_drafter(d.costs, own or "", k) or []
    drafter, how = drafter_us(costs, k, batch)
    verify = inp.predict(batch * (k + 1)).period_us * scale
    return (verify + drafter) / tokens_per_verify_at_k(d.at(batch), k), drafter, how


def spec_k_rows(run_dir: Path, params, inp: ModelInputs, levels: Optional[pd.DataFrame], captures,
                drafters: list[MeasuredDrafter]) -> list[dict]:
    """Per drafter, serving level and k in 1..5: the projected TPOT, the measured one where a variant ran that
    k, and which k the projection names best at the level."""
    if levels is None or levels.empty:
        return []
    calibration = baseline_tpot(levels, captures)
    rows = []
    for d in drafters:
        for lv in levels.sort_values("level").itertuples():
            b = float(lv.level)
            base = inp.predict(b).period_us
            scale = calibration.get(b, base) / base
            level_rows: list[dict] = []
            for k in SPEC_KS:
                own = _variant_of(params, d.key, k)
                tpot, drafter, how = projected_tpot_us(inp, d, own, k, b, scale)
                row = {"drafter": d.label, "level": int(b), "k": k, "projected_tpot_us": tpot, "drafter_us": drafter,
                       "tokens_per_verify": tokens_per_verify_at_k(d.at(b), k), "acceptance_from": d.acceptance_from,
                       "drafter_from": how, "variant": own or ""}
                vlev = RunDir(run_dir).variant(own).serving_levels() if own else None
                hit = vlev[vlev["level"] == lv.level] if vlev is not None else None
                if hit is not None and not hit.empty:
                    row["measured_tpot_us"] = level_tpot(next(hit.itertuples()))[0]
                level_rows.append(row)
            best = min(level_rows, key=lambda r: float(r["projected_tpot_us"]))
            for r in level_rows:
                r["best_projected"] = r is best
            rows += level_rows
    return rows


def measured_spec_fixes(inp: ModelInputs, batch: float, drafters: list[MeasuredDrafter]) -> list[Fix]:
    """For "What would move it": each measured drafter at its best k for `batch`, priced like spec_k_rows."""
    out = []
    for d in drafters:
        priced = {}
        for k in SPEC_KS:
            costs = nearest_drafter(d.costs, "", k) or []
            drafter, how = drafter_us(costs, k, batch)
            verify = inp.predict(batch * (k + 1))
            priced[k] = (verify, drafter, how, tokens_per_verify_at_k(d.at(batch), k))
        k = min(priced, key=lambda k: (priced[k][0].period_us + priced[k][1]) / priced[k][3])
        verify, drafter, how, tokens = priced[k]
        comps = verify.components + [sp.Component(sm.DRAFTER, drafter, drafter, drafter, how, [], sp.Kind.HOST_IN_STEP)]
        out.append(Fix(f"speculative decoding k={k}, {d.label} drafter (measured acceptance and drafter)",
                       sm.StepPrediction(verify.batch, comps, verify.overlap), tokens, inp.tp,
                       [f"the best k of 1..5 at this batch; verify step = the step model at batch {batch:g} x {k + 1}",
                        f"{tokens:.2f} tokens a verify step from {d.acceptance_from}'s acceptance per position",
                        f"drafter: {drafter:,.0f} us a verify step, {how}"], measured_us=drafter))
    return out
