"""`decodescope compare`: two or more runs, or variants of a run, side by side on one offline page.

A source is a run directory (`outputs/<run>/`, with its manifest.json) or a variant of one.
A variant is addressed as `RUN_DIR/variants/NAME` or `RUN_DIR:NAME`.
Its files are in `variants/NAME/data/`, or in `variants/NAME/` itself.
Its params.yaml is its own when it has one, else the run's.
Its status comes from the run manifest's `variants` entry.
The runner measures a variant's 01, and its 04 when asked, into that entry.
The first source is the baseline (A).
Every other source (B, C, ...) is set against it, figure by figure:

- params and versions: the keys whose values differ.
  Params come from params.yaml, else from the manifest's params.
  Versions are the manifest's versions, commit and host.
- serving (01): output throughput vs concurrency, overlaid.
  Also TPOT p50 vs output tokens/s per GPU, overlaid (GPU count: `server.tensor_parallel`).
  Per level, the difference of each metric.
- the decode step (04): time and calls per step by category.
  Each is the median over ranks, as the verdict takes it.
  It is shown per profiled concurrency the runs share (data/profile/c<N>/), else from data/profile_summary.json.
- micro-benchmarks (02, 03): the difference per GEMM (op, dtype, batch).
  Also the difference per collective (op, communicator, timing, size).

Every difference carries a call from `decodescope.core.stats.differ` over the figure's repeats.
A table with a `repeat` column has one sample per repeat.
An example is serving_levels_repeats.parquet: one row per (level, repeat); records_serving.ServingLevel.repeat.
A figure measured once is marked `no repeats`.
A file a source lacks is named in the page, with the phase's status; nothing fails for it.
A path that is not a run (or variant) is a CompareError naming it (the CLI's exit status 2).

`load_sources(specs)` reads the sources.
`comparison_blocks(sources)` builds the page's parts: headings, HTML, figures (the notebook 06 shows them).
`write_compare(sources, out)` writes the page atomically through the report's shell (report.html.notebook_html).
`build_compare(specs, out)` does all three and rebuilds the output folder's index.html.
`run_compare(specs, out, gates, allowed)` does the same and writes compare.json beside the page
(report.compare_gate: what makes the runs comparable, the figures held to a gate, the exit status).
Every string from files goes through report.escape.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

import nbformat
import pandas as pd
from IPython.display import HTML, display
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from decodescope.core import stats
from decodescope.core.io import write_text_atomic
from decodescope.show.display import figure_bundle, show, table_html
from decodescope.show.escape import html_text
from decodescope.report.html import notebook_html
from decodescope.report.index import COMPARE_DIR, build_index
from decodescope.report.compare_gate import Gates, comparability, evaluate, gate_table, mismatch_text
from decodescope.report.compare_sources import Source, _read_table, load_sources
from decodescope.schema.recordbase import write_record
from decodescope.schema.records_compare import CompareResult
# re-exported (__all__): the CLI, notebook 06 and the tests name them as report.compare's
from decodescope.report.compare_sources import VARIANTS, CompareError, default_runs, resolve
from decodescope.report.compare_tables import (MAX_ROWS, SERVING_METRICS, category_delta_figure, category_differences,
                                               category_figure, collectives_frame, gemm_frame, gemm_keys,
                                               micro_delta_figure, pair_differences, params_diff, pareto_figure,
                                               phases_table, profile_summaries, runs_table, serving_bands,
                                               serving_differences, serving_levels, step_differences, throughput_figure,
                                               versions_diff, wide_table)
from decodescope.report.compare_tables import MISSING

log = logging.getLogger(__name__)


# ---- the page --------------------------------------------------------------------------------------
@dataclass
class Block:
    """One part of the page: kind `heading` (text, anchor), `html` (markup already escaped) or
    `figure` (a plotly figure)."""

    kind: str
    content: Any
    anchor: str = ""


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def _note(text: str) -> Block:
    return Block("html", f"<p>{html_text(text)}</p>")


def _table(df: pd.DataFrame, caption: str) -> Block:
    return Block("html", table_html(df, caption=caption, max_rows=MAX_ROWS))


CALLS_NOTE = ("Each difference is against the base (the first source with the figure) and carries a call: "
              f"'{stats.SIGNIFICANT}' when the 95% band of the difference of medians excludes 0, "
              f"'{stats.WITHIN_NOISE}' when it holds 0 ({stats.METHOD}, over the repeats of each figure); "
              f"'{stats.TOO_FEW}' when a side has fewer than {stats.MIN_REPEATS_TO_CALL} repeats; "
              f"'{stats.NO_REPEATS}' when a side measured the figure once: the noise is unknown and the "
              "difference may be noise. Serving levels have repeats when the sweep ran with workload.repeats > 1 "
              "(serving_levels_repeats.parquet: one row per level and repeat).")


def _head_blocks(sources: list[Source], out_dir: Optional[Path]) -> list[Block]:
    links = []
    for s in sources:
        report = s.run_dir / "report.html"
        if report.is_file():
            href = os.path.relpath(report, out_dir) if out_dir is not None else report.as_uri()
            links.append(f'<a href="{html_text(href)}">{html_text(s.letter)}: report of {html_text(s.run_dir.name)}</a>')
    return [Block("html", "<h1>decodescope compare</h1><p>" + " &middot; ".join(
        f"<b>{html_text(s.letter)}</b> <code>{html_text(s.label)}</code>" for s in sources) + "</p>"),
        _table(runs_table(sources), "the sources (A is the base) - manifest.json, params, data/"),
        Block("html", "<p>" + " &middot; ".join(links) + "</p>" if links else ""),
        _note(CALLS_NOTE)]


def _comparability_blocks(sources: list[Source], result: Optional[CompareResult] = None) -> list[Block]:
    """What makes the runs comparable (flagged where it differs), and the gate's figures when one was asked."""
    checks = result.comparability if result is not None else comparability(sources)
    out = [Block("heading", "Comparable?", "comparable")]
    rows = pd.DataFrame([{"": f"{c.run} vs {c.base}", "what": c.key, "base": c.value_a or MISSING,
                          "run": c.value_b or MISSING, "status": c.status, "from": c.source} for c in checks])
    differs = mismatch_text(checks, ("differs", "allowed"))
    out.append(_note("The runs differ in what makes them comparable: " + "; ".join(differs) + "." if differs else
                     "Model, tensor-parallel size, engine version, all-reduce path and host match (or are not "
                     "recorded)."))
    out.append(_table(rows, "model, TP, engine version, all-reduce path, host - params, manifest.json, data/host.json"))
    if result is not None and result.gates:
        verdict = ("refused: not gated" if result.refused else
                   f"{result.regressions} regression(s)" if result.regressions else "no regression")
        out.append(Block("heading", f"Gate: {verdict}", "gate"))
        t = gate_table(result)
        out.append(_table(t, "figures held to a gate - compare.json") if len(t) else
                   _note("No figure was gated."))
    return out


