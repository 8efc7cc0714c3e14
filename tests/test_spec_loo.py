"""Speculative decoding priced without the variant's own measurements (issue 52), on the H100 run of
2026-12-06 (tests/fixtures/runs/vllm_gpu_h100_spec_loo: `params/h200-qwen3moe-spec.yaml` through
benchmarks/device/h200_campaign.sh, vLLM 0.26.0, the 16-layer Qwen3-30B-A3B shape, dummy weights, TP=1; seven
unprofiled variants and one profiled repeat of the greedy k=3; traces, notebooks, kernels and the report left
out). Each variant's TPOT is projected from the baseline's step model and the other variants (speccurve.loo_rows).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

RUN = Path(__file__).resolve().parent / "fixtures/runs/vllm_gpu_h100_spec_loo"

# The rows over 10%, each understood or not as docs/results.md says:
# - c1, self-draft k=1 (greedy +16%, sampling +15%) and k=5 greedy (+21%): at c1 the step is not linear in k
#   (6.08, 12.26, 15.52 ms at k = 1, 3, 5: 3.1 ms a pass from 1 to 3 and 1.6 ms from 3 to 5, the verify's growth
#   included), so a line through two k misses the third; at c8 and c32 it holds within 7.4%. Why k=5's passes cost
#   less at c1 is not known.
# - c1 and c8, the two-layer draft (+11%, +28%) and n-gram (+16%, +30%): L, the per-step part, is the self
#   drafter's fit; at c8 their steps leave 0.4-1.6 ms past the verify where the self drafter's L is ~2.6 ms, and at
#   c1 the self fit's L carries the nonlinearity above. At c32 both are within 7.4%.
KNOWN_MISSES = {("spec-self-k1-greedy", 1), ("spec-self-k5-greedy", 1), ("spec-self-k1", 1),
                ("spec-draft2l-k3-greedy", 1), ("spec-draft2l-k3-greedy", 8), ("spec-ngram-k3-greedy", 1),
                ("spec-ngram-k3-greedy", 8)}


def _inputs(run: Path):
    from decodescope.schema.params import load_params
    from decodescope.schema.rundata import RunDir
    from decodescope.verdict import fixes

    params = load_params(run / "params.yaml")
    captures = fixes.profile_captures(run)
    inp = fixes.model_inputs(run, params, fixes.profile_summaries(run, params), captures)
    return params, inp, RunDir(run).serving_levels(), captures


@pytest.fixture(scope="module")
def loo():
    from decodescope.verdict.speccurve import loo_rows

    params, inp, levels, captures = _inputs(RUN)
    return loo_rows(RUN, params, inp, levels, captures)


def test_every_variant_at_every_level_is_projected_and_held_to_10_percent_but_the_known_misses(loo):
    assert len(loo) == 23            # 7 variants x 3 levels + the profiled repeat at c1 and c8
    for r in loo:
        assert "projected_tpot_us" in r, r
        if (r["variant"], r["level"]) in KNOWN_MISSES:
            assert abs(r["error_pct"]) > 10.0, r     # fails once the miss is understood and fixed: update the list
        else:
            assert abs(r["error_pct"]) <= 10.0, r
    assert sum(abs(r["error_pct"]) <= 10.0 for r in loo) == 16


def test_the_greedy_self_draft_accepts_every_draft_and_sampling_almost_none(loo):
    by = {(r["variant"], r["level"]): r for r in loo}
    for k in (1, 3, 5):
        assert by[(f"spec-self-k{k}-greedy", 8)]["projected_tokens"] == pytest.approx(k + 1)
    assert by[("spec-self-k3", 8)]["projected_tokens"] < 1.01
    # the tokens of a sampling variant come from the other sampling variant, not its own metrics
    assert "acceptance per position of spec-self-k1" in by[("spec-self-k3", 8)]["how"]


def test_a_variants_own_measurements_never_reach_its_projection(tmp_path, loo):
    """Its TPOT doubled in a copy of the run: its own projection stays, the others' move."""
    from decodescope.verdict.speccurve import loo_rows

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    path = run / "variants/spec-self-k3-greedy/data/serving_levels.parquet"
    lev = pd.read_parquet(path)
    for col in ("tpot_p50_us", "tpot_mean_us", "server_tpot_mean_us", "server_itl_mean_us"):
        lev[col] = lev[col] * 2
    lev.to_parquet(path)
    params, inp, levels, captures = _inputs(run)
    after = {(r["variant"], r["level"]): r for r in loo_rows(run, params, inp, levels, captures)}
    before = {(r["variant"], r["level"]): r for r in loo}
    for level in (1, 8, 32):
        key = ("spec-self-k3-greedy", level)
        assert after[key]["projected_tpot_us"] == pytest.approx(before[key]["projected_tpot_us"])
        assert after[key]["error_pct"] < -40
        assert after[("spec-self-k1-greedy", level)]["projected_tpot_us"] != pytest.approx(
            before[("spec-self-k1-greedy", level)]["projected_tpot_us"])
    # the profiled repeat of the same drafter, k and sampling is its own measurement too: left out of its fit
    assert "spec-self-k3-greedy-prof" not in before[("spec-self-k3-greedy", 8)]["how"]


