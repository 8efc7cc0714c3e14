"""Speculative decoding's arithmetic on hand-worked numbers: acceptance per position, tokens per verify
step, the drafter's passes, the best k; and per-position acceptance read from the server's counters."""
from __future__ import annotations

import pandas as pd
import pytest

from decodescope.exec.serverlaunch import SELF_MODEL
from decodescope.serving.telemetry_read import SPEC_PER_POS, labels_json, spec_per_position
from decodescope.verdict.fixes import expected_tokens_per_verify
from decodescope.verdict.speculative import (acceptance_per_position, best_k, drafter_of, spec_tpot_us,
                                             tokens_per_verify, tokens_per_verify_at_k)

# the embedded default, the model as its own draft, k = 3, the server's sampling: 273 drafts, accepted
# 92 / 76 / 67 at positions 0 / 1 / 2 (235 of 819 draft tokens)
EMBEDDED = acceptance_per_position([92, 76, 67], 273)


def test_each_positions_acceptance_is_its_accepted_tokens_over_the_drafts():
    assert EMBEDDED == pytest.approx([92 / 273, 76 / 273, 67 / 273])
    with pytest.raises(ValueError, match="drafts must be positive"):
        acceptance_per_position([1, 2], 0)


def test_tokens_per_verify_step_add_the_positions_to_the_bonus_token_not_the_iid_formula():
    assert tokens_per_verify(EMBEDDED) == pytest.approx(1 + 235 / 273)          # 1.861
    iid = expected_tokens_per_verify(3, 235 / 819)                               # a = 0.287: 1.39
    assert iid == pytest.approx(1.393, abs=1e-3) and tokens_per_verify(EMBEDDED) - iid > 0.45


def test_past_the_measured_positions_the_tail_keeps_the_last_positions_ratio():
    r = 67 / 76
    assert tokens_per_verify_at_k(EMBEDDED, 1) == pytest.approx(1 + 92 / 273)
    assert tokens_per_verify_at_k(EMBEDDED, 5) == pytest.approx(1 + (92 + 76 + 67 + 67 * r + 67 * r * r) / 273)


def test_the_drafters_passes_are_paid_each_verify_step_and_shared_by_its_tokens():
    # verify 10 ms, 3 passes of 3 ms, 1.861 tokens a verify step: 19 ms / 1.861
    assert spec_tpot_us(10_000, 3 * 3_000, 1 + 235 / 273) == pytest.approx(19_000 / (1 + 235 / 273))


def test_the_best_k_balances_longer_verifies_and_more_passes_against_accepted_tokens():
    per_pos = [0.9, 0.8, 0.7]
    k, tpot = best_k(lambda k: 10_000 + 500 * k, lambda k: 1_000 * k, per_pos, ks=(1, 2, 3, 4, 5))
    # k=1: 11.5/1.9 = 6.05 ms; k=2: 13/2.7 = 4.81; k=3: 14.5/3.4 = 4.26; k=4: 16/(3.4 + 0.6125) = 3.99;
    # k=5: 17.5/(4.0125 + 0.5359) = 3.85
    assert tpot[1] == pytest.approx(11_500 / 1.9) and tpot[3] == pytest.approx(14_500 / 3.4)
    assert k == 5
    # a costly drafter, 10 ms a pass: k=1: 20.5/1.9 = 10.8 ms; k=2: 31/2.7 = 11.5 ms
    k_costly, _ = best_k(lambda k: 10_000 + 500 * k, lambda k: 10_000 * k, per_pos)
    assert k_costly == 1


def test_the_drafter_is_named_from_the_speculative_config():
    assert drafter_of({"method": "draft_model", "model": SELF_MODEL}, None) == "self"
    assert drafter_of({"method": "draft_model", "model": "/m/tiny/"}, "/m/tiny") == "self"
    assert drafter_of({"method": "draft_model", "model": "/m/small"}, "/m/tiny") == "draft model"
    assert drafter_of({"method": "ngram"}, None) == "ngram"


