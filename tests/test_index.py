"""outputs/index.html: rows from run directories, escaping, headline numbers in the report header, no
stderr in the report; and the index in a real headless browser (sorting, filtering, nothing loaded)."""
import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from decodescope.core.io import write_parquet_atomic
from decodescope.orchestration.progress import Progress
from decodescope.schema.records import Bottleneck, Verdict, read_record, write_record
from decodescope.schema.records_manifest import RunManifest
from decodescope.report.index import (MISSING, build_index, collect_rows, compare_pages, headline,
                                      headline_html, render_index)

HOSTILE_NAME = "<script>window.__ds_pwned='name'</script>"
HOSTILE_MODEL = "<img src=x onerror=\"window.__ds_pwned='model';alert(1)\">"


def _manifest(run_id: str, params_name: str = "default", model: str = "tiny-qwen3-moe", status: str = "ok",
              created: str = "2026-01-01T00:00:00Z", hostname: str = "box") -> RunManifest:
    return RunManifest(run_id=run_id, params_name=params_name, params={"model": {"name": model}},
                       host={"hostname": hostname, "kind": "local"}, created=created, status=status,
                       phases={"01_serving": {"status": status}})


def make_run(root: Path, run_id: str, *, levels=None, bottleneck=None, gpus=None, report=True, **manifest) -> Path:
    d = root / run_id
    (d / "data").mkdir(parents=True)
    write_record(d / "manifest.json", _manifest(run_id, **manifest))
    if levels is not None:  # {concurrency: (output tok/s, tpot p50 us)}, written in the order given
        write_parquet_atomic(d / "data" / "serving_levels.parquet", pd.DataFrame(
            [{"level": c, "output_throughput_tok_s": tok, "tpot_p50_us": tpot} for c, (tok, tpot) in levels.items()]))
    if bottleneck is not None:
        write_record(d / "data" / "verdict.json", Verdict(bottleneck=Bottleneck(cls=bottleneck[0], share=bottleneck[1])))
    if gpus is not None:
        (d / "data" / "host.json").write_text(json.dumps(
            {"schema_version": 1, "has_gpu": bool(gpus), "gpus": [{"name": g} for g in gpus],
             "cpu": {"hostname": "box"}}))
    if report:
        (d / "report.html").write_text("<html><body>report</body></html>")
    return d


@pytest.fixture
def outputs(tmp_path):
    out = tmp_path / "outputs"
    make_run(out, "20260101T000000Z-alpha", params_name="alpha", created="2026-01-01T00:00:00Z",
             levels={4: (900.0, 9000.0), 1: (120.5, 4000.0), 2: (450.0, 5000.0)},
             bottleneck=("communication", 0.48), gpus=["NVIDIA H200", "NVIDIA H200"], hostname="gpu-box")
    make_run(out, "20260102T000000Z-beta", params_name="beta", created="2026-01-02T00:00:00Z", status="failed",
             report=False)
    (out / "no-manifest-here" / "data").mkdir(parents=True)   # not a run: skipped
    (out / "compare-alpha-beta.html").write_text("<html></html>")
    (out / "notes.html").write_text("<html></html>")
    return out


def test_rows_from_run_dirs_with_headline_numbers(outputs):
    rows = collect_rows(outputs)
    assert list(rows["run_id"]) == ["20260102T000000Z-beta", "20260101T000000Z-alpha"]  # newest first
    alpha = rows.set_index("run_id").loc["20260101T000000Z-alpha"]
    assert alpha["params_name"] == "alpha" and alpha["model"] == "tiny-qwen3-moe" and alpha["status"] == "ok"
    assert alpha["host"] == "gpu-box · 2x NVIDIA H200"
    assert alpha["peak_output_tok_s"] == 900.0
    assert alpha["tpot_level"] == 1 and alpha["tpot_p50_us"] == 4000.0   # the lowest level, not the first row
    assert alpha["bottleneck"] == "communication" and alpha["bottleneck_share"] == pytest.approx(0.48)
    assert alpha["report"] == "20260101T000000Z-alpha/report.html"
    beta = rows.set_index("run_id").loc["20260102T000000Z-beta"]
    assert beta["status"] == "failed" and pd.isna(beta["report"]) and beta["host"] == "box"
    assert pd.isna(beta["peak_output_tok_s"]) and pd.isna(beta["tpot_p50_us"]) and pd.isna(beta["bottleneck"])
    assert compare_pages(outputs) == ["compare-alpha-beta.html"]