def test_the_k_figure_has_every_drafter_greedy_included_with_the_measured_variants_as_markers():
    from decodescope.verdict.speccurve import unprofiled_k_rows

    params, inp, levels, captures = _inputs(RUN)
    rows = unprofiled_k_rows(RUN, params, inp, levels, captures)
    drafters = {r["drafter"] for r in rows}
    assert {"self", "self (greedy)", "draft model (greedy)", "ngram (greedy)"} <= drafters
    marked = {(r["drafter"], r["k"]) for r in rows if r["measured_tpot_us"] is not None}
    assert {("self (greedy)", 1), ("self (greedy)", 3), ("self (greedy)", 5), ("self", 1), ("self", 3)} <= marked
    best = {(r["drafter"], r["level"]): r["k"] for r in rows if r["best_projected"]}
    # best k projected against measured: greedy self k=5 at every level (measured best at c1 and c8: k=5; at
    # c32 k=3 by 1.7%), sampling self k=1
    assert all(best[("self (greedy)", lv)] == 5 for lv in (1, 8, 32))
    assert all(best[("self", lv)] == 1 for lv in (1, 8, 32))


def test_a_request_sees_its_last_verify_cut_at_its_length():
    """n = 128 output tokens at 6 a verify: 127 after the first in 22 steps, the server's step = TPOT x 5.77; the
    run's greedy k = 5 at c1: TPOT 2,688 us x 127 / 22 = 15,517 us against the server's 15,569 us a step."""
    from decodescope.verdict.speccurve import per_request_tokens

    assert per_request_tokens(6.0, 128) == pytest.approx(127 / 22)
    assert per_request_tokens(4.0, 128) == pytest.approx(127 / 32) and per_request_tokens(2.0, 128) == 127 / 64
    assert per_request_tokens(3.968, 128) == 3.968 and per_request_tokens(1.0, 128) == 1.0
    lev = pd.read_parquet(RUN / "variants/spec-self-k5-greedy/data/serving_levels.parquet").set_index("level")
    assert lev.loc[1, "tpot_p50_us"] * 127 / 22 == pytest.approx(lev.loc[1, "server_itl_mean_us"], rel=0.01)


def test_break_even_by_hand():
    """k=3, verify 2,000 us against a baseline of 1,000 us a token: with every draft accepted (4 tokens) the
    drafter may take 4 x 1,000 - 2,000 = 2,000 us (667 us a pass); with a free drafter a verify must yield 2
    tokens: (1 - a^4) / (1 - a) = 2 at a = 0.5437."""
    from decodescope.verdict.speccurve import break_even

    be = break_even(2000.0, 1000.0, 3, 1)
    assert be["max_drafter_us"] == pytest.approx(2000.0)
    assert be["need_tokens"] == pytest.approx(2.0)
    assert be["need_acceptance"] == pytest.approx(0.5437, abs=1e-3)
    assert "under 667 us a pass" in be["text"]