def test_acceptance_per_position_is_read_from_the_servers_counters_over_the_window():
    rows = []
    for scrape, counts in ((0, (10, 8, 5)), (1, (102, 84, 72))):
        for pos, v in enumerate(counts):
            rows.append({"scrape": scrape, "metric": SPEC_PER_POS,
                         "labels": labels_json({"engine": "0", "position": str(pos)}), "value": float(v)})
    server = pd.DataFrame(rows)
    assert spec_per_position(server, 0, 1, 273.0) == f"{92 / 273:.4f},{76 / 273:.4f},{67 / 273:.4f}"
    assert spec_per_position(server, 0, 1, 0.0) == ""                      # nothing drafted
    assert spec_per_position(server.iloc[0:0], 0, 1, 273.0) == ""          # no such counter


def test_a_variants_temperature_reaches_every_request_and_none_leaves_the_servers_sampling():
    from decodescope.serving.client import RequestSpec, request_body

    spec = RequestSpec("completions", "m", [1, 2], "a b", 8, 30.0)
    assert "temperature" not in request_body(spec)[1]
    greedy = RequestSpec("completions", "m", [1, 2], "a b", 8, 30.0, temperature=0.0)
    assert request_body(greedy)[1]["temperature"] == 0.0


def test_the_served_models_own_directory_replaces_at_model_in_a_speculative_config(tmp_path):
    from decodescope.exec.serverlaunch import launch_spec
    from decodescope.schema.params import load_params, with_experiment

    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    params = with_experiment(load_params(repo / "params/experiments-spec.yaml"), "spec-self-k3-greedy")
    argv = launch_spec(params, "/models/tiny", "/models/tiny").argv
    config = argv[argv.index("--speculative-config") + 1]
    assert '"model":"/models/tiny"' in config.replace(" ", "") and SELF_MODEL not in config
    assert params.workload.temperature == 0.0


def test_a_config_placeholder_names_a_model_directory_built_for_it_and_a_missing_one_is_refused(tmp_path):
    import shutil

    from decodescope.schema.params import placeholder_configs
    from decodescope.exec.serverlaunch import launch_spec
    from decodescope.schema.params import load_params, with_experiment
    from decodescope.schema.params_schema import ParamsError

    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    params = with_experiment(load_params(repo / "params/experiments-spec.yaml"), "spec-draft1l-k3")
    assert placeholder_configs(params.server.engine_args) == ["models/tiny-qwen3-moe-draft1l.json"]
    argv = launch_spec(params, "/models/tiny", "/models/tiny",
                       placeholders={"@config:models/tiny-qwen3-moe-draft1l.json": "/cache/draft1l"}).argv
    config = argv[argv.index("--speculative-config") + 1]
    assert '"model":"/cache/draft1l"' in config.replace(" ", "") and "@config" not in config
    # the same params file beside no such config: refused before anything starts, naming field and file
    shutil.copy(repo / "params/experiments-spec.yaml", tmp_path / "p.yaml")
    (tmp_path / "models").mkdir()
    shutil.copy(repo / "params/models/tiny-qwen3-moe.json", tmp_path / "models")
    shutil.copy(repo / "params/models/tiny-qwen3-moe-eagle3.json", tmp_path / "models")
    with pytest.raises(ParamsError, match=r"experiments\[spec-draft1l-k3\]\.server\.engine_args.*"
                                          r"tiny-qwen3-moe-draft1l\.json.*not a readable JSON HF config"):
        load_params(tmp_path / "p.yaml")


# ---- the embedded default's self-draft variants, as measured (tests/fixtures/runs/vllm_cpu_spec_selfdraft:
# `decodescope run params/experiments-spec.yaml`, 2026-12-05, its traces and notebooks left out) ----------
SPEC_RUN = __import__("pathlib").Path(__file__).resolve().parent / "fixtures/runs/vllm_cpu_spec_selfdraft"


@pytest.fixture(scope="module")
def spec_rows():
    from pathlib import Path

    from decodescope.schema.params import load_params
    from decodescope.verdict.verdict import verdict

    repo = Path(__file__).resolve().parents[1]
    rows = verdict(SPEC_RUN, load_params(repo / "params/experiments-spec.yaml")).variants
    return [r if isinstance(r, dict) else r.model_dump() for r in rows]


