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
    assert spec_tpot_us(10_000, 3_000, 3, 1 + 235 / 273) == pytest.approx(19_000 / (1 + 235 / 273))


def test_the_best_k_balances_longer_verifies_and_more_passes_against_accepted_tokens():
    per_pos = [0.9, 0.8, 0.7]
    k, tpot = best_k(lambda k: 10_000 + 500 * k, 1_000, per_pos, ks=(1, 2, 3, 4, 5))
    # k=1: 11.5/1.9 = 6.05 ms; k=2: 13/2.7 = 4.81; k=3: 14.5/3.4 = 4.26; k=4: 16/(3.4 + 0.6125) = 3.99;
    # k=5: 17.5/(4.0125 + 0.5359) = 3.85
    assert tpot[1] == pytest.approx(11_500 / 1.9) and tpot[3] == pytest.approx(14_500 / 3.4)
    assert k == 5
    # a costly drafter, 10 ms a pass: k=1: 20.5/1.9 = 10.8 ms; k=2: 31/2.7 = 11.5 ms
    k_costly, _ = best_k(lambda k: 10_000 + 500 * k, 10_000, per_pos)
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


def test_the_self_draft_at_k3_is_projected_within_10_percent_at_every_level_at_both_samplings(spec_rows):
    k3 = [r for r in spec_rows if r["variant"] in ("spec-self-k3", "spec-self-k3-greedy")]
    assert sorted({r["level"] for r in k3}) == [1, 2, 4] and len(k3) == 6
    for r in k3:
        assert "self drafter" in r["projection"] and "drafter: the target itself" in r["notes"]
        assert abs(r["projection_error_pct"]) <= 10.0, r
    greedy = [r for r in k3 if r["variant"] == "spec-self-k3-greedy"]
    assert all("4.00 tokens a verify step" in r["projection"] for r in greedy)   # temperature 0: every draft kept


def test_the_best_k_projected_is_the_best_k_measured_at_every_level(spec_rows):
    by = {(r["variant"], r["level"]): r for r in spec_rows}
    for level in (1, 2, 4):
        runs = {k: by[(f"spec-self-k{k}", level)] for k in (1, 3, 5)}
        measured = min(runs, key=lambda k: runs[k]["tpot_p50_us"])
        projected = min(runs, key=lambda k: runs[k]["projected_tpot_us"])
        assert projected == measured, (level, {k: (r["tpot_p50_us"], r["projected_tpot_us"]) for k, r in runs.items()})
