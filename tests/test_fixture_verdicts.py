"""Committed fixtures stay current: each fixture run's verdict, recomputed from its records through the
public entry (verdict.verdict with the run's own params), is the committed data/verdict.json byte for byte.
A change to the verdict's code that moves a number fails here until the fixtures are regenerated:
`python -m tests.fixture_verdicts --write` (then read the diff: it is what the change did to each run)."""
from __future__ import annotations

import pytest

from tests.fixture_verdicts import REPO, fixture_runs, recomputed


def test_every_fixture_run_with_a_verdict_is_checked():
    names = {d.name for d in fixture_runs()}
    assert {"vllm_gpu_h200_qwen3moe", "vllm_gpu_h200_kimi_int4", "vllm_cpu_spec_selfdraft"} <= names, names


@pytest.mark.parametrize("run_dir", fixture_runs(), ids=lambda d: d.name)
def test_a_fixture_runs_committed_verdict_is_what_the_code_computes_from_its_records(run_dir):
    committed = (run_dir / "data" / "verdict.json").read_bytes()
    assert recomputed(run_dir) == committed, (
        f"{run_dir.relative_to(REPO)}/data/verdict.json is stale: the code computes another verdict from this "
        "run's records. Regenerate every fixture's with `python -m tests.fixture_verdicts --write` and commit it")