def _params_blocks(sources: list[Source]) -> list[Block]:
    out = [Block("heading", "Params and versions", "params")]
    p = params_diff(sources)
    out.append(_table(p, "params that differ - " + ", ".join(f"{s.letter}: {s.params_from}" for s in sources))
               if len(p) else _note("The params are the same in every source."))
    v = versions_diff(sources)
    out.append(_table(v, "versions, commit and host that differ - manifest.json, data/host.json")
               if len(v) else _note("Versions, commit and host are the same in every source."))
    out.append(_table(phases_table(sources), "phase status - manifest.json"))
    return out


def _serving_blocks(sources: list[Source]) -> list[Block]:
    out = [Block("heading", "Serving (01)", "serving")]
    levels, notes = {}, []
    for s in sources:
        df, note = serving_levels(s)
        levels[s.letter] = df
        if note:
            notes.append(note)
    out += [_note(n) for n in notes]
    if sum(df is not None for df in levels.values()) == 0:
        return out + [_note("No source has a serving sweep: nothing to compare.")]
    bands = serving_bands(levels)
    repeats = {s.letter: int(bands.loc[bands["run"] == s.letter, "n"].max()) for s in sources
               if (bands["run"] == s.letter).any()}
    out.append(_note("Repeats per level: " + ", ".join(f"{k}: {v}" for k, v in repeats.items()) + "."))
    out.append(Block("figure", throughput_figure(bands, sources)))
    out.append(Block("figure", pareto_figure(bands, sources)))
    diffs = serving_differences(levels)
    for metric, label, scale in SERVING_METRICS:
        d = diffs[diffs["metric"] == metric]
        if len(d):
            out.append(_table(wide_table(d.drop(columns=["metric"]), ["level"], scale, 2, {"level": "concurrency"}),
                              f"{label} per concurrency, median over repeats - data/serving_levels.parquet"))
    if len(diffs) == 0 and len(levels) > 1:
        out.append(_note("Only one source has a serving sweep: nothing to set against it."))
    return out


