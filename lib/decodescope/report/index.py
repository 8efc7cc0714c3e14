"""outputs/index.html: every run of an output directory on one static page.

Each run shows its headline numbers and links to its report and to the compare pages.
So the folder can be published as is.

`headline(run_dir)` reads a run's headline numbers from its data files; the report header uses it too.
Those numbers are peak output tok/s, TPOT p50 at the lowest concurrency, and the bottleneck class and its share.
`collect_rows(output_dir)` makes the index's rows.
`render_index(rows, compare_pages)` makes its HTML.
The table sorts by a click on a header and filters with a text box.
It uses one small inline script and loads nothing from a network.
`build_index(output_dir)` writes the page atomically.
Every string from manifests and params goes through `report.escape.html_text`.
"""
from __future__ import annotations

import base64
import hashlib
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import quote

import pandas as pd

from decodescope.core.io import write_text_atomic
from decodescope.schema.recordbase import RecordError
from decodescope.schema.rundata import HOST, VERDICT, RunDir
from decodescope.schema.views import HostView, ManifestView, ServingHeadlineView, VerdictView, key_path, read_view
from decodescope.show.escape import html_text
from decodescope.report.status import status_colour
from decodescope.core.resources import source_checkout

INDEX_NAME = "index.html"
MISSING = "–"  # what a number that could not be read is shown as
COMPARE_GLOB = "compare*.html"
COMPARE_DIR = "compare"  # decodescope compare's default folder (report.compare.COMPARE_DIR)

INDEX_COLUMNS = ["run_id", "dir", "params_name", "model", "host", "status", "created",
                 "peak_output_tok_s", "tpot_p50_us", "tpot_level", "bottleneck", "bottleneck_share", "report"]


# ---- headline numbers ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Headline:
    """A run's headline numbers; None where the file that holds one is missing or unreadable."""

    peak_output_tok_s: Optional[float] = None
    tpot_p50_us: Optional[float] = None
    tpot_level: Optional[int] = None  # the concurrency the TPOT is at (the lowest level)
    bottleneck: Optional[str] = None
    bottleneck_share: Optional[float] = None
    bottleneck_basis: Optional[str] = None  # critical path (share of the wall step) | summed op time
    bottleneck_level: Optional[int] = None

    def share_text(self) -> str:
        """What the bottleneck's share is a share of."""
        if self.bottleneck_share is None:
            return ""
        if self.bottleneck_basis == "critical path":
            at = "" if self.bottleneck_level is None else f" at concurrency {self.bottleneck_level}"
            return f" ({100 * self.bottleneck_share:.0f}% of the wall-clock decode step on its critical path{at})"
        return f" ({100 * self.bottleneck_share:.0f}% of a decode step's op time on the median rank)"

    def peak_text(self) -> str:
        return MISSING if self.peak_output_tok_s is None else f"{self.peak_output_tok_s:,.1f}"

    def tpot_text(self) -> str:
        """TPOT in ms (the report's unit for times)."""
        return MISSING if self.tpot_p50_us is None else f"{self.tpot_p50_us / 1000:,.2f}"

    def level_text(self) -> str:
        return MISSING if self.tpot_level is None else str(int(self.tpot_level))

    def bottleneck_text(self) -> str:
        if self.bottleneck is None:
            return MISSING
        share = "" if self.bottleneck_share is None else f" {100 * self.bottleneck_share:.0f}%"
        of = " of the wall step (path)" if self.bottleneck_basis == "critical path" and share else (
            " of op time" if share else "")
        return self.bottleneck + share + of


def _number(value: Any) -> Optional[float]:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _serving_headline(run_dir: Path) -> tuple[Optional[float], Optional[float], Optional[int]]:
    try:
        levels = RunDir(run_dir).serving_levels()
    except Exception:  # cut short, not parquet: the numbers are shown as missing
        levels = None
    if levels is None:
        return None, None, None
    if "repeat" in levels.columns and "level" in levels.columns:  # repeated levels: the median per level
        levels = levels.groupby("level", as_index=False).median(numeric_only=True)
    peak = tpot = level = None
    if "output_throughput_tok_s" in levels.columns:
        peak = _number(pd.to_numeric(levels["output_throughput_tok_s"], errors="coerce").max())
    if "tpot_p50_us" in levels.columns and "level" in levels.columns and len(levels):
        lowest = levels.assign(_level=pd.to_numeric(levels["level"], errors="coerce")).dropna(subset=["_level"])
        if len(lowest):
            row = lowest.sort_values("_level").iloc[0]
            tpot, level = _number(row["tpot_p50_us"]), int(row["_level"])
    return peak, tpot, level