def test_the_ranking_ranks_only_what_was_measured_and_states_the_rest_as_break_even():
    from decodescope.verdict.speccurve import ranked_fixes

    params, inp, levels, captures = _inputs(RUN)
    rows = ranked_fixes(RUN, params, inp, levels, captures, 1)
    ranked = [r for r in rows if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert all(r["status"] in ("measured", "priced") for r in ranked)
    assert [r["tpot_us"] for r in ranked] == sorted(r["tpot_us"] for r in ranked)
    even = [r for r in rows if r["status"] == "break-even"]
    assert {r["fix"] for r in even} == {"speculative decoding k=1 (drafter and acceptance not measured)",
                                        "speculative decoding k=3 (drafter and acceptance not measured)"}
    for r in even:
        assert r["tpot_us"] is None and r["gain_pct"] is None and "pays off at c1 only when" in r["text"]
        assert "and that holds here" in r["text"]       # the measured drafter beside it, said which holds
    assert any(r["status"] == "measured" and "self (greedy)" in r["fix"] for r in ranked)


# ---- each drafter priced from its own other k (two more runs, 2026-12-06 evening) -------------------------------
# vllm_cpu_avx2_spec_k: params/experiments-spec-k.yaml on this machine kind, forced AVX2 (gloo), 3 repeats a
# level: the one-layer and self drafters at k = 1, 3, 5 at temperature 0 and the self drafter at k = 3 at the
# server's sampling, each unprofiled. vllm_gpu_h100_spec_ngram_k: params/h200-qwen3moe-spec.yaml on one H100,
# the baseline and the n-gram drafter at k = 1, 3, 5 (the lease ended before the other drafters). Both without
# traces, notebooks, kernels, per-request tables and the variants' logs.
CPU_K_RUN = RUN.parent / "vllm_cpu_avx2_spec_k"
GPU_NGRAM_RUN = RUN.parent / "vllm_gpu_h100_spec_ngram_k"


def _loo_by_row(run: Path, self_rule: bool = False) -> dict:
    """loo_rows by (variant, level); self_rule: the pricing before, where a drafter other than the self
    drafter took the self drafter's L and P (scaled by layers), never the other k of its own."""
    from decodescope.verdict import speccurve

    params, inp, levels, captures = _inputs(run)
    price = speccurve.price_spec

    def before(measures, key, drafter, *args, **kw):
        if drafter != "self":
            measures = [m for m in measures if m.key != key or m.name == kw.get("leave_out")]
        return price(measures, key, drafter, *args, **kw)
    try:
        if self_rule:
            speccurve.price_spec = before
        rows = speccurve.loo_rows(run, params, inp, levels, captures)
    finally:
        speccurve.price_spec = price
    return {(r["variant"], r["level"]): r for r in rows}


def test_on_the_cpu_engine_the_one_layer_draft_is_priced_from_its_own_other_k_within_10_percent():
    own, before = _loo_by_row(CPU_K_RUN), _loo_by_row(CPU_K_RUN, self_rule=True)
    draft = {key: r for key, r in own.items() if key[0].startswith("spec-draft1l")}
    assert len(draft) == 9
    for (name, level), r in draft.items():
        others = sorted(f"spec-draft1l-k{k}-greedy" for k in (1, 3, 5) if f"-k{k}-" not in name)
        assert f"L + k x P fitted to {', '.join(others)}" in r["how"], r["how"]
        assert abs(r["error_pct"]) <= 10.0, r
    # the self drafter's L and scaled P missed it by -15 to -23% at k = 3 and 5
    assert sum(abs(before[key]["error_pct"]) <= 10.0 for key in draft) == 4
    assert sum(abs(r["error_pct"]) <= 10.0 for r in own.values()) == 17
    # the self drafter is priced as before; its misses: k = 1 at c1 (+13%) and c4 (+51%), k = 5 and the greedy
    # k = 3 at c4 (+19%, -10.1%), the busiest level of two cores shared by client, server and two ranks
    misses = {key for key, r in own.items() if abs(r["error_pct"]) > 10.0}
    assert misses == {("spec-self-k1-greedy", 1), ("spec-self-k1-greedy", 4), ("spec-self-k5-greedy", 4),
                      ("spec-self-k3-greedy", 4)}


def test_on_the_gpu_engine_the_ngram_drafter_is_priced_from_its_own_other_k():
    """c8 within 1.1% at every k (the self drafter's L missed the first campaign's n-gram k = 3 at c8 by +30%).
    c1 and c32 miss: at c1 the steps leave 1.08, 2.36 and 2.32 ms past the verify as priced at k = 1, 3, 5,
    though prompt lookup costs about the same at any k: the verify of 2 to 6 tokens, interpolated between the
    baseline's steps of 1 and 8 tokens, is the suspect (not measured here)."""
    own = _loo_by_row(GPU_NGRAM_RUN)
    assert sorted(own) == [(f"spec-ngram-k{k}-greedy", lv) for k in (1, 3, 5) for lv in (1, 8, 32)]
    for k in (1, 3, 5):
        assert abs(own[(f"spec-ngram-k{k}-greedy", 8)]["error_pct"]) <= 1.1
        assert "L + k x P fitted to spec-ngram-k" in own[(f"spec-ngram-k{k}-greedy", 8)]["how"]
    misses = {key for key, r in own.items() if abs(r["error_pct"]) > 10.0}
    assert misses == {("spec-ngram-k1-greedy", 1), ("spec-ngram-k3-greedy", 1), ("spec-ngram-k5-greedy", 1),
                      ("spec-ngram-k1-greedy", 32), ("spec-ngram-k5-greedy", 32)}
