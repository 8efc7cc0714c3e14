"""The runner records each phase, goes on after a failure, resumes, and builds an offline report."""
import json
import re

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from decodescope.orchestration import runner
from decodescope.orchestration.runmanifest import RunError
from tests.browser import inspect_report


def _notebook(path, body):
    params = new_code_cell('params_path = ""\nrun_dir = ""')
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[params, new_code_cell(body)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


FIGURE = """
import plotly.graph_objects as go
from decodescope.show.display import show
from decodescope.orchestration.notebook import open_phase
ctx = open_phase(params_path, run_dir)
(ctx.data_dir / 'verdict.json').write_text('{}')
show(go.Figure(go.Bar(x=[1, 2, 3], y=[3, 1, 2])))
show(go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 4, 9])))
"""


@pytest.fixture
def phase_notebooks(tmp_path):
    d = tmp_path / "notebooks"
    d.mkdir()
    _notebook(d / "00_host.ipynb", "raise ValueError('host inventory exploded on purpose')")
    _notebook(d / "05_verdict.ipynb", FIGURE)
    return d


@pytest.fixture
def params_file(repo, tmp_path):
    text = (repo / "params/default.yaml").read_text()
    text = text.replace("output_dir: outputs", f"output_dir: {tmp_path / 'out'}")
    text = text.replace("config: models/", f"config: {repo / 'params/models'}/")
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_failed_phase_is_recorded_and_the_run_goes_on(params_file, phase_notebooks):
    run_dir, ok = runner.run(params_file, notebook_dir=phase_notebooks)
    assert not ok
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["phases"]["00_host"]["status"] == "failed"
    assert "exploded on purpose" in manifest["phases"]["00_host"]["error"]
    assert manifest["phases"]["05_verdict"]["status"] == "ok"
    assert (run_dir / "data/verdict.json").is_file()
    assert (run_dir / "notebooks/05_verdict.ipynb").is_file()
    assert manifest["status"] == "failed"
    for k in ("git_commit", "versions", "host", "params"):
        assert k in manifest
    index = (run_dir.parent / "index.html").read_text()   # rebuilt after the run, this run in it
    assert f'href="{run_dir.name}/report.html"' in index


def test_resume_skips_phases_already_ok(params_file, phase_notebooks):
    run_dir, _ = runner.run(params_file, notebook_dir=phase_notebooks)
    first_end = json.loads((run_dir / "manifest.json").read_text())["phases"]["05_verdict"]["end"]
    _notebook(phase_notebooks / "00_host.ipynb", "print('fixed')")
    run_dir2, ok = runner.run(params_file, notebook_dir=phase_notebooks, resume=run_dir)
    assert run_dir2 == run_dir and ok
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["phases"]["00_host"]["status"] == "ok"
    assert manifest["phases"]["05_verdict"]["end"] == first_end  # not re-run


def test_resume_with_changed_params_keeps_the_earlier_ones_and_records_the_change(params_file, phase_notebooks):
    """What the phases after a --resume ran with is on record: a resumed H200 run once showed the first
    run's 32 requests a level in its params.yaml while its 01 had run the params file's 128."""
    run_dir, _ = runner.run(params_file, notebook_dir=phase_notebooks)
    before = (run_dir / "params.yaml").read_text()
    _notebook(phase_notebooks / "00_host.ipynb", "print('fixed')")
    runner.run(params_file, notebook_dir=phase_notebooks, resume=run_dir)      # the same params: nothing kept
    assert not list(run_dir.glob("params.before-resume-*.yaml"))
    assert "params_changes" not in json.loads((run_dir / "manifest.json").read_text())
    text = params_file.read_text()
    assert "requests_per_level: 24" in text
    params_file.write_text(text.replace("requests_per_level: 24", "requests_per_level: 48"))
    runner.run(params_file, notebook_dir=phase_notebooks, resume=run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (change,) = manifest["params_changes"]
    assert change["changed"] == ["workload.requests_per_level: 24 -> 48"]
    assert change["resumed"] == manifest["resumed"][-1] and len(manifest["resumed"]) == 2
    assert (run_dir / change["before"]).read_text() == before
    assert "requests_per_level: 48" in (run_dir / "params.yaml").read_text()
    assert manifest["params"]["workload"]["requests_per_level"] == 48


@pytest.mark.integration  # headless Chromium: make test, not test-fast
def test_report_is_offline_with_every_figure_drawn_and_failures_shown(params_file, phase_notebooks):
    run_dir, _ = runner.run(params_file, notebook_dir=phase_notebooks)
    report = run_dir / "report.html"
    html = report.read_text()
    assert html.count("Plotly.newPlot") == 2
    # plotly.js inlined once, no external script or stylesheet
    assert len(re.findall(r"plotly\.js v\d", html)) == 1
    assert not re.search(r"<script[^>]+src=\"https?://", html)
    # code cells are hidden
    assert "raise ValueError" not in html and "import plotly.graph_objects" not in html
    seen = inspect_report(report)
    assert seen["figures"] == [pytest.approx(seen["figures"][0])] * 2 and all(n >= 1 for n in seen["figures"])
    assert seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["network_requests"] == []
    assert "failed" in seen["statuses"] and "ok" in seen["statuses"]
    assert "exploded on purpose" in seen["text"]
    assert run_dir.name in seen["text"]


def test_unknown_phase_is_rejected_before_anything_runs(params_file, phase_notebooks):
    with pytest.raises(RunError, match="07_magic"):
        runner.run(params_file, phases=["07_magic"], notebook_dir=phase_notebooks)


def test_run_dir_layout_is_defined_once_and_names_never_collide(tmp_path, params_file):
    from datetime import datetime, timezone

    from decodescope.core import rundir
    from decodescope.orchestration.notebook import open_phase
    from decodescope.schema.params import load_params

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    first = rundir.make_run_dir(tmp_path / "runs", "demo", now)
    second = rundir.make_run_dir(tmp_path / "runs", "demo", now)
    assert (first.name, second.name) == ("20260102T030405Z-demo", "20260102T030405Z-demo-2")
    for d in (first, second):
        assert sorted(p.name for p in d.iterdir()) == sorted(rundir.SUBDIRS)
    # the runner's run directories and a notebook opened alone get the same layout
    made = runner.new_run_dir(load_params(params_file))
    assert sorted(p.name for p in made.iterdir()) == sorted(rundir.SUBDIRS)
    bare = tmp_path / "bare"
    ctx = open_phase(str(params_file), str(bare))
    assert sorted(p.name for p in bare.iterdir()) == sorted(rundir.SUBDIRS) and ctx.data_dir == bare.resolve() / "data"


def test_the_micro_benchmarks_run_before_the_server_phases_so_one_server_serves_both():
    from decodescope.core.phases import PHASES, execution_order

    assert execution_order(list(PHASES)) == ["00_host", "02_gemm", "03_collectives", "01_serving", "04_profile",
                                             "05_verdict"]
    # what comes before the first server phase keeps its place; a phase after it that is not a
    # micro-benchmark (the verdict) stays after it; a selection without a server phase is as listed
    assert execution_order(["01_serving", "03_collectives", "05_verdict"]) == ["03_collectives", "01_serving",
                                                                              "05_verdict"]
    assert execution_order(["00_host", "01_serving", "04_profile"]) == ["00_host", "01_serving", "04_profile"]
    assert execution_order(["02_gemm", "05_verdict"]) == ["02_gemm", "05_verdict"]


def test_a_report_of_a_baseline_and_its_variants_draws_with_no_duplicate_cell_id_warning():
    """A variant's executed notebooks are copies of the baseline's, so their cells share ids; the combined
    page renames each repeat (`<id>-2`, ...) instead of nbformat warning once per cell (45 lines in a log)."""
    import copy
    import warnings

    from pathlib import Path

    from decodescope.report.html import notebook_html, unique_cell_ids

    verdict = nbformat.read(str(Path(__file__).resolve().parents[1] / "notebooks/05_verdict.ipynb"), as_version=4)
    cells = [copy.deepcopy(c) for _ in range(3) for c in verdict.cells]   # the baseline and two variants
    ids = [c["id"] for c in unique_cell_ids(cells)]
    assert len(set(ids)) == len(ids) and ids[:len(verdict.cells)] == [c["id"] for c in verdict.cells]
    assert ids[len(verdict.cells)] == verdict.cells[0]["id"] + "-2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notebook_html(nbformat.v4.new_notebook(cells=cells))
    assert not [w for w in caught if "cell id" in str(w.message)], [str(w.message) for w in caught][:3]


def test_the_run_keeps_the_model_configs_its_params_name_so_its_own_params_load(repo, tmp_path, phase_notebooks):
    """A run of params naming models/ relative to themselves (the model and an '@config:' draft of a variant)
    copies them beside its params.yaml: without them load_params(run/params.yaml) failed, naming each file."""
    import shutil

    from decodescope.schema.params import load_params

    folder = tmp_path / "p"
    shutil.copytree(repo / "params/models", folder / "models")
    text = (repo / "params/experiments-spec-k.yaml").read_text()
    (folder / "p.yaml").write_text(text.replace("output_dir: outputs", f"output_dir: {tmp_path / 'out'}"))
    run_dir, ok = runner.run(folder / "p.yaml", phases=["00_host"], notebook_dir=phase_notebooks)
    assert not ok   # 00 fails on purpose: the configs are copied before any phase
    assert sorted(p.name for p in (run_dir / "models").iterdir()) == ["tiny-qwen3-moe-draft1l.json",
                                                                       "tiny-qwen3-moe.json"]
    params = load_params(run_dir / "params.yaml")
    assert params.resolve("models/tiny-qwen3-moe-draft1l.json").read_text() == (
        folder / "models/tiny-qwen3-moe-draft1l.json").read_text()