# the embedded default, each variant priced without its own measurements (issue 52: speccurve.loo_rows, the
# verify from the step model, L + k x P fitted to the other self-draft variants at the level). Two self-draft
# rows miss 10%: k=3 at temperature 0, c=4 (+17%), where the other three variants' fit puts L at ~1.8 ms, and
# k=1 at c=1 (-12%). The one-layer draft, its pass the self drafter's x 1/4 layers, is underpriced at every
# level (-14 to -23%): on the CPU a pass has a part that does not scale with the layers (its inputs, sampling,
# the framework's host work), which the layer ratio leaves out.
SELF = ("spec-self-k1", "spec-self-k3", "spec-self-k5", "spec-self-k3-greedy")
SELF_MISSES = {("spec-self-k3-greedy", 4), ("spec-self-k1", 1)}


def test_each_self_draft_variant_is_priced_without_its_own_measurements_within_10_percent(spec_rows):
    rows = [r for r in spec_rows if r["variant"] in SELF and r.get("level")]
    assert len(rows) == 12
    for r in rows:
        fitted = r["notes"].split("fitted to ")[1].split(")")[0].split(", ")
        assert r["variant"] not in fitted and len(fitted) == 3, r       # the other three, never its own
        if (r["variant"], r["level"]) in SELF_MISSES:
            assert abs(r["projection_error_pct"]) > 10.0, r      # a known miss: this test fails once it is fixed
        else:
            assert abs(r["projection_error_pct"]) <= 10.0, r
    greedy = [r for r in rows if r["variant"] == "spec-self-k3-greedy"]
    assert all("over 4.00 tokens" in r["notes"] for r in greedy)   # temperature 0: every draft kept


def test_the_one_layer_draft_is_underpriced_by_the_layer_ratio_on_the_cpu(spec_rows):
    rows = [r for r in spec_rows if r["variant"] == "spec-draft1l-k3" and r.get("level")]
    assert len(rows) == 3
    assert all(-25.0 < r["projection_error_pct"] < -10.0 for r in rows), rows
    assert all("x 1/4 layers" in r["notes"] for r in rows)


def test_whole_decode_steps_as_the_drafter_missed_by_more_than_the_other_variants_fit(spec_rows):
    """The earlier pricing (each draft pass a whole decode step, no rejection or inputs) on the same run: a mean
    error of 9.7% against 5.1% for the fit to the other variants (leave-one-out)."""
    from pathlib import Path

    from decodescope.schema.params import load_params
    from decodescope.schema.rundata import RunDir
    from decodescope.verdict import fixes
    from decodescope.verdict.variants import variant_rows

    params = load_params(Path(__file__).resolve().parents[1] / "params/experiments-spec.yaml")
    captures = fixes.profile_captures(SPEC_RUN)
    inp = fixes.model_inputs(SPEC_RUN, params, fixes.profile_summaries(SPEC_RUN, params), captures)
    # no profiled drafter to price by: the self drafter priced as whole decode steps
    old = variant_rows(SPEC_RUN, params, inp, RunDir(SPEC_RUN).serving_levels(), captures, drafters={})
    mean = {}
    for name, rs in (("measured", spec_rows), ("whole steps", old)):
        errs = [abs(r["projection_error_pct"]) for r in rs if r["variant"] in SELF and r.get("level")]
        mean[name] = sum(errs) / len(errs)
    assert mean["measured"] < 0.6 * mean["whole steps"], mean


def test_the_best_k_projected_is_the_best_k_measured_at_every_level(spec_rows):
    by = {(r["variant"], r["level"]): r for r in spec_rows}
    for level in (1, 2, 4):
        runs = {k: by[(f"spec-self-k{k}", level)] for k in (1, 3, 5)}
        measured = min(runs, key=lambda k: runs[k]["tpot_p50_us"])
        projected = min(runs, key=lambda k: runs[k]["projected_tpot_us"])
        assert projected == measured, (level, {k: (r["tpot_p50_us"], r["projected_tpot_us"]) for k, r in runs.items()})


