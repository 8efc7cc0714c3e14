"""`decodescope compare`: two or more runs, or variants of a run, side by side on one offline page.

A source is a run directory (`outputs/<run>/`, with its manifest.json) or a variant of one, addressed
as `RUN_DIR/variants/NAME` or `RUN_DIR:NAME` (its files in `variants/NAME/data/`, or in `variants/NAME/`
itself; its params.yaml when it has one, else the run's; its status from the run manifest's `variants`
entry: the runner measures a variant's 01, and 04 when asked, into it). The first source is the
baseline (A); every other (B, C, ...) is set against it, figure by figure:

- params and versions: the keys whose values differ (params.yaml, else the manifest's params; the
  manifest's versions, commit and host);
- serving (01): output throughput vs concurrency and TPOT p50 vs output tokens/s per GPU (GPU count:
  `server.tensor_parallel`) overlaid; per level the difference of each metric;
- the decode step (04): time and calls per step by category, the median over ranks (as the verdict
  takes it), per profiled concurrency the runs share (data/profile/c<N>/), else data/profile_summary.json;
- micro-benchmarks (02, 03): the difference per GEMM (op, dtype, batch) and per collective (op,
  communicator, timing, size).

Every difference carries a call from `decodescope.stats.differ` over the figure's repeats: a table with
a `repeat` column (serving_levels_repeats.parquet: one row per (level, repeat); records.ServingLevel.repeat) has
one sample per repeat; a figure measured once is marked `no repeats`. A file a source lacks is named in
the page, with the phase's status; nothing fails for it. A path that is not a run (or variant) is a
CompareError naming it (the CLI's exit status 2).

`load_sources(specs)` reads the sources, `comparison_blocks(sources)` builds the page's parts (headings,
HTML, figures: the notebook 06 shows them), `write_compare(sources, out)` writes the page atomically
through the report's shell (report.html.notebook_html); `build_compare(specs, out)` does all three and
rebuilds the output folder's index.html. Every string from files goes through report.escape.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from decodescope import stats
from decodescope.io import write_text_atomic
from decodescope.phases import PHASE_OF, PHASES
from decodescope.report.display import figure_bundle, table_html
from decodescope.report.escape import html_text
from decodescope.report.index import COMPARE_DIR  # default home of the pages: <output folder>/compare/

VARIANTS = "variants"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MISSING = "–"
MAX_ROWS = 400

# serving metrics compared per level: column, label, factor from the column's unit to the shown one
SERVING_METRICS = (("output_throughput_tok_s", "output tok/s", 1.0),
                   ("tpot_p50_us", "TPOT p50 (ms)", 1e-3),
                   ("ttft_p50_us", "TTFT p50 (ms)", 1e-3),
                   ("e2e_p50_us", "E2E p50 (ms)", 1e-3))
_PLAIN_NAME = re.compile(r"^[^/\0]+$")


class CompareError(ValueError):
    """A source that cannot be compared: the message names the path and what would be valid."""

    def __init__(self, path: Path, message: str):
        self.path = Path(path)
        super().__init__(f"{path}: {message}")


# ---- sources ---------------------------------------------------------------------------------------
@dataclass
class Source:
    spec: str
    letter: str
    run_dir: Path
    variant: Optional[str]
    data_dir: Path
    manifest: dict
    params: dict
    params_from: str

    @property
    def label(self) -> str:
        return self.run_dir.name + (f":{self.variant}" if self.variant else "")

    @property
    def name(self) -> str:
        """The source in legends: its letter and label."""
        return f"{self.letter}: {self.label}"

    def rel(self, name: str) -> str:
        """A data file's path as the page names it (inside the run directory)."""
        try:
            return str((self.data_dir / name).relative_to(self.run_dir))
        except ValueError:
            return str(self.data_dir / name)

    @property
    def variant_entry(self) -> Optional[dict]:
        """The run manifest's record of this variant (manifest.json `variants`), None for a run."""
        entry = (self.manifest.get("variants") or {}).get(self.variant) if self.variant else None
        return entry if isinstance(entry, dict) else None

    def phase_status(self, phase: str) -> str:
        """The phase's status in the manifest; for a variant, the variant's status for the phases a
        variant runs (01, and 04 when it asked for a profile), else 'not run for a variant'."""
        if self.variant is not None:
            entry = self.variant_entry or {}
            runs = {"01_serving"} | ({"04_profile"} if (entry.get("params") or {}).get("profile") else set())
            if phase not in runs:
                return "not run for a variant"
            return f"variant {entry.get('status', 'not in the manifest')}"
        info = (self.manifest.get("phases") or {}).get(phase)
        return str(info.get("status", "pending")) if isinstance(info, dict) else "not in the manifest"

    @property
    def status(self) -> str:
        if self.variant is not None:
            return str((self.variant_entry or {}).get("status", "not in the manifest"))
        return str(self.manifest.get("status", ""))

    @property
    def tensor_parallel(self) -> Optional[int]:
        tp = _get(self.params, "server", "tensor_parallel")
        try:
            return int(tp) if tp is not None and int(tp) >= 1 else None
        except (TypeError, ValueError):
            return None

    def missing_note(self, name: str, problem: str) -> str:
        phase = PHASE_OF.get(name)
        status = f" ({phase}: {self.phase_status(phase)})" if phase else ""
        return f"{self.name} {problem}{status}."


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _read_yaml(path: Path) -> Optional[dict]:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) else None


