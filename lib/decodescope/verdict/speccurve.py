"""Speculative decoding across k: the TPOT projected at k = 1..5 for each drafter a profiled variant measured,
beside the TPOT measured where a variant ran that k, and the fix the ranking ("What would move it") takes
from them: the best k at the measured acceptance with the measured drafter.

A drafter here is the method and draft model of a speculative config (speculative.drafter_key). Its
acceptance per position comes from the variant of that drafter with the most draft positions at the
server's own sampling; its cost from the profiled variant nearest in k (variants.drafter_sources).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import pandas as pd

from decodescope.schema.params import with_experiment
from decodescope.schema.rundata import RunDir
from decodescope.verdict import stepmodel as sm
from decodescope.verdict.fixes import (Fix, ModelInputs, baseline_tpot, expected_tokens_per_verify, fixes_at,
                                       level_tpot)
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


# ---- drafters priced from unprofiled measurements, each variant without its own (issue 52) ------------
# A speculative step at batch b with k draft tokens, as vLLM's draft-model proposer runs it: the verify (the
# target at b x (k + 1) tokens), the rejection sampler and the drafter's inputs (a part per step, L), and k
# draft passes (P each). Measured unprofiled, the step is TPOT x tokens per verify. The verify comes from the
# step model, calibrated by the baseline's TPOT at the level; L and P are fitted, per level, to the other
# variants of the same drafter (least squares over their k): a variant is never priced from its own TPOT.
# The profile is not read for sizes: under the profiler a draft pass ran 1.1-1.4x its unprofiled time (its
# eager attention is host work, which the profiler slows per event), the verify's GPU work ~1.0x.
# Where a drafter has no two other k measured, a smaller draft of the same architecture takes the self
# drafter's L and its pass scaled by its layers over the target's (the pass is the layers' work: the lm_head
# at a vocabulary of 1,024 is ~0.1% of it); an n-gram drafter the self drafter's L and no pass. That fallback
# missed by up to 30% (spec_20261206: L holds the draft model's first pass and inputs, which an n-gram drafter
# has not and a two-layer draft has an eighth of). Tokens per verify: the acceptance per position of the
# other variants of the drafter at the same sampling (greedy or the server's), else the variant's own
# (measured, not projected; said so).


@dataclass(frozen=True)
class SpecMeasure:
    """One speculative variant as 01 measured it, unprofiled: its drafter, k, sampling, and per level the TPOT,
    the tokens per verify step and the acceptance per position (the server's spec-decode metrics)."""

    name: str
    key: str
    drafter: str
    k: int
    greedy: bool
    draft_layers: Optional[int]
    tpot_us: dict[int, float]
    tokens: dict[int, float]
    per_pos: dict[int, list[float]]
    output_tokens: int = 0

    def step_us(self, level: int) -> float:
        """The unprofiled step: TPOT x the tokens a verify step yields over a request (per_request_tokens)."""
        return self.tpot_us[level] * per_request_tokens(self.tokens[level], self.output_tokens)


def per_request_tokens(tokens: float, output_tokens: int) -> float:
    """The tokens a verify step yields, as a request's TPOT sees them: its n - 1 tokens after the first come in
    ceil((n - 1) / tokens) steps, the last one cut at the request's length (at n = 128 and 6 tokens a verify,
    22 steps, 5.77 a step: the server's inter-token latency, one step, is TPOT x 5.77, not x 6). Without n,
    `tokens`; where `tokens` is no whole number (acceptance that varies step to step), `tokens`: the cut then
    falls anywhere in the last step."""
    if output_tokens <= 1 or tokens <= 1.0 or abs(tokens - round(tokens)) > 1e-3:
        return tokens
    n = output_tokens - 1
    return n / math.ceil(n / tokens - 1e-9)


def _draft_layers(spec: dict, params) -> Optional[int]:
    """The draft model's layers: the target's for the self drafter, an '@config:' draft's from its config."""
    model = str(spec.get("model") or "")
    if drafter_of(spec, None) == "self":
        return int(params.model_config_dict().get("num_hidden_layers", 0)) or None
    if model.startswith("@config:") and params.source_path is not None:
        try:
            cfg = json.loads((Path(params.source_path).parent / model[len("@config:"):]).read_text())
        except (OSError, ValueError):
            return None
        return int(cfg.get("num_hidden_layers", 0)) or None
    return None


def spec_measures(run_dir: Path, params) -> list[SpecMeasure]:
    """Every speculative variant that 01 measured with the server's spec-decode metrics, profiled or not."""
    out = []
    for exp in params.experiments:
        vparams = with_experiment(params, exp.name)
        spec = variant_spec(vparams)
        lev = RunDir(run_dir).variant(exp.name).serving_levels()
        if spec is None or lev is None or lev.empty or "server_spec_accept_len" not in lev:
            continue
        tpot, tokens, pos = {}, {}, {}
        for r in lev.itertuples():
            n = getattr(r, "server_spec_accept_len", None)
            if n is None or n != n or n <= 0:
                continue
            tpot[int(r.level)], tokens[int(r.level)] = level_tpot(r)[0], float(n)
            raw = str(getattr(r, "server_spec_accepted_per_pos", "") or "")
            pos[int(r.level)] = [float(x) for x in raw.split(",")] if raw else []
        if tpot:
            out.append(SpecMeasure(exp.name, drafter_key(spec), drafter_of(spec, None),
                                   int(spec.get("num_speculative_tokens", 1)), vparams.workload.temperature == 0,
                                   _draft_layers(spec, params), tpot, tokens, pos, vparams.workload.output_tokens))
    return out


SELF_KEY = "draft_model|@model"


def _fit_passes(points: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """(L, P) of residual = L + k x P by least squares over (k, residual); None without two distinct k."""
    ks = {k for k, _ in points}
    if len(ks) < 2:
        return None
    x = np.array([[1.0, float(k)] for k, _ in points])
    y = np.array([r for _, r in points])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(coef[0]), float(coef[1])


@dataclass(frozen=True)
class SpecPrice:
    """A speculative variant's (or a k's) TPOT priced at one level without its own measurement."""

    tpot_us: float
    step_us: float
    verify_us: float
    lead_us: float
    pass_us: float
    tokens: float
    how: str


def price_spec(measures: list[SpecMeasure], key: str, drafter: str, k: int, greedy: bool, layers: Optional[int],
               level: int, verify_us, target_layers: int, leave_out: str = "",
               own_per_pos: Optional[list[float]] = None, output_tokens: int = 0) -> Optional[SpecPrice]:
    """The TPOT of drafter `key` at k, sampling `greedy`, at `level`, from the other variants (leave_out: the
    variant priced, never read). verify_us(level, k): the calibrated verify step. None where nothing prices it."""
    out = next((m for m in measures if m.name == leave_out), None)
    # a repeat of the variant priced (the same drafter, k and sampling) is its own measurement: left out too
    others = [m for m in measures if m.name != leave_out and level in m.tpot_us
              and not (out is not None and (m.key, m.k, m.greedy) == (out.key, out.k, out.greedy))]
    # L holds the drafter's own first pass and input preparation (the draft model's, or none for n-gram), so it
    # is fitted to the drafter's own other k wherever two are measured; the self drafter's, scaled, only else
    def fit_of(ms: list[SpecMeasure]) -> Optional[tuple[float, float]]:
        return _fit_passes([(m.k, m.step_us(level) - verify_us(level, m.k)) for m in ms])
    fam = [m for m in others if m.key == key]
    fit = fit_of(fam)
    own = fit is not None or drafter == "self"
    if not own:
        fam = [m for m in others if m.key == SELF_KEY]
        fit = fit_of(fam)
    if fit is None:
        return None
    lead, pass_us = fit
    srcs = ", ".join(sorted(m.name for m in fam))
    if own:
        scale, what = 1.0, f"L + k x P fitted to {srcs}"
    elif drafter == "ngram":
        scale, what = 0.0, f"L of the self drafter ({srcs}); no draft pass"
    elif layers and target_layers:
        scale, what = layers / target_layers, (f"L and P of the self drafter ({srcs}), P x {layers}/{target_layers} "
                                               "layers")
    else:
        return None
    acc = [m for m in others if m.key == key and m.greedy == greedy and m.per_pos.get(level)]
    if acc:
        src = max(acc, key=lambda m: m.k)
        tokens = tokens_per_verify_at_k(src.per_pos[level], k)
        tok_how = f"acceptance per position of {src.name}"
    elif own_per_pos:
        tokens = tokens_per_verify_at_k(own_per_pos, k)
        tok_how = "its own acceptance per position (measured, not projected: no other variant of this drafter)"
    else:
        return None
    v = verify_us(level, k)
    step = v + lead + k * pass_us * scale
    per_request = per_request_tokens(tokens, output_tokens)
    return SpecPrice(step / per_request, step, v, lead, pass_us * scale, tokens,
                     f"verify {v:,.0f} us (step model at c{level} x {k + 1}, calibrated) + L {lead:,.0f} us + "
                     f"{k} x P {pass_us * scale:,.0f} us ({what}), over {tokens:.2f} tokens ({tok_how})")


def calibrated_verify(inp: ModelInputs, levels: Optional[pd.DataFrame], captures):
    """verify_us(level, k): the step model at level x (k + 1) tokens, calibrated where the baseline measured a
    step of as many tokens: x the baseline's TPOT / the model, interpolated in log batch between the measured
    levels (held outside them). The verify of c8 at k = 3 is 32 tokens, a c32 decode step's GEMMs and experts."""
    calibration = baseline_tpot(levels, captures)
    pts = sorted((b, t / inp.predict(b).period_us) for b, t in calibration.items())
    cache: dict[tuple[int, int], float] = {}

    def scale(tokens: float) -> float:
        if not pts:
            return 1.0
        xs, ys = [float(np.log(b)) for b, _ in pts], [s for _, s in pts]
        return float(np.interp(np.log(tokens), xs, ys))

    def verify_us(level: int, k: int) -> float:
        if (level, k) not in cache:
            tokens = level * (k + 1)
            cache[(level, k)] = inp.predict(tokens).period_us * scale(tokens)
        return cache[(level, k)]
    return verify_us


def loo_rows(run_dir: Path, params, inp: ModelInputs, levels: Optional[pd.DataFrame], captures) -> list[dict]:
    """Each speculative variant at each level, measured unprofiled against its TPOT projected from the baseline
    and the other variants only (price_spec with the variant left out)."""
    measures = spec_measures(run_dir, params)
    verify = calibrated_verify(inp, levels, captures)
    layers = inp.arch.num_layers
    rows = []
    for m in measures:
        for level in sorted(m.tpot_us):
            p = price_spec(measures, m.key, m.drafter, m.k, m.greedy, m.draft_layers, level, verify, layers,
                           leave_out=m.name, own_per_pos=m.per_pos.get(level), output_tokens=m.output_tokens)
            row = {"variant": m.name, "drafter": m.drafter, "k": m.k, "greedy": m.greedy, "level": level,
                   "measured_tpot_us": m.tpot_us[level], "measured_tokens": m.tokens[level],
                   "measured_step_us": m.step_us(level)}
            if p is not None:
                row.update(projected_tpot_us=p.tpot_us, projected_step_us=p.step_us, projected_tokens=p.tokens,
                           error_pct=100 * (p.tpot_us / m.tpot_us[level] - 1), how=p.how)
            rows.append(row)
    return rows


def _label(drafter: str, greedy: bool) -> str:
    return f"{drafter}{' (greedy)' if greedy else ''}"


def unprofiled_k_rows(run_dir: Path, params, inp: ModelInputs, levels: Optional[pd.DataFrame], captures
                      ) -> list[dict]:
    """The k figure: per drafter and sampling, level and k in 1..5, the TPOT priced from every measured variant
    (none left out) beside the TPOT measured where a variant ran that k, and the best k projected."""
    measures = spec_measures(run_dir, params)
    verify = calibrated_verify(inp, levels, captures)
    layers = inp.arch.num_layers
    rows = []
    seen = sorted({(m.key, m.drafter, m.greedy, m.draft_layers) for m in measures}, key=str)
    for key, drafter, greedy, dl in seen:
        mine = [m for m in measures if m.key == key and m.greedy == greedy]
        for level in sorted({lv for m in mine for lv in m.tpot_us}):
            own = next((m.per_pos[level] for m in sorted(mine, key=lambda m: -m.k) if m.per_pos.get(level)), None)
            n = max(m.output_tokens for m in mine)
            priced = {k: price_spec(measures, key, drafter, k, greedy, dl, level, verify, layers, own_per_pos=own,
                                    output_tokens=n) for k in SPEC_KS}
            ok = {k: p for k, p in priced.items() if p is not None}
            if not ok:
                continue
            best = min(ok, key=lambda k: ok[k].tpot_us)
            for k, p in ok.items():
                ran = next((m for m in mine if m.k == k and level in m.tpot_us), None)
                rows.append({"drafter": _label(drafter, greedy), "level": level, "k": k,
                             "projected_tpot_us": p.tpot_us, "drafter_us": p.lead_us + k * p.pass_us,
                             "tokens_per_verify": p.tokens,
                             "acceptance_from": p.how.split("(")[-1].rstrip(")"), "drafter_from": p.how,
                             "variant": ran.name if ran else "", "best_projected": k == best,
                             "measured_tpot_us": ran.tpot_us[level] if ran else None})
    return rows


# ---- the ranking ranks what was measured (issue 51 item 5) ---------------------------------------------
def _acceptance_for_tokens(tokens: float, k: int) -> Optional[float]:
    """The i.i.d. acceptance a at which (1 - a^(k+1)) / (1 - a) reaches `tokens` (bisection); None past k + 1."""
    if tokens <= 1.0:
        return 0.0
    if tokens >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_verify(k, mid) < tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def break_even(verify_us: float, baseline_us: float, k: int, level: int) -> dict:
    """Where speculative decoding at k pays off against the baseline's TPOT, from the verify step as priced:
    the drafter's most time a verify step with every draft accepted, and the fewest tokens a verify step (and
    the i.i.d. first-position acceptance) with the drafter free."""
    max_drafter_us = baseline_us * (k + 1) - verify_us
    need_tokens = verify_us / baseline_us
    a = _acceptance_for_tokens(need_tokens, k)
    text = (f"k={k} pays off at c{level} only when the drafter costs under {max(max_drafter_us, 0) / k:,.0f} us a "
            f"pass ({max(max_drafter_us, 0):,.0f} us a verify step) with every draft accepted, and a verify step "
            f"yields over {need_tokens:.2f} tokens with the drafter free"
            + (f" (acceptance over {a:.2f} a position, i.i.d.)" if a is not None else " (more than k + 1: never)")
            + f"; the verify step alone is {verify_us:,.0f} us against the baseline's {baseline_us:,.0f} us a token")
    return {"max_drafter_us": max_drafter_us, "need_tokens": need_tokens, "need_acceptance": a, "text": text}


def ranked_fixes(run_dir: Path, params, inp: ModelInputs, levels: Optional[pd.DataFrame], captures,
                 level: int) -> list[dict]:
    """"What would move it" at `level`, ranked on what was measured: each fix priced from measured inputs (the
    step model's, status "priced"; a speculative drafter a variant ran, "measured", at its best k from the
    unprofiled variants) in order of projected TPOT; then each fix with an assumed input (speculative decoding
    at a given acceptance with the drafter free), status "break-even", not ranked: the condition under which
    it would pay off, from the measured verify step, and the measured drafter's result beside it where one ran.
    Rows: fix, status, rank (None for break-even), tpot_us, gain_pct, text."""
    calibration = baseline_tpot(levels, captures)
    base_model = inp.predict(level).period_us
    base = calibration.get(float(level), base_model)
    scale = base / base_model
    ranked, conditions = [], []
    for f in fixes_at(inp, level, params):
        tpot = f.tpot_us(f.prediction.period_us, scale)
        if f.assumed:
            k = int(f.name.split("k=")[1].split(",")[0])
            conditions.append((k, f.name, break_even(f.prediction.period_us * scale, base, k, level)))
        else:
            ranked.append({"fix": f.name, "status": "priced", "tpot_us": tpot, "gain_pct": 100 * (tpot / base - 1),
                           "text": "; ".join(f.assumptions)})
    spec = [r for r in unprofiled_k_rows(run_dir, params, inp, levels, captures)
            if r["level"] == level and r["best_projected"]]
    for r in spec:
        measured = f"; measured at k={r['k']}: {r['measured_tpot_us']:,.0f} us" if r.get("measured_tpot_us") else ""
        ranked.append({"fix": f"speculative decoding k={r['k']}, {r['drafter']} drafter (measured drafter and "
                              "acceptance)", "status": "measured", "tpot_us": r["projected_tpot_us"],
                       "gain_pct": 100 * (r["projected_tpot_us"] / base - 1), "text": r["drafter_from"] + measured})
    ranked.sort(key=lambda r: r["tpot_us"])
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    seen = set()
    out = list(ranked)
    for k, name, be in conditions:
        if k in seen:
            continue
        seen.add(k)
        holds = [r for r in spec if r["k"] == k] or spec
        said = "; ".join(f"{r['drafter']} drafter measured: {r['projected_tpot_us']:,.0f} us projected at its best "
                         f"k={r['k']} ({100 * (r['projected_tpot_us'] / base - 1):+.0f}%), and that holds here"
                         for r in holds)
        out.append({"fix": f"speculative decoding k={k} (drafter and acceptance not measured)", "status": "break-even",
                    "rank": None, "tpot_us": None, "gain_pct": None,
                    "text": be["text"] + (f". {said}" if said else "")})
    return out