def test_the_verdict_names_the_best_k_per_level_and_ranks_the_measured_drafter_among_the_fixes():
    from pathlib import Path

    from decodescope.schema.params import load_params
    from decodescope.verdict.verdict import verdict

    v = verdict(SPEC_RUN, load_params(Path(__file__).resolve().parents[1] / "params/experiments-spec.yaml"))
    self_rows = [r for r in v.spec_k if r.drafter == "self"]
    assert {(r.level, r.k) for r in self_rows} == {(lv, k) for lv in (1, 2, 4) for k in range(1, 6)}
    for lv in (1, 2, 4):
        at = [r for r in self_rows if r.level == lv]
        best = [r for r in at if r.best_projected]
        assert len(best) == 1 and best[0].projected_tpot_us == min(r.projected_tpot_us for r in at)
        measured = {r.k: r.measured_tpot_us for r in at if r.measured_tpot_us is not None}
        assert set(measured) == {1, 3, 5} and min(measured, key=lambda k: measured[k]) == best[0].k
    ranked = {p.fix: p for p in v.projections}
    mine = [f for f in ranked if "measured acceptance and drafter" in f]
    assert any("self drafter" in f for f in mine) and any("draft model drafter" in f for f in mine)
    for f in mine:   # the drafter's time is in the priced step, and the row says whose measurements it used
        assert "drafter:" in ranked[f].assumptions and "profile" in ranked[f].assumptions
    iid = [p for f, p in ranked.items() if "alpha=" in f]
    assert iid and all("drafter assumed free" in p.assumptions for p in iid)


def test_a_drafters_cost_is_its_lead_first_pass_and_later_passes_unprofiled():
    from decodescope.verdict.speculative import DrafterCost, drafter_us, nearest_drafter

    c1 = DrafterCost("v-k3", 3, 1.0, lead_us=1000, first_pass_us=1500, next_pass_us=1100, scale=0.8)
    assert c1.at_k(1) == pytest.approx(0.8 * 2500) and c1.at_k(5) == pytest.approx(0.8 * (2500 + 4 * 1100))
    one = DrafterCost("v-k1", 1, 1.0, lead_us=1000, first_pass_us=1500, next_pass_us=None, scale=1.0)
    assert one.at_k(3) == pytest.approx(1000 + 3 * 1500)    # no later pass measured: each costs the first
    c4 = DrafterCost("v-k3", 3, 4.0, lead_us=2000, first_pass_us=2500, next_pass_us=1500, scale=1.0)
    lo, hi = c1.at_k(3), c4.at_k(3)
    assert drafter_us([c4, c1], 3, 2.0)[0] == pytest.approx(lo + (hi - lo) / 3)    # linear in batch
    assert drafter_us([c1, c4], 3, 8.0)[0] == pytest.approx(hi) and drafter_us([c1, c4], 3, 0.5)[0] == pytest.approx(lo)
    sources = {"v-k1": [one], "v-k3": [c1, c4], "v-k5": []}
    assert nearest_drafter(sources, "v-k1", 5) == [one]          # a variant's own profile first
    assert nearest_drafter(sources, "v-k5", 5) == [c1, c4]       # else the profiled k nearest
    assert nearest_drafter({}, "v-k5", 5) is None


def test_the_h200_speculative_campaign_is_ready_to_run_when_a_gpu_is_lent():
    """Issue 52: draft-model, two-layer and n-gram variants on the GPU engine at k = 1, 3, 5, each unprofiled
    (01 only): each is projected from the baseline and the others (speccurve.loo_rows), so none needs its own
    profile."""
    from pathlib import Path

    from decodescope.schema.params import placeholder_configs
    from decodescope.schema.params import load_params, with_experiment

    params = load_params(Path(__file__).resolve().parents[1] / "params/h200-qwen3moe-spec.yaml")
    assert params.hardware.gpu is None and params.server.tensor_parallel == 1   # detected: an H100 or an H200
    names = {e.name: e for e in params.experiments}
    # every drafter at k = 1, 3 and 5 (greedy), so that each is priced from the other k of its own drafter
    assert {f"spec-{d}-k{k}-greedy" for d in ("self", "draft2l", "ngram") for k in (1, 3, 5)} | {
        "spec-self-k2-greedy", "spec-self-k4-greedy", "spec-self-k1", "spec-self-k3"} == set(names)
    assert not any(e.profile for e in names.values())
    assert with_experiment(params, "spec-self-k3-greedy").workload.temperature == 0.0
    assert with_experiment(params, "spec-self-k3").workload.temperature is None
    draft = with_experiment(params, "spec-draft2l-k3-greedy")
    (cfg,) = placeholder_configs(draft.server.engine_args)
    assert params.resolve(cfg).is_file() and '"num_hidden_layers": 2' in params.resolve(cfg).read_text()