def _split_spec(spec: str) -> tuple[Path, Optional[str]]:
    """(run directory, variant name or None) of `RUN_DIR`, `RUN_DIR/variants/NAME` or `RUN_DIR:NAME`."""
    p = Path(spec)
    if p.parent.name == VARIANTS and (p.parent.parent / "manifest.json").is_file():
        return p.parent.parent, p.name
    if not p.exists() and ":" in spec:
        base, _, name = spec.rpartition(":")
        if base and name:
            return Path(base), name
    return p, None


def resolve(spec: str, letter: str = "A") -> Source:
    """The source a command-line argument names; CompareError (naming the path) when it is not a run
    directory or a variant of one."""
    from decodescope.report.index import read_manifest

    run_dir, variant = _split_spec(str(spec))
    if not run_dir.exists():
        raise CompareError(run_dir, "no such directory; give a run directory (outputs/<run>/), "
                                    "RUN_DIR/variants/NAME or RUN_DIR:NAME")
    if not run_dir.is_dir():
        raise CompareError(run_dir, "not a directory; give a run directory (outputs/<run>/)")
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise CompareError(run_dir, "not a run directory: it has no manifest.json (run directories are made "
                                    "by `decodescope run`, under outputs/)")
    params_from = "params.yaml"
    params = _read_yaml(run_dir / "params.yaml")
    if params is None:
        params, params_from = (manifest.get("params") or {}), "manifest.json"
    data_dir = run_dir / "data"
    if variant is not None:
        vdir = run_dir / VARIANTS / variant
        if not _PLAIN_NAME.match(variant) or variant in (".", "..") or not vdir.is_dir():
            found = sorted(p.name for p in (run_dir / VARIANTS).glob("*") if p.is_dir()) \
                if (run_dir / VARIANTS).is_dir() else []
            raise CompareError(vdir, f"no such variant of this run; its variants: {found or 'none'}")
        data_dir = vdir / "data" if (vdir / "data").is_dir() else vdir
        own_params = _read_yaml(vdir / "params.yaml")
        if own_params is not None:
            params, params_from = own_params, f"{VARIANTS}/{variant}/params.yaml"
    return Source(spec=str(spec), letter=letter, run_dir=run_dir.resolve(), variant=variant,
                  data_dir=data_dir.resolve(), manifest=manifest, params=params, params_from=params_from)