def _verdict_bottleneck(run_dir: Path) -> tuple[dict, Optional[ServingHeadlineView]]:
    """(the Headline's bottleneck fields, the serving headline) from data/verdict.json, a verdict of any
    version (decodescope.schema.views): what holds the critical path where 04 walked one (its category),
    else the summed op time's class."""
    try:
        v = read_view(RunDir(run_dir).file(VERDICT), VerdictView)
    except RecordError:
        v = None
    if v is None or v.bottleneck is None:
        return {}, (v.serving if v is not None else None)
    b = v.bottleneck
    name = b.category if b.basis == "critical path" and b.category else b.cls
    return {"bottleneck": name, "bottleneck_share": _number(b.share) if name is not None else None,
            "bottleneck_basis": b.basis or "summed op time", "bottleneck_level": b.level}, v.serving


def headline(run_dir: Path) -> Headline:
    """The run's headline numbers from data/serving_levels.parquet (peak output tok/s; TPOT p50 at the
    lowest concurrency) and data/verdict.json (bottleneck class and share; its serving headline when
    the sweep's table is missing). Never raises for missing or unreadable files."""
    run_dir = Path(run_dir)
    peak, tpot, level = _serving_headline(run_dir)
    bottleneck, serving = _verdict_bottleneck(run_dir)
    if serving is not None:
        if peak is None:
            peak = _number(serving.max_output_tok_s)
        if tpot is None:
            tpot = _number(serving.tpot_p50_us)
            lvl = _number(serving.lowest_level)
            level = None if tpot is None or lvl is None else int(lvl)
    return Headline(peak_output_tok_s=peak, tpot_p50_us=tpot, tpot_level=level, **bottleneck)


def headline_html(run_dir: Path) -> str:
    """The headline numbers as one line of the report header (escaped; '–' for what is missing)."""
    h = headline(run_dir)
    level = "the lowest concurrency" if h.tpot_level is None else f"concurrency {h.tpot_level}"
    share = h.share_text()
    peak = h.peak_text() + ("" if h.peak_output_tok_s is None else " tok/s")
    tpot = h.tpot_text() + ("" if h.tpot_p50_us is None else " ms")
    return (f'<p class="ds-headline"><b>peak output</b> {html_text(peak)} &middot; '
            f'<b>TPOT p50</b> at {html_text(level)}: {html_text(tpot)} &middot; '
            f'<b>bottleneck</b> {html_text(h.bottleneck or MISSING)}{html_text(share)}'
            f' <span style="font-size:85%;color:#57606a">(data/serving_levels.parquet, data/verdict.json)</span></p>')


# ---- rows ------------------------------------------------------------------------------------------
def read_manifest(run_dir: Path) -> Optional[ManifestView]:
    """manifest.json of a run of any version (decodescope.schema.views); None when the directory has
    none; an empty view when it cannot be read as a JSON object."""
    try:
        return read_view(Path(run_dir) / "manifest.json", ManifestView)
    except RecordError:
        return ManifestView()


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def host_text(run_dir: Path, manifest: ManifestView) -> str:
    """Hostname and GPUs ('2x NVIDIA H200', or 'no GPU') from the manifest and data/host.json."""
    try:
        inv = read_view(RunDir(run_dir).file(HOST), HostView) or HostView()
    except RecordError:
        inv = HostView()
    hostname = manifest.host.hostname or (inv.cpu.hostname if inv.cpu else None)
    names = Counter(g.name for g in inv.gpus)
    if names:
        devices = ", ".join(f"{n}x {name}" for name, n in names.items())
    elif inv.has_gpu is False:
        devices = "no GPU"
    else:
        devices = ""
    return " · ".join(x for x in (_text(hostname), devices) if x)


def run_dirs(output_dir: Path) -> list[Path]:
    """The run directories of an output directory: sub-directories holding a manifest.json."""
    try:
        subdirs = sorted(p for p in Path(output_dir).iterdir() if p.is_dir())
    except OSError:
        return []
    return [p for p in subdirs if (p / "manifest.json").is_file()]


