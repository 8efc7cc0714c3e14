"""Markup planted in every string that can reach the report (params values, server log lines, trace op
names, error texts) is shown as text in a real headless browser and never runs."""
import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from decodescope.schema.params import ParamsError, load_params
from decodescope.show.display import figure_bundle, table_html
from decodescope.show.escape import markdown_text
from decodescope.report.html import build_report
from tests.browser import inspect_report

PAYLOADS = [
    "<script>window.__ds_pwned='script';alert('script')</script>",
    "<img src=x onerror=\"window.__ds_pwned='img';alert('img')\">",
    "<svg onload=\"window.__ds_pwned='svg'\">",
    "[click](javascript:window.__ds_pwned='link')",
]


def _display(data: dict):
    return nbformat.v4.new_output("display_data", data=data)


def _hostile_run(tmp_path: Path) -> Path:
    import plotly.graph_objects as go

    run_dir = tmp_path / "20260101T000000Z-hostile"
    (run_dir / "notebooks").mkdir(parents=True)
    op_names = [f"_C::shm_allreduce{p}" for p in PAYLOADS]
    table = pd.DataFrame({"name": op_names, "time_us": [1.0, 2.0, 3.0, 4.0]})
    fig = go.Figure(go.Bar(x=op_names, y=[1, 2, 3, 4], name=PAYLOADS[0]))
    fig.update_layout(title=f"ops of model {PAYLOADS[1]}", xaxis_title=PAYLOADS[2])
    cell = nbformat.v4.new_code_cell("show(...)")
    cell.outputs = [
        _display({"text/html": table_html(table, caption=f"top ops - run x (params: {PAYLOADS[0]})")}),
        _display({"text/markdown": markdown_text(f"**Headline** for model `{PAYLOADS[1]}`: {PAYLOADS[1]} "
                                                 f"{PAYLOADS[3]} {PAYLOADS[0]}")}),
        _display(figure_bundle(fig)),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), run_dir / "notebooks/04_profile.ipynb")
    log_line = f"ERROR worker: {PAYLOADS[0]} {PAYLOADS[1]}"
    manifest = {"schema_version": 1, "run_id": run_dir.name, "params_name": PAYLOADS[1], "created": "now",
                "git_commit": PAYLOADS[2],
                "status": "failed", "server": {"status": PAYLOADS[0], "base_url": PAYLOADS[1]},
                "phases": {"04_profile": {"status": "failed", "error": f"server_died: last lines:\n{log_line}"}}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


@pytest.mark.integration
def test_planted_markup_is_inert_text_in_the_report(tmp_path):
    report = build_report(_hostile_run(tmp_path))
    seen = inspect_report(report)
    assert seen["dialogs"] == [] and seen["pwned"] is None, (seen["dialogs"], seen["pwned"])
    assert seen["page_errors"] == []
    # shown as text: the payloads' own characters are visible to the reader
    assert "window.__ds_pwned='script'" in seen["text"]
    assert "onerror=" in seen["text"]
    assert len(seen["figures"]) == 1 and seen["figures"][0] >= 1
    from tests.faultload import record_fault

    record_fault("markup planted in run name, model name, params values, server log lines, trace op names",
                 "a run name must be a file name (refused otherwise); every other string is shown as text: no "
                 "script runs, no dialog opens (headless Chromium)", rc=0,
                 results_lost=f"none; {len(PAYLOADS)} payloads in tables, captions, notes, figures, header, "
                              "errors: 0 ran", processes_left=0, shm_files_left=0)


def test_markdown_notes_escape_markup_but_keep_formatting():
    out = markdown_text("**bold** <b>x</b> `a<b>` [l](javascript:alert(1))")
    assert "**bold**" in out and "&lt;b&gt;x&lt;/b&gt;" in out
    assert "`a<b>`" in out  # code spans are escaped by the markdown renderer itself
    assert "javascript:" not in out.replace("unsafe-javascript:", "")


@pytest.mark.parametrize("name", ["x<script>alert(1)</script>", "a/b", "../up", "tab\there", "", "-lead"])
def test_a_run_name_that_cannot_be_a_file_name_is_refused(write_params, name):
    p = write_params(f"run: {{name: {json.dumps(name)}}}\nmodel: {{name: m, config: models/tiny-qwen3-moe.json}}\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert "run.name" in str(e.value) and "cannot be a run name" in str(e.value)


def test_a_params_file_whose_name_cannot_be_a_run_name_needs_run_name(write_params):
    p = write_params("model: {name: m, config: models/tiny-qwen3-moe.json}\n", name="bad name!.yaml")
    with pytest.raises(ParamsError, match="run.name"):
        load_params(p)
    p.write_text("run: {name: fine}\nmodel: {name: m, config: models/tiny-qwen3-moe.json}\n")
    assert load_params(p).run_name == "fine"