def load_sources(specs: Sequence[str]) -> list[Source]:
    """The sources, lettered A, B, ... in the order given; at least two."""
    specs = [str(s) for s in specs]
    if len(specs) < 2:
        raise CompareError(Path(specs[0]) if specs else Path("."),
                           "compare needs at least two runs or variants, e.g. "
                           "`decodescope compare outputs/RUN_A outputs/RUN_B`")
    if len(specs) > len(LETTERS):
        raise CompareError(Path(specs[len(LETTERS)]), f"at most {len(LETTERS)} sources on one page")
    return [resolve(s, LETTERS[i]) for i, s in enumerate(specs)]


def default_runs(output_dir: Optional[Path] = None, n: int = 2) -> list[str]:
    """The n newest run directories (by name: they start with their UTC time) of an output folder
    (default: the repository's outputs/), oldest first: the notebook's default."""
    from decodescope.report.index import default_output_dir, run_dirs

    return [str(p) for p in run_dirs(Path(output_dir) if output_dir else default_output_dir())[-n:]]


def _read_table(src: Source, name: str) -> tuple[Optional[pd.DataFrame], Optional[str]]:
    path = src.data_dir / name
    if not path.is_file():
        return None, src.missing_note(name, f"has no {src.rel(name)}")
    try:
        return pd.read_parquet(path), None
    except Exception as e:  # cut short, not parquet: named, not fatal
        return None, src.missing_note(name, f"has an unreadable {src.rel(name)} ({type(e).__name__}: {e})")


def _read_json(path: Path) -> Optional[dict]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