def run_row(run_dir: Path) -> Optional[dict]:
    """One row of the index, or None for a directory without a manifest."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if manifest is None:
        return None
    h = headline(run_dir)
    report = run_dir / "report.html"
    return {"run_id": _text(manifest.run_id) or run_dir.name, "dir": run_dir.name,
            "params_name": _text(manifest.params_name),
            "model": _text(key_path(manifest.params, "model", "name")),
            "host": host_text(run_dir, manifest),
            "status": _text(manifest.status) or ("unreadable manifest" if manifest == ManifestView() else "unknown"),
            "created": _text(manifest.created),
            **{k: v for k, v in asdict(h).items()},
            "report": f"{run_dir.name}/report.html" if report.is_file() else None}


def collect_rows(output_dir: Path) -> pd.DataFrame:
    """Every run of output_dir (newest first by creation time), in INDEX_COLUMNS."""
    rows = [r for r in (run_row(d) for d in run_dirs(output_dir)) if r is not None]
    df = pd.DataFrame(rows, columns=INDEX_COLUMNS)
    return df.sort_values(["created", "run_id"], ascending=False, kind="stable").reset_index(drop=True)


def compare_pages(output_dir: Path) -> list[str]:
    """compare*.html files of output_dir, then the pages of its compare/ folder (where `decodescope
    compare` writes by default), as paths relative to output_dir, by name."""
    try:
        top = sorted(p.name for p in Path(output_dir).glob(COMPARE_GLOB) if p.is_file())
        sub = sorted(f"{COMPARE_DIR}/{p.name}" for p in (Path(output_dir) / COMPARE_DIR).glob("*.html")
                     if p.is_file())
    except OSError:
        return []
    return top + sub


# ---- HTML ------------------------------------------------------------------------------------------
_SCRIPT = """
(function () {
  var table = document.getElementById('ds-runs');
  var body = table.tBodies[0];
  var filter = document.getElementById('ds-filter');
  var count = document.getElementById('ds-count');
  var total = body.rows.length;
  function shown() {
    var n = 0;
    for (var i = 0; i < body.rows.length; i++) { if (!body.rows[i].hidden) n++; }
    count.textContent = n + ' of ' + total + ' runs shown';
  }
  filter.addEventListener('input', function () {
    var q = filter.value.trim().toLowerCase();
    for (var i = 0; i < body.rows.length; i++) {
      var r = body.rows[i];
      r.hidden = q !== '' && r.textContent.toLowerCase().indexOf(q) < 0;
    }
    shown();
  });
  var heads = table.tHead.rows[0].cells;
  function key(row, col) {
    var cell = row.cells[col];
    var v = cell.getAttribute('data-sort');
    return v === null ? cell.textContent.trim() : v;
  }
  function compare(a, b) {
    if (a === '' || b === '') return a === b ? 0 : (a === '' ? 1 : -1);  // missing values last
    var x = Number(a), y = Number(b);
    if (!isNaN(x) && !isNaN(y)) return x - y;
    return a.localeCompare(b);
  }
  for (var c = 0; c < heads.length; c++) {
    heads[c].addEventListener('click', (function (col) {
      return function () {
        var dir = heads[col].getAttribute('aria-sort') === 'ascending' ? -1 : 1;
        for (var j = 0; j < heads.length; j++) heads[j].removeAttribute('aria-sort');
        heads[col].setAttribute('aria-sort', dir === 1 ? 'ascending' : 'descending');
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (ra, rb) {
          var ka = key(ra, col), kb = key(rb, col);
          if (ka === '' || kb === '') return compare(ka, kb);
          return dir * compare(ka, kb);
        });
        rows.forEach(function (r) { body.appendChild(r); });
      };
    })(c));
  }
  shown();
})();
"""

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1f2328}
table{border-collapse:collapse;font-size:14px}
th,td{border-bottom:1px solid #d0d7de;padding:4px 10px;text-align:left;vertical-align:top;white-space:nowrap}
.ds-scroll{overflow-x:auto}
th{cursor:pointer;user-select:none;background:#f6f8fa;white-space:nowrap}
th[aria-sort=ascending]::after{content:" \\25B2"} th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
#ds-filter{font-size:14px;padding:4px 8px;width:24em;margin-right:12px}
.ds-status{color:#fff;padding:1px 8px;border-radius:8px;font-size:90%}
"""

