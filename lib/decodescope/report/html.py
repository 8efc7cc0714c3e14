"""report.html from the executed notebooks: code hidden, one header with the run's phases and their
status, failed phases shown with their error, plotly.js embedded once, nothing loaded from a network."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import nbformat
from nbconvert import HTMLExporter
from plotly.offline import get_plotlyjs

from decodescope.core.io import write_text_atomic
from decodescope.schema.records import read_record
from decodescope.schema.records_manifest import RunManifest
from decodescope.schema.rundata import MANIFEST
from decodescope.schema.views import key_path
from decodescope.core.phases import PHASE_TITLES, PHASES
from decodescope.show.escape import html_text
from decodescope.report.index import headline_html
from decodescope.report.status import status_colour

_EXTERNAL = re.compile(r"<script[^>]*\ssrc=\"https?://[^\"]*\"[^>]*>\s*</script>|<link[^>]*\shref=\"https?://[^\"]*\"[^>]*>",
                       re.I)


def _status_badge(status: str) -> str:
    colour = status_colour(status)
    return (f'<span class="ds-status ds-status-{html_text(status)}" style="background:{colour};color:#fff;'
            f'padding:1px 8px;border-radius:8px;font-size:90%">{html_text(status)}</span>')


def header_html(manifest: RunManifest, run_dir: Optional[Path] = None) -> str:
    """The report's header: run, params, model, status, the headline numbers (read from run_dir's data
    files, as the output folder's index reads them; '–' where a file is missing) and the phases."""
    rows = []
    for phase, info in manifest.phases.items():
        err = info.error or ""
        dur = info.duration_s
        rows.append(
            f"<tr><td><a href='#phase-{html_text(phase)}'>{html_text(phase)}</a></td><td>{html_text(PHASE_TITLES.get(phase, phase))}</td>"
            f"<td>{_status_badge(info.status)}</td>"
            f"<td>{'' if dur is None else f'{dur:.1f} s'}</td>"
            f"<td><code>{html_text(err.splitlines()[0][:300]) if err else ''}</code></td></tr>")
    server = manifest.server
    server_line = ""
    if server is not None and server.model_fields_set:
        start = server.start_s
        server_line = (f"<p>Server: {html_text(server.status or '')} "
                       f"{html_text(server.base_url or '')}"
                       f"{'' if start is None else f', healthy after {start:.1f} s'}</p>")
    return f"""
<div id="ds-header" class="ds-header">
<h1>decodescope report</h1>
<p><b>Run</b> <code>{html_text(manifest.run_id)}</code> &middot;
<b>params</b> <code>{html_text(manifest.params_name)}</code> &middot;
<b>model</b> <code>{html_text(str(key_path(manifest.params, 'model', 'name') or ''))}</code> &middot;
<b>created</b> {html_text(manifest.created)} &middot;
<b>commit</b> <code>{html_text(str(manifest.git_commit))}</code> &middot;
<b>run status</b> {_status_badge(manifest.status)}</p>
{headline_html(run_dir) if run_dir is not None else ''}
{server_line}
<table class="ds-phases"><thead><tr><th>phase</th><th>what</th><th>status</th><th>time</th><th>error</th></tr></thead>
<tbody>{''.join(rows)}</tbody></table>
<p style="font-size:90%">Every table and figure below names the data file it came from, inside this run directory.
The params as run are in <code>params.yaml</code>; the executed notebooks in <code>notebooks/</code>.</p>
</div>"""