def test_run_dir_without_manifest_is_skipped_and_an_invalid_one_read_as_json(outputs):
    odd = outputs / "20251231T000000Z-old"
    odd.mkdir()
    (odd / "manifest.json").write_text(json.dumps({"schema_version": 0, "run_id": "old-one", "status": "ok",
                                                   "params": {"model": {"name": "m"}}}))
    garbage = outputs / "20251230T000000Z-garbage"
    garbage.mkdir()
    (garbage / "manifest.json").write_bytes(b"\xff\xfe not json")
    rows = collect_rows(outputs).set_index("dir")
    assert "no-manifest-here" not in rows.index
    assert rows.loc["20251231T000000Z-old", "run_id"] == "old-one"      # another schema version: its view (schema.views)
    assert rows.loc["20251231T000000Z-old", "model"] == "m"
    assert rows.loc["20251230T000000Z-garbage", "status"] == "unreadable manifest"


def test_rendered_index_links_relatively_and_shows_missing_numbers_as_a_dash(outputs):
    html = build_index(outputs).read_text()
    assert (outputs / "index.html").is_file() and not list(outputs.glob(".index.html.*"))
    assert 'href="20260101T000000Z-alpha/report.html"' in html
    assert 'href="compare-alpha-beta.html"' in html and "notes.html" not in html
    assert "900.0" in html and "4.00" in html and "communication 48%" in html
    assert f">{MISSING}<" in html
    assert "http://" not in html and "https://" not in html and " src=" not in html   # nothing to load


def test_hostile_names_are_escaped_in_the_index(tmp_path):
    out = tmp_path / "outputs"
    make_run(out, "20260101T000000Z-x", params_name=HOSTILE_NAME, model=HOSTILE_MODEL, hostname="<b>h</b>")
    html = render_index(collect_rows(out), ["compare-<i>.html"])
    assert "<script>window.__ds_pwned" not in html and "<img src=x" not in html and "<b>h</b>" not in html
    assert "&lt;script&gt;window.__ds_pwned=&#x27;name&#x27;&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=&quot;" in html
    assert "compare-&lt;i&gt;.html" in html
    assert html.count("<script") == 1   # the page's own


def test_headline_without_files_is_missing_everywhere(tmp_path):
    h = headline(tmp_path)
    assert (h.peak_output_tok_s, h.tpot_p50_us, h.tpot_level, h.bottleneck) == (None, None, None, None)
    assert h.peak_text() == h.tpot_text() == h.bottleneck_text() == MISSING
    assert headline_html(tmp_path).count(MISSING) == 3
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "serving_levels.parquet").write_bytes(b"cut short")
    (tmp_path / "data" / "verdict.json").write_text("{not json")
    assert headline(tmp_path).peak_output_tok_s is None and headline(tmp_path).bottleneck is None


def test_cli_index_writes_the_page(outputs, capsys):
    from decodescope.cli.main import main

    assert main(["index", str(outputs)]) == 0
    assert capsys.readouterr().out.strip() == str(outputs / "index.html")
    assert main(["index", str(outputs / "nowhere")]) == 2


def test_an_index_failure_only_warns(tmp_path, monkeypatch, caplog):
    from decodescope.orchestration import runner
    import decodescope.report.index as index

    def fail(output_dir):
        raise PermissionError(13, "Permission denied", str(output_dir / "index.html"))
    monkeypatch.setattr(index, "build_index", fail)
    runner._rebuild_index(tmp_path, Progress(1))   # returns: the run is not failed
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "could not rebuild" in warned[0] and "Permission denied" in warned[0]