def _profile_blocks(sources: list[Source]) -> list[Block]:
    out = [Block("heading", "The decode step by category (04)", "profile")]
    per_source = {s.letter: profile_summaries(s) for s in sources}
    for s in sources:
        if not per_source[s.letter]:
            out.append(_note(s.missing_note("profile_summary.json", f"has no {s.rel('profile_summary.json')}")))
    having = [k for k, v in per_source.items() if v]
    if len(having) < 2:
        return out + [_note("Fewer than two sources have a profile: no per-step comparison.")]
    common = [c for c in per_source[having[0]] if all(c in per_source[k] for k in having)]
    if common:
        chosen = [("concurrency not recorded" if c is None else f"concurrency {c}",
                   {k: (per_source[k][c] if k in having else None) for k in per_source}) for c in common]
    else:  # profiled at different levels (or an old run without the level): the first profile of each
        firsts = {k: (next(iter(v.items())) if v else None) for k, v in per_source.items()}
        levels_note = ", ".join(f"{k}: {'concurrency ' + str(f[0]) if f[0] is not None else 'concurrency not recorded'}"
                                for k, f in firsts.items() if f)
        out.append(_note("The sources were not profiled at a common concurrency; their first profiles are compared "
                         f"({levels_note})."))
        chosen = [("first profile", {k: (f[1] if f else None) for k, f in firsts.items()})]
    for title, summaries in chosen:
        diffs = category_differences(summaries)
        kinds = {k: f"{_or_unknown(s.step_kind)} steps {s.steps.get(s.step_kind or '', '?')}, "
                    f"ranks {_or_unknown(s.ranks)}, device {_or_unknown(s.device)}"
                 for k, s in summaries.items() if s is not None}
        out.append(Block("html", f"<h3>{html_text(title)}</h3>"))
        out.append(_note("Profiled: " + "; ".join(f"{k}: {v}" for k, v in kinds.items()) + "."))
        out.append(Block("figure", category_figure(summaries, sources)))
        if len(diffs):
            out.append(Block("figure", category_delta_figure(diffs, sources)))
            show = diffs.assign(**{c: diffs[c] / 1e3 for c in ("time_a_us", "time_b_us", "delta_us")}).rename(
                columns={"time_a_us": "base ms/step", "time_b_us": "ms/step", "delta_us": "difference ms",
                         "delta_pct": "difference %", "calls_a": "base calls/step", "calls_b": "calls/step",
                         "delta_calls": "difference calls"}).drop(columns=["low", "high"])
            out.append(_table(show, f"time and calls per decode step by category, median over ranks ({title}) - "
                                    "profile_summary.json per_step_categories"))
        steps = step_differences(summaries)
        if len(steps):
            out.append(_table(wide_table(steps, ["figure"], 1e-3, 3),
                              f"the step itself, ms ({title}) - profile_summary.json per_step"))
    return out


def _micro_blocks(sources: list[Source]) -> list[Block]:
    out = [Block("heading", "Micro-benchmarks (02, 03)", "micro")]
    gemm, coll = {}, {}
    for s in sources:
        df, note = _read_table(s, "gemm.parquet")
        gemm[s.letter] = gemm_frame(df)
        if note:
            out.append(_note(note))
        df, note = _read_table(s, "collectives.parquet")
        coll[s.letter] = collectives_frame(df)
        if note:
            out.append(_note(note))
    keys = gemm_keys(gemm)
    g = pair_differences(gemm, keys, "time_us") if keys else pd.DataFrame()
    if len(g):
        out.append(Block("figure", micro_delta_figure(g, "batch", [k for k in keys if k != "batch"],
                                                      "GEMM time per call: difference against the base",
                                                      "batch (tokens per step)", sources)))
        out.append(_table(wide_table(g, keys, 1.0, 2), "GEMM time per call (us) per op, dtype, batch - data/gemm.parquet"))
    else:
        out.append(_note("Fewer than two sources have GEMM results: no GEMM comparison."))
    c = pair_differences(coll, ["what", "size"], "time_us")
    if len(c):
        out.append(Block("figure", micro_delta_figure(c, "size", ["what"], "Collective time: difference against the base",
                                                      "size (bytes; tokens per GPU for all-to-all; batch for bursts)",
                                                      sources)))
        out.append(_table(wide_table(c, ["what", "size"], 1.0, 2),
                          "collective time (us), rank 0 - data/collectives.parquet"))
    else:
        out.append(_note("Fewer than two sources have collective results: no collective comparison."))
    return out