def test_on_a_gpu_the_drafters_lead_counts_only_past_the_verifys_priced_step():
    """The H100 run's c8 level (self-draft, k = 3), by hand: under the profiler the host's verify took
    4,629 us and the lead 4,008 us, x 0.617 unprofiled = 5,330 us from the verify's start to the first
    draft forward. The verify of 32 tokens as priced is longer, so the lead is hidden under it."""
    from decodescope.verdict.speculative import DrafterCost, drafter_us

    gpu = DrafterCost("self-k3", 3, 8.0, lead_us=4008, first_pass_us=9497, next_pass_us=8401, scale=0.617,
                      verify_host_us=4629, apart=True)
    passes = 0.617 * (9497 + 2 * 8401)
    assert gpu.lead_on_path(7149) == 0.0 and gpu.at_k(3, 7149) == pytest.approx(passes)
    # a verify priced shorter than the host's own verify and lead: their excess lengthens the step
    assert gpu.lead_on_path(4000) == pytest.approx(0.617 * (4629 + 4008) - 4000)
    assert gpu.at_k(3) == pytest.approx(0.617 * 4008 + passes)      # no verify priced: the lead whole
    # on vLLM CPU the host is the device: the lead follows the verify whole, whatever the verify's price
    cpu = DrafterCost("self-k3", 3, 8.0, lead_us=4008, first_pass_us=9497, next_pass_us=8401, scale=0.617,
                      verify_host_us=4629, apart=False)
    assert cpu.at_k(3, 7149) == pytest.approx(0.617 * 4008 + passes)
    us, how = drafter_us([gpu], 3, 8.0, 7149)
    assert us == pytest.approx(passes) and "past the verify's device work" in how and "x 0.62" in how
    assert "past the verify" not in drafter_us([cpu], 3, 8.0, 7149)[1]


# -- the real vLLM GPU engine (0.26.0) on one H100: Qwen3-30B-A3B-shaped, 16 layers, dummy weights; the model
# as its own draft at k = 3, the server's sampling (benchmarks/results/h100_vllm_qwen3-30b-a3b-16l/spec_20261205,
# its traces, kernels and notebooks left out; its drafter read at 4b036f3 from the variant's own traces) --------
GPU_SPEC_RUN = SPEC_RUN.parent / "vllm_gpu_h100_spec_selfdraft"


@pytest.fixture(scope="module")
def gpu_spec():
    from decodescope.schema.params import load_params
    from decodescope.schema.rundata import RunDir
    from decodescope.verdict import fixes
    from decodescope.verdict.variants import variant_rows

    params = load_params(GPU_SPEC_RUN / "params.yaml")   # as the run had them (its model configs beside)
    captures = fixes.profile_captures(GPU_SPEC_RUN)
    inp = fixes.model_inputs(GPU_SPEC_RUN, params, fixes.profile_summaries(GPU_SPEC_RUN, params), captures)
    levels = RunDir(GPU_SPEC_RUN).serving_levels()
    rows = variant_rows(GPU_SPEC_RUN, params, inp, levels, captures)
    whole = variant_rows(GPU_SPEC_RUN, params, inp, levels, captures, drafters={})
    pick = lambda rs: {r["level"]: r for r in rs if r["variant"] == "spec-self-k3" and r.get("level")}  # noqa: E731
    return pick(rows), pick(whole)


def test_on_the_gpu_engine_the_measured_drafter_prices_every_level_within_10_percent(gpu_spec):
    rows, whole = gpu_spec
    assert sorted(rows) == [1, 8, 32]
    for level, r in rows.items():
        assert "1.00 tokens a verify step" in r["projection"]    # drafts of argmax, ~1/1024 accepted on dummy weights
        assert "past the verify's device work" in r["notes"], r["notes"]
        assert abs(r["projection_error_pct"]) <= 10.0, (level, r["projected_tpot_us"], r["tpot_p50_us"])
    # the drafter as k whole decode steps of the target (what the verdict did without it) missed c32 by +73%
    assert max(abs(r["projection_error_pct"]) for r in whole.values()) > 50.0