def without_stderr(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of a code cell without its stderr stream outputs (warnings, progress bars: they go to the
    kernel's log, and what a reader needs is a note in words); other cells as they are."""
    if cell.get("cell_type") != "code" or not cell.get("outputs"):
        return cell
    out = nbformat.from_dict(dict(cell))
    out.outputs = [o for o in cell.outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    return out


def _failed_box(error: str) -> str:
    return (f"<div class='ds-failed' style='border-left:4px solid #cf222e;padding:4px 12px;background:#fff5f5'>"
            f"<b>This phase failed.</b><pre>{html_text(error or 'no error text')}</pre></div>")


def _executed_cells(nb_path: Path) -> list:
    """An executed notebook's cells for the report: without the parameters cells and stderr."""
    try:
        nb = nbformat.read(nb_path, as_version=4)
    except (OSError, ValueError) as e:  # e.g. cut short by a full disk
        return [nbformat.v4.new_markdown_cell(f"*The executed notebook could not be read ({html_text(e)}).*")]
    return [without_stderr(c) for c in nb.cells
            if not {"parameters", "injected-parameters"} & set(c.metadata.get("tags", []))]


def combined_notebook(run_dir: Path, manifest: RunManifest) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_markdown_cell(header_html(manifest, run_dir))]
    # the verdict is the report's front page: right after the header
    ordered = [p for p in PHASES if p in manifest.phases]
    ordered = sorted(ordered, key=lambda p: p != "05_verdict")
    for phase in ordered:
        info = manifest.phases[phase]
        status = info.status
        cells.append(nbformat.v4.new_markdown_cell(
            f"<h2 id='phase-{html_text(phase)}'>{html_text(phase)} &middot; {html_text(PHASE_TITLES.get(phase, phase))} "
            f"{_status_badge(status)}</h2>"))
        if status == "failed":
            cells.append(nbformat.v4.new_markdown_cell(_failed_box(info.error or "")))
        nb_path = run_dir / "notebooks" / f"{phase}.ipynb"
        if nb_path.is_file() and status in ("ok", "failed"):
            cells += _executed_cells(nb_path)
        elif status in ("pending", "skipped"):
            cells.append(nbformat.v4.new_markdown_cell(f"*Not run ({status}).*"))
    for name, entry in manifest.variants.items():
        status = entry.status
        cells.append(nbformat.v4.new_markdown_cell(
            f"<h2 id='variant-{html_text(name)}'>variant {html_text(name)} {_status_badge(status)}</h2>"))
        if status == "failed":
            cells.append(nbformat.v4.new_markdown_cell(_failed_box(entry.error or "")))
        for nb_path in sorted((run_dir / "variants" / name / "notebooks").glob("*.ipynb")):
            cells.append(nbformat.v4.new_markdown_cell(f"<h3>{html_text(name)} &middot; {html_text(nb_path.stem)}</h3>"))
            cells += _executed_cells(nb_path)
    nb = nbformat.v4.new_notebook(cells=unique_cell_ids(cells))
    nb.metadata["title"] = f"decodescope {manifest.run_id}"
    return nb


def unique_cell_ids(cells: list) -> list:
    """The cells with one id each: the baseline's and each variant's executed notebook are copies of one
    notebook, so their cells share ids, and nbformat warned once per repeat (DuplicateCellId, 45 lines after
    05 in a campaign's log). A repeat becomes `<id>-<n>`, in order, so a page rebuilt is the same page."""
    seen: set[str] = set()
    for cell in cells:
        base = cell.get("id") or "cell"
        new, n = base, 1
        while new in seen:
            n += 1
            new = f"{base}-{n}"
        cell["id"] = new
        seen.add(new)
    return cells


def plotly_js() -> str:
    return get_plotlyjs()


def notebook_html(nb: nbformat.NotebookNode) -> str:
    """A notebook as one self-contained page (the report's shell: code hidden, nothing from a network,
    plotly.js inlined once); the compare pages use it too."""
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    body = _EXTERNAL.sub("", body)  # require.js / MathJax from CDNs: the report must work offline
    # Inline the library once, in <head>, so it is defined before any figure's script runs.
    script = "<script type=\"text/javascript\">" + plotly_js() + "</script>"
    return body.replace("</head>", script + "\n</head>", 1) if "</head>" in body else script + body


def build_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    manifest = read_record(run_dir / MANIFEST, RunManifest)
    out = run_dir / "report.html"
    write_text_atomic(out, notebook_html(combined_notebook(run_dir, manifest)))
    return out

