"""A comparison's tables and figures, each a function of the sources' files (report.compare lays them out
as the page)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import plotly.graph_objects as go

from decodescope.core import stats
from decodescope.micro.bench import with_timing_columns
from decodescope.core.phases import PHASES
from decodescope.show.escape import html_text
from decodescope.report.index import headline, host_text
from decodescope.trace.categorize import class_of
from decodescope.schema.params import flatten_dotted
from decodescope.schema.recordbase import RecordError, frame
from decodescope.schema.views import ProfileSummaryView, StepCategoryView, read_view
from decodescope.report.compare_sources import Source, _read_table
from decodescope.schema.views import key_path

MISSING = "–"
MAX_ROWS = 400


# serving metrics compared per level: column, label, factor from the column's unit to the shown one
SERVING_METRICS = (("output_throughput_tok_s", "output tok/s", 1.0),
                   ("tpot_p50_us", "TPOT p50 (ms)", 1e-3),
                   ("ttft_p50_us", "TTFT p50 (ms)", 1e-3),
                   ("e2e_p50_us", "E2E p50 (ms)", 1e-3),
                   ("server_tpot_mean_us", "TPOT mean, the server's (vLLM /metrics) (ms)", 1e-3))


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
    return _differing({s.letter: flatten_dotted(s.params) for s in sources})


def versions_diff(sources: list[Source]) -> pd.DataFrame:
    """Package versions, commit and host that differ between the sources."""
    per = {}
    for s in sources:
        flat = {f"versions.{k}": v for k, v in flatten_dotted(s.manifest.versions).items()}
        flat["git_commit"] = str(s.manifest.git_commit)
        flat["host"] = host_text(s.data_dir.parent if s.data_dir.name == "data" else s.data_dir, s.manifest) \
            or MISSING
        per[s.letter] = flat
    return _differing(per)


def runs_table(sources: list[Source], out_dir: Optional[Path] = None) -> pd.DataFrame:
    rows = []
    for s in sources:
        h = headline(s.data_dir.parent) if s.data_dir.name == "data" else None
        rows.append({"": s.letter, "run": s.run_dir.name, "variant": s.variant or "",
                     "params": s.manifest.params_name or "",
                     "model": str(key_path(s.params, "model", "name") or ""),
                     "TP (GPUs)": s.tensor_parallel if s.tensor_parallel is not None else MISSING,
                     "status": s.status, "created": s.manifest.created or "",
                     "peak output tok/s": h.peak_text() if h else MISSING,
                     "TPOT p50 (ms)": h.tpot_text() if h else MISSING,
                     "bottleneck": h.bottleneck_text() if h else MISSING,
                     "params from": s.params_from})
    return pd.DataFrame(rows)


def phases_table(sources: list[Source]) -> pd.DataFrame:
    phases = list(dict.fromkeys([*PHASES, *(p for s in sources for p in s.manifest.phases)]))
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
def profile_summaries(src: Source) -> dict[Optional[int], ProfileSummaryView]:
    """The source's profile summaries by profiled concurrency: data/profile/c<N>/profile_summary.json,
    else data/profile_summary.json (keyed by its `concurrency`, None when it has none); of any version
    (decodescope.schema.views)."""
    out: dict[Optional[int], ProfileSummaryView] = {}
    for p in sorted((src.data_dir / "profile").glob("c*/profile_summary.json")):
        m = re.fullmatch(r"c(\d+)", p.parent.name)
        summary = _summary(p)
        if m and summary is not None:
            out[int(m.group(1))] = summary
    if not out:
        summary = _summary(src.data_dir / "profile_summary.json")
        if summary is not None:
            out[summary.concurrency] = summary
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def _summary(path: Path) -> Optional[ProfileSummaryView]:
    try:
        return read_view(path, ProfileSummaryView)
    except RecordError:
        return None


def step_categories(summary: ProfileSummaryView) -> pd.DataFrame:
    """Per category: time and calls per step, the median over ranks (a rank without the category
    counts 0), from a profile summary's per_step_categories."""
    cols = ["category", "time_per_step_us", "calls_per_step"]
    if not summary.per_step_categories:
        return pd.DataFrame(columns=cols)
    cats = frame(summary.per_step_categories, StepCategoryView)
    cats["calls_per_step"] = pd.to_numeric(cats["calls_per_step"], errors="coerce")
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


def category_differences(summaries: dict[str, Optional[ProfileSummaryView]]) -> pd.DataFrame:
    """Per category, each source against the base: time per step (us) and calls per step, with
    their differences and the call (stats.differ; one profile per source: `no repeats`). A category
    one source lacks counts 0 there."""
    cats = {k: (None if s is None else step_categories(s)) for k, s in summaries.items()}
    have = {k: c for k, c in cats.items() if c is not None and len(c)}  # the frames themselves: not None
    allcats = list(dict.fromkeys(c for k in have for c in have[k]["category"]))
    filled = {k: (have[k].set_index("category").reindex(allcats).fillna(0.0).reset_index() if k in have else None)
              for k in cats}
    t = pair_differences(filled, ["category"], "time_per_step_us")
    c = pair_differences(filled, ["category"], "calls_per_step")
    if t.empty:
        return pd.DataFrame(columns=["category", "class", "run", "base", "time_a_us", "time_b_us", "delta_us",
                                     "delta_pct", "calls_a", "calls_b", "delta_calls", "call"])

    out = t.rename(columns={"median_a": "time_a_us", "median_b": "time_b_us", "delta": "delta_us"})
    calls = c.set_index(["category", "run"])
    out["calls_a"] = [calls.loc[(k, r), "median_a"] for k, r in zip(out["category"], out["run"])]
    out["calls_b"] = [calls.loc[(k, r), "median_b"] for k, r in zip(out["category"], out["run"])]
    out["delta_calls"] = out["calls_b"] - out["calls_a"]
    out["class"] = out["category"].map(class_of)
    return out[["category", "class", "run", "base", "time_a_us", "time_b_us", "delta_us", "delta_pct",
                "calls_a", "calls_b", "delta_calls", "low", "high", "call"]]


def step_differences(summaries: dict[str, Optional[ProfileSummaryView]]) -> pd.DataFrame:
    """The step's own medians (wall, busy, summed, idle, period) per source against the base."""
    frames: dict[str, Optional[pd.DataFrame]] = {}
    for k, s in summaries.items():
        if s is None:
            frames[k] = None
            continue
        per = s.per_step
        frames[k] = pd.DataFrame([{"figure": label, "value_us": per.get(key)} for key, label in STEP_FIGURES
                                  if per.get(key) is not None])
    return pair_differences(frames, ["figure"], "value_us")


def category_figure(summaries: dict[str, Optional[ProfileSummaryView]], sources: list[Source]) -> go.Figure:
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
