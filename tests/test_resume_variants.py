"""`--resume` keeps its word (issue 52 item 5): the variants a resume names reach the phases' notebooks (which
load the params through the manifest's overrides), a variant they could not load is refused before anything
starts, and a run whose variant's phase failed is not "ok". The real case, on the vLLM CPU engine, is in
benchmarks/results/h100_vllm_qwen3-30b-a3b-16l/spec_20261206/resume_cpu.txt."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from decodescope.orchestration.runmanifest import Manifest
from decodescope.orchestration.runner import _check_variants, _resumed_overrides, phase_failed_variants
from decodescope.schema.params import ParamsError, load_params, with_overrides

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def params_file(tmp_path):
    """params/experiments-spec.yaml with two of its variants, in a folder of its own (models/ beside it)."""
    p = yaml.safe_load((REPO / "params/experiments-spec.yaml").read_text())
    p["experiments"] = [e for e in p["experiments"] if e["name"] in ("spec-self-k1", "spec-self-k3-greedy")]
    (tmp_path / "models").symlink_to(REPO / "params/models")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def test_a_variant_the_notebooks_cannot_load_is_refused_before_anything_starts_and_named(params_file):
    """The 2026-12-05 case: the runner's params held a variant (this command's --variants) that the phases'
    overrides (the first run's) did not, so both its phases failed with "no variant named"."""
    base = load_params(params_file)
    first = {"experiments": [e.model_dump() for e in base.experiments if e.name == "spec-self-k3-greedy"]}
    second = {"experiments": [e.model_dump() for e in base.experiments]}
    file_now = params_file.read_text().replace("name: spec-self-k1\n", "name: spec-self-k1-renamed\n")
    params_file.write_text(file_now)
    runner_params = with_overrides(load_params(params_file), second)
    with pytest.raises(ParamsError) as e:
        _check_variants(runner_params, {"experiments": [x for x in second["experiments"]
                                                        if x["name"] != "spec-self-k1"]}, ["01_serving"])
    assert "experiments[spec-self-k1]" in str(e.value) and "spec-self-k3-greedy]" not in str(e.value)
    # the overrides the phases will see, the first run's with this command's over them: nothing to refuse
    _check_variants(runner_params, {**first, **second}, ["01_serving"])
    # no 01 selected: no variant runs, nothing to check
    _check_variants(runner_params, {}, ["05_verdict"])


def test_a_variant_whose_phase_failed_fails_the_run_but_one_whose_server_never_started_does_not(tmp_path,
                                                                                                 params_file):
    run = tmp_path / "run"
    run.mkdir()
    m = Manifest.create(run, load_params(params_file), ["01_serving"])
    m.variant("spec-self-k1").status = "ok"
    assert phase_failed_variants(m) == []
    v = m.variant("spec-self-k3-greedy")
    v.status, v.error = "failed", "server did not start: exit 1 ... no-such-flag"
    assert phase_failed_variants(m) == []                   # recorded failed, the run goes on (documented)
    v.error = "01_serving: ParamsError: no variant named 'spec-self-k3-greedy'"
    assert phase_failed_variants(m) == ["spec-self-k3-greedy"]
    shutil.rmtree(run)


def test_a_resume_adds_its_variants_to_the_first_runs_and_keeps_their_other_overrides():
    first = {"workload.repeats": 3, "experiments": [{"name": "a", "profile": True}, {"name": "b"}]}
    now = {"experiments": [{"name": "c"}, {"name": "a", "profile": False}]}
    out = _resumed_overrides(first, now)
    assert out["workload.repeats"] == 3
    assert out["experiments"] == [{"name": "b"}, {"name": "c"}, {"name": "a", "profile": False}]
    assert _resumed_overrides({}, now) == now and _resumed_overrides(first, {}) == first