# ---- the report ------------------------------------------------------------------------------------
def _executed_notebook(path: Path) -> None:
    cell = new_code_cell("requests, levels = sweep_for_phase(ctx)")
    cell.outputs = [
        new_output("stream", name="stderr", text="IProgress not found. Please update jupyter and ipywidgets.\n"),
        new_output("stream", name="stderr", text="serving sweep: 100%|##########| 3/3\n"),
        new_output("display_data", data={"text/markdown": "**Note:** the prompts fell back"}),
        new_output("stream", name="stdout", text="kept on stdout\n"),
    ]
    nb = new_notebook(cells=[new_markdown_cell("# Serving"), cell])
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_report_drops_stderr_streams_and_shows_headline_numbers(outputs):
    from decodescope.report.html import combined_notebook

    run_dir = outputs / "20260101T000000Z-alpha"
    _executed_notebook(run_dir / "notebooks" / "01_serving.ipynb")
    nb = combined_notebook(run_dir, read_record(run_dir / "manifest.json", RunManifest))
    outputs_shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert [o.get("name") for o in outputs_shown if o.output_type == "stream"] == ["stdout"]
    assert any(o.output_type == "display_data" for o in outputs_shown)
    on_disk = nbformat.read(run_dir / "notebooks" / "01_serving.ipynb", as_version=4)
    assert sum(o.get("name") == "stderr" for o in on_disk.cells[1].outputs) == 2   # the executed notebook keeps them
    header = nb.cells[0].source
    assert "900.0 tok/s" in header and "concurrency 1: 4.00 ms" in header and "communication" in header
    assert "48%" in header
    empty = combined_notebook(outputs / "20260102T000000Z-beta",
                              read_record(outputs / "20260102T000000Z-beta" / "manifest.json", RunManifest))
    assert empty.cells[0].source.count(MISSING) == 3


# ---- a real browser --------------------------------------------------------------------------------
@pytest.mark.integration
def test_index_in_a_browser_sorts_filters_and_loads_nothing(outputs):
    from playwright.sync_api import sync_playwright

    from tests.browser import CHROMIUM, FLAGS, inspect_report

    make_run(outputs, "20260103T000000Z-gamma", params_name=HOSTILE_NAME, model=HOSTILE_MODEL,
             created="2026-01-03T00:00:00Z", levels={1: (300.0, 3000.0)}, bottleneck=("gemm", 0.6))
    page_path = build_index(outputs)
    seen = inspect_report(page_path)
    assert seen["network_requests"] == [] and seen["dialogs"] == [] and seen["pwned"] is None
    assert seen["console_errors"] == [] and seen["page_errors"] == []
    for run in ("20260101T000000Z-alpha", "20260102T000000Z-beta", "20260103T000000Z-gamma"):
        assert run in seen["text"]
    assert HOSTILE_MODEL in seen["text"] and HOSTILE_NAME in seen["text"]   # shown as text
    assert "3 of 3 runs shown" in seen["text"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_context(offline=True).new_page()
        page.goto(page_path.resolve().as_uri(), wait_until="load")

        def visible_runs():
            return page.evaluate("""() => Array.from(document.querySelectorAll('#ds-runs tbody tr'))
                .filter(r => !r.hidden && r.offsetParent !== null).map(r => r.cells[0].textContent.trim())""")
        assert visible_runs() == ["20260103T000000Z-gamma", "20260102T000000Z-beta", "20260101T000000Z-alpha"]
        page.fill("#ds-filter", "alpha")
        assert visible_runs() == ["20260101T000000Z-alpha"]
        assert page.inner_text("#ds-count") == "1 of 3 runs shown"
        page.fill("#ds-filter", "")
        assert len(visible_runs()) == 3
        header = page.locator("#ds-runs th", has_text="peak output tok/s")
        header.click()   # ascending; the run with no number last
        assert visible_runs() == ["20260103T000000Z-gamma", "20260101T000000Z-alpha", "20260102T000000Z-beta"]
        header.click()   # descending; still last
        assert visible_runs() == ["20260101T000000Z-alpha", "20260103T000000Z-gamma", "20260102T000000Z-beta"]
        page.locator("#ds-runs th", has_text="run").first.click()
        assert visible_runs() == ["20260101T000000Z-alpha", "20260102T000000Z-beta", "20260103T000000Z-gamma"]
        href = page.get_attribute("#ds-runs a[href$='report.html']", "href")
        assert href == "20260101T000000Z-alpha/report.html"
        browser.close()
