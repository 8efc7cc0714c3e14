"""Committed fixtures stay current: each fixture run's verdict, recomputed from its records through the
public entry (verdict.verdict with the run's own params), is the committed data/verdict.json: the same
keys, lengths, strings and flags, and numbers within fixture_verdicts.REL_TOL (the last bits of a sum follow
the CPU's SIMD). A change to the verdict's code that moves a number fails here until the fixtures are regenerated:
`python -m tests.fixture_verdicts --write` (then read the diff: it is what the change did to each run)."""
from __future__ import annotations

import pytest

from tests.fixture_verdicts import REL_TOL, REPO, differences, fixture_runs, recomputed, stale_paths


def test_every_fixture_run_with_a_verdict_is_checked():
    names = {d.name for d in fixture_runs()}
    assert {"vllm_gpu_h200_qwen3moe", "vllm_gpu_h200_kimi_int4", "vllm_cpu_spec_selfdraft"} <= names, names


@pytest.mark.parametrize("run_dir", fixture_runs(), ids=lambda d: d.name)
def test_a_fixture_runs_committed_verdict_is_what_the_code_computes_from_its_records(run_dir):
    parted = stale_paths(run_dir, recomputed(run_dir))
    assert not parted, (
        f"{run_dir.relative_to(REPO)}/data/verdict.json is stale: the code computes another verdict from this "
        "run's records. Regenerate every fixture's with `python -m tests.fixture_verdicts --write` and commit it. "
        f"{len(parted)} differences, the first: " + "; ".join(parted[:5]))


def test_numbers_agree_to_the_last_bits_a_cpus_simd_moves_and_nothing_else_is_loose():
    # 296.6525189349112 against ...113: one AVX2 machine's sum against an AVX-512 machine's (2026-12-07)
    assert differences({"us": 296.6525189349113}, {"us": 296.6525189349112}) == []
    assert differences({"us": 296.65}, {"us": 296.65 * (1 + 100 * REL_TOL)}) == [
        f".us: 296.65 != {296.65 * (1 + 100 * REL_TOL)}"]
    assert differences({"n": 127}, {"n": 128}) == [".n: 127 != 128"]
    assert differences({"ok": True}, {"ok": 1}) == [".ok: True != 1"]
    assert differences({"a": [1.0, 2.0]}, {"a": [1.0]}) == [".a: [1.0, 2.0] != [1.0]"]
    assert differences({"a": "x"}, {"b": "x"}) == [".a: x != <absent>", ".b: <absent> != x"]
    assert differences({"v": float("nan")}, {"v": float("nan")}) == []