def comparison_blocks(sources: list[Source], out_dir: Optional[Path] = None,
                      result: Optional[CompareResult] = None) -> list[Block]:
    """Every part of the page, in order (out_dir: where the page goes, for relative links; result: the
    gate's compare_gate.CompareResult, shown where given)."""
    return [*_head_blocks(sources, out_dir), *_comparability_blocks(sources, result), *_params_blocks(sources),
            *_serving_blocks(sources),
            *_profile_blocks(sources), *_micro_blocks(sources)]


def show_blocks(blocks: list[Block]) -> None:
    """The parts in a notebook (JupyterLab): headings, tables and notes as HTML, figures as plotly's."""
    for b in blocks:
        if b.kind == "figure":
            show(b.content)
        elif b.kind == "heading":
            display(HTML(f"<h2 id='{html_text(b.anchor)}'>{html_text(b.content)}</h2>"))
        elif b.content:
            display(HTML(b.content))


def blocks_notebook(blocks: list[Block], title: str):
    """The parts as a notebook with outputs only, for the report's HTML shell."""
    cells = []
    for b in blocks:
        if b.kind == "heading":
            cells.append(new_markdown_cell(f"<h2 id='{html_text(b.anchor)}'>{html_text(b.content)}</h2>"))
            continue
        data = figure_bundle(b.content) if b.kind == "figure" else {"text/html": b.content}
        if b.kind != "figure" and not b.content:
            continue
        cells.append(new_code_cell("", outputs=[new_output("display_data", data=data)]))
    nb = new_notebook(cells=cells)
    nb.metadata["title"] = title
    return nbformat.from_dict(nb)


def _file_part(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def default_out(sources: list[Source]) -> Path:
    """<the first run's output folder>/compare/<A>-vs-<B>[...].html"""
    name = "-vs-".join(_file_part(s.label) for s in sources)
    return sources[0].run_dir.parent / COMPARE_DIR / f"{name[:200]}.html"


def write_compare(sources: list[Source], out: Optional[Path] = None, result: Optional[CompareResult] = None) -> Path:
    """The page, written atomically; returns its path."""
    out = Path(out) if out else default_out(sources)
    out_dir = out.resolve().parent
    blocks = comparison_blocks(sources, out_dir, result)
    nb = blocks_notebook(blocks, "decodescope compare " + " vs ".join(s.label for s in sources))
    return write_text_atomic(out, notebook_html(nb))


def build_compare(specs: Sequence[str], out: Optional[Path] = None) -> Path:
    """Reads the sources, writes the page, and rebuilds the index of the first run's output folder when
    the page is in it (or in its compare/); a failure to write the index only warns."""
    return run_compare(specs, out)[0]


def compare_json_path(page: Path) -> Path:
    """compare.json's path beside a page: <page stem>.json."""
    return Path(page).with_suffix(".json")


def run_compare(specs: Sequence[str], out: Optional[Path] = None, gates: Optional[Gates] = None,
                allowed: Collection[str] = frozenset()) -> tuple[Path, Path, CompareResult]:
    """build_compare, with the gate: (page, compare.json's path, compare_gate.CompareResult). The record is
    written (atomically) after the page, beside it; the index is rebuilt last."""
    sources = load_sources(specs)
    page = Path(out) if out else default_out(sources)
    result = evaluate(sources, gates or Gates(), set(allowed), page)
    path = write_compare(sources, page, result)
    record = write_record(compare_json_path(path), result)
    _rebuild_index(sources, path)
    return path, record, result


def _rebuild_index(sources: list[Source], path: Path) -> None:
    root = sources[0].run_dir.parent
    if path.resolve().parent in (root, root / COMPARE_DIR):
        try:
            build_index(root)
        except OSError as e:
            log.warning("could not rebuild %s: %s", root / "index.html", e)


__all__ = ["Block", "blocks_notebook", "build_compare", "compare_json_path", "run_compare", "CALLS_NOTE",
           "CompareError", "comparison_blocks", "default_out", "default_runs", "MISSING", "resolve", "show_blocks", "VARIANTS", "write_compare"]