# ---- differences, generic --------------------------------------------------------------------------
def _samples(df: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    """The rows that are samples of `value` per key: one per repeat when the table has a `repeat`
    column; else one per key (duplicates, which are not repeats, collapsed to their median)."""
    df = df.dropna(subset=[value])
    if "repeat" in df.columns:
        return df[[*keys, "repeat", value]]
    return df.groupby(keys, sort=False, as_index=False)[value].median()


def pair_differences(frames: dict[str, Optional[pd.DataFrame]], keys: list[str], value: str) -> pd.DataFrame:
    """Long table: for every source after the first one with data (the base), per key, its samples
    of `value` against the base's (stats.differ_frame), with columns `run` and `base` (letters)."""
    have = [(k, df) for k, df in frames.items() if df is not None and len(df)]
    cols = [*keys, "run", "base", *stats.DIFFERENCE_COLUMNS]
    if len(have) < 2:
        return pd.DataFrame(columns=cols)
    base, base_df = have[0]
    a = _samples(base_df, keys, value)
    parts = []
    for letter, df in have[1:]:
        d = stats.differ_frame(a, _samples(df, keys, value), keys, value)
        parts.append(d.assign(run=letter, base=base))
    return pd.concat(parts, ignore_index=True)[cols]


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return MISSING
    return f"{v:,.{digits}f}"


def wide_table(long: pd.DataFrame, keys: list[str], scale: float = 1.0, digits: int = 2,
               key_names: Optional[dict] = None) -> pd.DataFrame:
    """The long differences as the page shows them: per key the base's median, then for each other
    source its median, the difference, the difference in %, its band (when there are repeats) and the
    call. Values times `scale` (e.g. us -> ms)."""
    if long.empty:
        return pd.DataFrame()
    rows: dict[tuple, dict] = {}
    bands = long["low"].notna().any()
    for r in long.to_dict("records"):
        key = tuple(r[k] for k in keys)
        row = rows.setdefault(key, {**{(key_names or {}).get(k, k): r[k] for k in keys}})
        base, run = r["base"], r["run"]
        row.setdefault(base, _fmt(None if r["median_a"] is None else r["median_a"] * scale, digits))
        row[run] = _fmt(None if r["median_b"] is None else r["median_b"] * scale, digits)
        row[f"{run}−{base}"] = _fmt(None if r["delta"] is None else r["delta"] * scale, digits)
        row[f"{run}−{base} %"] = _fmt(r["delta_pct"], 1)
        if bands:
            row[f"{run}−{base} 95% band"] = (MISSING if r["low"] is None or pd.isna(r["low"]) else
                                              f"[{_fmt(r['low'] * scale, digits)}, {_fmt(r['high'] * scale, digits)}]")
        row[f"{run} vs {base}"] = r["call"]
    return pd.DataFrame(list(rows.values()))


# ---- params and versions ---------------------------------------------------------------------------
def _flatten(d: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(d, dict):
        out: dict[str, str] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        if not d and prefix:
            out[prefix[:-1]] = "{}"
        return out
    value = json.dumps(d, default=str) if isinstance(d, (list, tuple)) else ("null" if d is None else str(d))
    return {prefix[:-1]: value}


def _differing(per_source: dict[str, dict[str, str]]) -> pd.DataFrame:
    keys = list(dict.fromkeys(k for flat in per_source.values() for k in flat))
    rows = []
    for k in keys:
        vals = {letter: flat.get(k, MISSING) for letter, flat in per_source.items()}
        if len(set(vals.values())) > 1:
            rows.append({"key": k, **vals})
    return pd.DataFrame(rows, columns=["key", *per_source])


def params_diff(sources: list[Source]) -> pd.DataFrame:
    """The params keys (dotted) whose values differ between the sources, one column per source."""
    return _differing({s.letter: _flatten(s.params) for s in sources})


def versions_diff(sources: list[Source]) -> pd.DataFrame:
    """Package versions, commit and host that differ between the sources."""
    from decodescope.report.index import host_text

    per = {}
    for s in sources:
        flat = {f"versions.{k}": v for k, v in _flatten(s.manifest.get("versions") or {}).items()}
        flat["git_commit"] = str(s.manifest.get("git_commit"))
        flat["host"] = host_text(s.data_dir.parent if s.data_dir.name == "data" else s.data_dir, s.manifest) \
            or MISSING
        per[s.letter] = flat
    return _differing(per)


def runs_table(sources: list[Source], out_dir: Optional[Path] = None) -> pd.DataFrame:
    from decodescope.report.index import headline

    rows = []
    for s in sources:
        h = headline(s.data_dir.parent) if s.data_dir.name == "data" else None
        rows.append({"": s.letter, "run": s.run_dir.name, "variant": s.variant or "",
                     "params": str(s.manifest.get("params_name", "")),
                     "model": str(_get(s.params, "model", "name") or ""),
                     "TP (GPUs)": s.tensor_parallel if s.tensor_parallel is not None else MISSING,
                     "status": s.status, "created": str(s.manifest.get("created", "")),
                     "peak output tok/s": h.peak_text() if h else MISSING,
                     "TPOT p50 (ms)": h.tpot_text() if h else MISSING,
                     "bottleneck": h.bottleneck_text() if h else MISSING,
                     "params from": s.params_from})
    return pd.DataFrame(rows)


def phases_table(sources: list[Source]) -> pd.DataFrame:
    phases = list(dict.fromkeys([*PHASES, *(p for s in sources for p in (s.manifest.get("phases") or {}))]))
    return pd.DataFrame([{"phase": p, **{s.letter: s.phase_status(p) for s in sources}} for p in phases])


# ---- serving ---------------------------------------------------------------------------------------
def serving_levels(src: Source) -> tuple[Optional[pd.DataFrame], Optional[str]]:
    """The serving levels, one row per (level, repeat) when the sweep repeated levels
    (data/serving_levels_repeats.parquet), else data/serving_levels.parquet (one row per level)."""
    df, note = _read_table(src, "serving_levels_repeats.parquet")
    if df is None or "repeat" not in df.columns:
        df, note = _read_table(src, "serving_levels.parquet")
        if df is not None:
            df = df.drop(columns=[c for c in ("repeat",) if c in df.columns])
    if df is not None and "level" not in df.columns:
        return None, src.missing_note("serving_levels.parquet", f"has a {src.rel('serving_levels.parquet')} "
                                                                "without a level column")
    return df, note


def _long_metrics(levels: pd.DataFrame) -> pd.DataFrame:
    """levels as (level, metric, [repeat], value) rows."""
    metrics = [m for m, _, _ in SERVING_METRICS if m in levels.columns]
    ids = ["level", *(["repeat"] if "repeat" in levels.columns else [])]
    return levels[[*ids, *metrics]].melt(id_vars=ids, var_name="metric", value_name="value")


def serving_differences(levels: dict[str, Optional[pd.DataFrame]]) -> pd.DataFrame:
    """Per (level, metric), each source against the base (long; see pair_differences)."""
    frames = {k: (None if df is None else _long_metrics(df)) for k, df in levels.items()}
    return pair_differences(frames, ["level", "metric"], "value")


def serving_bands(levels: dict[str, Optional[pd.DataFrame]]) -> pd.DataFrame:
    """Per source, level and metric: the median over the repeats and its band (stats.band)."""
    parts = []
    for letter, df in levels.items():
        if df is None or df.empty:
            continue
        long = _long_metrics(df)
        if "repeat" not in long.columns:
            long = long.assign(repeat=0)
        parts.append(stats.band_frame(long.dropna(subset=["value"]), ["level", "metric"], "value").assign(run=letter))
    cols = ["run", "level", "metric", *stats.BAND_COLUMNS]
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def _error_y(b: pd.DataFrame, scale: float = 1.0) -> Optional[dict]:
    if not b["low"].notna().any():
        return None
    med = b["median"] * scale
    return dict(type="data", symmetric=False, array=(b["high"] * scale - med).fillna(0).tolist(),
                arrayminus=(med - b["low"] * scale).fillna(0).tolist())


def throughput_figure(bands: pd.DataFrame, sources: list[Source]) -> go.Figure:
    fig = go.Figure()
    for s in sources:
        b = bands[(bands["run"] == s.letter) & (bands["metric"] == "output_throughput_tok_s")].sort_values("level")
        if b.empty:
            continue
        fig.add_trace(go.Scatter(x=b["level"], y=b["median"], mode="lines+markers", name=html_text(s.name),
                                 error_y=_error_y(b),
                                 hovertemplate="concurrency %{x}: %{y:,.1f} tok/s<extra></extra>"))
    fig.update_layout(title="Output throughput vs concurrency (median over repeats; bars: 95% band)",
                      xaxis_title="concurrency (requests in flight)", yaxis_title="output tokens/s", xaxis_type="log")
    return fig


def pareto_figure(bands: pd.DataFrame, sources: list[Source]) -> go.Figure:
    """TPOT p50 against output tokens/s per GPU (GPU count: the source's tensor_parallel)."""
    fig = go.Figure()
    for s in sources:
        b = bands[bands["run"] == s.letter]
        tput = b[b["metric"] == "output_throughput_tok_s"].set_index("level")["median"]
        tpot = b[b["metric"] == "tpot_p50_us"].set_index("level")["median"]
        both = pd.concat([tput.rename("tput"), tpot.rename("tpot")], axis=1).dropna().sort_index()
        if both.empty:
            continue
        gpus = s.tensor_parallel or 1
        fig.add_trace(go.Scatter(x=both["tput"] / gpus, y=both["tpot"] / 1e3, mode="lines+markers+text",
                                 name=html_text(f"{s.name} ({gpus} GPU{'s' if gpus > 1 else ''})"),
                                 text=[f"c={int(c)}" for c in both.index], textposition="top center",
                                 hovertemplate="%{text}: %{x:,.1f} tok/s/GPU, TPOT %{y:.2f} ms<extra></extra>"))
    fig.update_layout(title="TPOT p50 vs output tokens/s per GPU (lower right is better)",
                      xaxis_title="output tokens/s per GPU (TP rank)", yaxis_title="TPOT p50 (ms per output token)")
    return fig


# ---- the decode step (04) --------------------------------------------------------------------------
def profile_summaries(src: Source) -> dict[Optional[int], dict]:
    """The source's profile summaries by profiled concurrency: data/profile/c<N>/profile_summary.json,
    else data/profile_summary.json (keyed by its `concurrency`, None when it has none)."""
    out: dict[Optional[int], dict] = {}
    for p in sorted((src.data_dir / "profile").glob("c*/profile_summary.json")):
        m = re.fullmatch(r"c(\d+)", p.parent.name)
        raw = _read_json(p)
        if m and raw is not None:
            out[int(m.group(1))] = raw
    if not out:
        raw = _read_json(src.data_dir / "profile_summary.json")
        if raw is not None:
            c = raw.get("concurrency")
            out[int(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None] = raw
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def step_categories(summary: dict) -> pd.DataFrame:
    """Per category: time and calls per step, the median over ranks (a rank without the category
    counts 0), from a profile summary's per_step_categories."""
    cats = pd.DataFrame(summary.get("per_step_categories") or [])
    cols = ["category", "time_per_step_us", "calls_per_step"]
    if cats.empty or not {"rank", "category", "time_per_step_us"} <= set(cats.columns):
        return pd.DataFrame(columns=cols)
    if "calls_per_step" not in cats:
        cats["calls_per_step"] = float("nan")
    cats = cats.assign(category=cats["category"].astype(str))
    full = (pd.DataFrame({"rank": sorted(cats["rank"].unique())})
            .merge(pd.DataFrame({"category": cats["category"].unique()}), how="cross")
            .merge(cats[["rank", *cols]], on=["rank", "category"], how="left")
            .fillna({"time_per_step_us": 0.0, "calls_per_step": 0.0}))
    out = full.groupby("category", sort=False)[["time_per_step_us", "calls_per_step"]].median().reset_index()
    return out.sort_values("time_per_step_us", ascending=False, kind="stable").reset_index(drop=True)[cols]


STEP_FIGURES = (("wall_us_median", "wall-clock step"), ("busy_us_median", "busy (union over lanes)"),
                ("summed_us_median", "summed op time"), ("idle_us_median", "idle"),
                ("period_us_median", "period (step to next step)"))


def category_differences(summaries: dict[str, Optional[dict]]) -> pd.DataFrame:
    """Per category, each source against the base: time per step (us) and calls per step, with
    their differences and the call (stats.differ; one profile per source: `no repeats`). A category
    one source lacks counts 0 there."""
    cats = {k: (None if s is None else step_categories(s)) for k, s in summaries.items()}
    have = [k for k, c in cats.items() if c is not None and len(c)]
    allcats = list(dict.fromkeys(c for k in have for c in cats[k]["category"]))
    filled = {k: (cats[k].set_index("category").reindex(allcats).fillna(0.0).reset_index() if k in have else None)
              for k in cats}
    t = pair_differences(filled, ["category"], "time_per_step_us")
    c = pair_differences(filled, ["category"], "calls_per_step")
    if t.empty:
        return pd.DataFrame(columns=["category", "class", "run", "base", "time_a_us", "time_b_us", "delta_us",
                                     "delta_pct", "calls_a", "calls_b", "delta_calls", "call"])
    from decodescope.trace.categorize import class_of

    out = t.rename(columns={"median_a": "time_a_us", "median_b": "time_b_us", "delta": "delta_us"})
    calls = c.set_index(["category", "run"])
    out["calls_a"] = [calls.loc[(k, r), "median_a"] for k, r in zip(out["category"], out["run"])]
    out["calls_b"] = [calls.loc[(k, r), "median_b"] for k, r in zip(out["category"], out["run"])]
    out["delta_calls"] = out["calls_b"] - out["calls_a"]
    out["class"] = out["category"].map(class_of)
    return out[["category", "class", "run", "base", "time_a_us", "time_b_us", "delta_us", "delta_pct",
                "calls_a", "calls_b", "delta_calls", "low", "high", "call"]]


def step_differences(summaries: dict[str, Optional[dict]]) -> pd.DataFrame:
    """The step's own medians (wall, busy, summed, idle, period) per source against the base."""
    frames = {}
    for k, s in summaries.items():
        if s is None:
            frames[k] = None
            continue
        per = s.get("per_step") or {}
        frames[k] = pd.DataFrame([{"figure": label, "value_us": per.get(key)} for key, label in STEP_FIGURES
                                  if per.get(key) is not None])
    return pair_differences(frames, ["figure"], "value_us")


def category_figure(summaries: dict[str, Optional[dict]], sources: list[Source]) -> go.Figure:
    fig = go.Figure()
    for s in sources:
        summ = summaries.get(s.letter)
        if summ is None:
            continue
        c = step_categories(summ)
        fig.add_trace(go.Bar(x=c["category"], y=c["time_per_step_us"] / 1e3, name=html_text(s.name),
                             customdata=c["calls_per_step"],
                             hovertemplate="%{x}: %{y:.3f} ms/step, %{customdata:.1f} calls/step<extra></extra>"))
    fig.update_layout(barmode="group", title="Time per decode step by category (median over ranks)",
                      xaxis_title="category", yaxis_title="ms per step")
    return fig


def category_delta_figure(diffs: pd.DataFrame, sources: list[Source]) -> go.Figure:
    fig = go.Figure()
    names = {s.letter: s.name for s in sources}
    for run, g in diffs.groupby("run", sort=False):
        fig.add_trace(go.Bar(x=g["category"], y=g["delta_us"] / 1e3,
                             name=html_text(f"{names[run]} − {g['base'].iloc[0]}"),
                             customdata=g["delta_calls"],
                             hovertemplate="%{x}: %{y:+.3f} ms/step, %{customdata:+.1f} calls/step<extra></extra>"))
    fig.update_layout(barmode="group", title="Difference per category against the base (ms per decode step)",
                      xaxis_title="category", yaxis_title="ms per step (positive: slower than the base)",
                      showlegend=True)
    return fig


# ---- micro-benchmarks (02, 03) ---------------------------------------------------------------------
GEMM_KEYS = ("op", "dtype", "l2", "batch")


def gemm_frame(df: Optional[pd.DataFrame]) -> Optional[pd.DataFrame]:
    if df is None or "time_us" not in df.columns:
        return None
    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    order = [k for k in GEMM_KEYS if k in ok.columns]  # ops in the probe's order, then dtype, l2, batch
    if "op" in ok.columns:
        ok = ok.assign(_op=pd.Categorical(ok["op"], categories=list(dict.fromkeys(ok["op"]))))
        order = ["_op", *order[1:]]
    return ok.sort_values(order, kind="stable").drop(columns=["_op"], errors="ignore")


def gemm_keys(frames: dict[str, Optional[pd.DataFrame]]) -> list[str]:
    cols = [set(df.columns) for df in frames.values() if df is not None]
    return [k for k in GEMM_KEYS if cols and all(k in c for c in cols)]


def collectives_frame(df: Optional[pd.DataFrame]) -> Optional[pd.DataFrame]:
    """Rank 0's rows that went ok, with `what` (part, op, communicator, timing, in-place) and `size`
    (bytes; tokens per GPU for all-to-all; batch for bursts) as the keys."""
    if df is None or "time_us" not in df.columns:
        return None
    from decodescope.microbench import with_timing_columns

    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    if ok.empty:
        return ok.assign(what=[], size=[])
    if "rank" in ok.columns:
        ok = ok[ok["rank"] == ok["rank"].min()]
    ok = with_timing_columns(ok)
    get = lambda c: ok[c] if c in ok.columns else pd.Series([None] * len(ok), index=ok.index)  # noqa: E731
    inplace = get("inplace").map(lambda v: "" if v is None or v != v else (" in-place" if v else " out-of-place"))
    what = (get("part").astype(str) + " " + get("op").astype(str) + " " + get("communicator").astype(str) + " "
            + get("timing").astype(str) + inplace)
    size = get("bytes").astype(float)
    for col, part in (("tokens_per_gpu", "all_to_all"), ("batch", "burst")):
        if col in ok.columns:
            size = size.where(get("part") != part, get(col).astype(float))
    return ok.assign(what=what, size=size.fillna(-1).astype("int64")).sort_values(["what", "size"], kind="stable")


def micro_delta_figure(diffs: pd.DataFrame, x: str, group: list[str], title: str, xaxis: str,
                       sources: list[Source]) -> go.Figure:
    fig = go.Figure()
    names = {s.letter: s.letter for s in sources}
    for (run, *g), d in diffs.groupby(["run", *group], sort=False):
        d = d.sort_values(x)
        fig.add_trace(go.Scatter(x=d[x], y=d["delta_pct"], mode="lines+markers",
                                 name=html_text(f"{names.get(run, run)}−{d['base'].iloc[0]} " + " ".join(map(str, g)))))
    fig.add_hline(y=0, line_dash="dot")
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title="difference against the base (%)",
                      xaxis_type="log", showlegend=True)
    return fig


# ---- the page --------------------------------------------------------------------------------------
@dataclass
class Block:
    """One part of the page: kind `heading` (text, anchor), `html` (markup already escaped) or
    `figure` (a plotly figure)."""

    kind: str
    content: Any
    anchor: str = ""


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
        kinds = {k: f"{s.get('step_kind', '?')} steps {s.get('steps', {}).get(s.get('step_kind', ''), '?')}, "
                    f"ranks {s.get('ranks', '?')}, device {s.get('device', '?')}"
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


def comparison_blocks(sources: list[Source], out_dir: Optional[Path] = None) -> list[Block]:
    """Every part of the page, in order (out_dir: where the page goes, for relative links)."""
    return [*_head_blocks(sources, out_dir), *_params_blocks(sources), *_serving_blocks(sources),
            *_profile_blocks(sources), *_micro_blocks(sources)]


def show_blocks(blocks: list[Block]) -> None:
    """The parts in a notebook (JupyterLab): headings, tables and notes as HTML, figures as plotly's."""
    from IPython.display import HTML, display

    from decodescope.report.display import show

    for b in blocks:
        if b.kind == "figure":
            show(b.content)
        elif b.kind == "heading":
            display(HTML(f"<h2 id='{html_text(b.anchor)}'>{html_text(b.content)}</h2>"))
        elif b.content:
            display(HTML(b.content))


def blocks_notebook(blocks: list[Block], title: str):
    """The parts as a notebook with outputs only, for the report's HTML shell."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

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


def write_compare(sources: list[Source], out: Optional[Path] = None) -> Path:
    """The page, written atomically; returns its path."""
    from decodescope.report.html import notebook_html

    out = Path(out) if out else default_out(sources)
    out_dir = out.resolve().parent
    blocks = comparison_blocks(sources, out_dir)
    nb = blocks_notebook(blocks, "decodescope compare " + " vs ".join(s.label for s in sources))
    return write_text_atomic(out, notebook_html(nb))


def build_compare(specs: Sequence[str], out: Optional[Path] = None) -> Path:
    """Reads the sources, writes the page, and rebuilds the index of the first run's output folder when
    the page is in it (or in its compare/); a failure to write the index only warns."""
    from decodescope.report.index import build_index

    sources = load_sources(specs)
    path = write_compare(sources, out)
    root = sources[0].run_dir.parent
    if path.resolve().parent in (root, root / COMPARE_DIR):
        try:
            build_index(root)
        except OSError as e:
            warnings.warn(f"could not rebuild {root / 'index.html'}: {e}", stacklevel=2)
    return path