_NUMERIC = {"peak_output_tok_s", "tpot_p50_us", "tpot_level", "bottleneck_share"}


def _script_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def _cell(text: str, sort: Any = None, numeric: bool = False) -> str:
    attr = "" if sort is None else f' data-sort="{html_text(sort)}"'
    cls = ' class="num"' if numeric else ""
    return f"<td{cls}{attr}>{text}</td>"


def _href(relative: str) -> str:
    return html_text(quote(relative, safe="/"))


def _none_if_nan(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def render_index(rows: pd.DataFrame, compare: list[str], title: str = "decodescope runs") -> str:
    """The index page: one row per run, sortable and filterable, self-contained (no network)."""
    body = []
    for rec in rows.to_dict("records"):
        rec = {k: _none_if_nan(v) for k, v in rec.items()}
        h = Headline(**{k: rec.get(k) for k in ("peak_output_tok_s", "tpot_p50_us", "tpot_level",
                                                 "bottleneck", "bottleneck_share")})
        status = _text(rec.get("status"))
        colour = status_colour(status)
        report = rec.get("report")
        link = (f'<a href="{_href(report)}">report</a>' if report else "<em>no report</em>")
        body.append("<tr>" + "".join([
            _cell(f"<code>{html_text(rec['run_id'])}</code>"),
            _cell(html_text(rec.get("params_name") or "")),
            _cell(html_text(rec.get("model") or "")),
            _cell(html_text(rec.get("host") or "")),
            _cell(f'<span class="ds-status" style="background:{colour}">{html_text(status)}</span>', status),
            _cell(html_text(rec.get("created") or "")),
            _cell(html_text(h.peak_text()), _text(h.peak_output_tok_s), True),
            _cell(html_text(h.tpot_text()), _text(h.tpot_p50_us), True),
            _cell(html_text(h.level_text()), "" if h.tpot_level is None else h.level_text(), True),
            _cell(html_text(h.bottleneck_text()), _text(h.bottleneck)),
            _cell(link, "1" if report else "0"),
        ]) + "</tr>")
    heads = ["run", "params", "model", "host", "status", "created", "peak output tok/s",
             "TPOT p50 (ms)", "at concurrency", "bottleneck (share)", "report"]
    compare_html = ("<p><b>compare pages:</b> " + " &middot; ".join(
        f'<a href="{_href(c)}">{html_text(c)}</a>' for c in compare) + "</p>") if compare else ""
    csp = (f"default-src 'none'; script-src '{_script_hash(_SCRIPT)}'; style-src 'unsafe-inline'; "
           "img-src data:")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{html_text(csp)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html_text(title)}</title>
<style>{_STYLE}</style>
</head><body>
<h1>{html_text(title)}</h1>
<p>Every run of this folder, newest first. Click a column header to sort; type to filter.
Peak output tok/s and TPOT p50 at the lowest concurrency come from each run's
<code>data/serving_levels.parquet</code>; the bottleneck (what holds the critical path of a decode step: its
share of the wall-clock step at the lowest profiled level; for runs without a path, the class with the
largest share of op time on the median rank) from <code>data/verdict.json</code>; {html_text(MISSING)} where a run has no such file.</p>
{compare_html}
<p><input id="ds-filter" type="search" placeholder="filter runs" aria-label="filter runs">
<span id="ds-count">{len(rows)} runs</span></p>
<div class="ds-scroll"><table id="ds-runs"><thead><tr>{''.join(f'<th scope="col">{html_text(h)}</th>' for h in heads)}</tr></thead>
<tbody>
{chr(10).join(body)}
</tbody></table></div>
<script>{_SCRIPT}</script>
</body></html>
"""


def default_output_dir() -> Path:
    """The repository's outputs/ (the current directory's for an installed wheel)."""
    root = source_checkout()
    return (root if root is not None else Path.cwd()) / "outputs"


def build_index(output_dir: Optional[Path] = None) -> Path:
    """Writes OUTPUT_DIR/index.html (atomically) over every run directory there; returns its path."""
    output_dir = Path(output_dir) if output_dir is not None else default_output_dir()
    html = render_index(collect_rows(output_dir), compare_pages(output_dir))
    return write_text_atomic(output_dir / INDEX_NAME, html)
