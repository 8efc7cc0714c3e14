"""Plotly figure builders: each takes a DataFrame with unit-suffixed columns and returns a figure."""
from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from decodescope.micro.bench import with_timing_columns

LINK_CLASS_ORDER = ["self", "nvlink", "pcie_switch", "host_bridge", "cross_socket", "unknown"]


def topology_heatmap(pairs: pd.DataFrame, title: str = "GPU-to-GPU links (nvidia-smi topo -m)") -> go.Figure:
    n = int(max(pairs.gpu_a.max(), pairs.gpu_b.max())) + 1
    rank = {c: i for i, c in enumerate(LINK_CLASS_ORDER)}
    z = [[None] * n for _ in range(n)]
    text = [[""] * n for _ in range(n)]
    for r in pairs.itertuples():
        z[r.gpu_a][r.gpu_b] = rank.get(r.link_class, len(LINK_CLASS_ORDER) - 1)
        text[r.gpu_a][r.gpu_b] = f"{r.code}<br>{r.link_class}"
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", showscale=False,
                               x=[f"GPU{i}" for i in range(n)], y=[f"GPU{i}" for i in range(n)],
                               colorscale="Viridis", zmin=0, zmax=len(LINK_CLASS_ORDER) - 1,
                               hovertemplate="%{y} - %{x}: %{text}<extra></extra>"))
    fig.update_layout(title=title, yaxis_autorange="reversed")
    return fig


def cpu_matmul_bars(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure(go.Bar(x=df["dtype"], y=df["gflops"], text=[f"{v:,.0f}" for v in df["gflops"]],
                           textposition="auto"))
    fig.update_layout(title="CPU matmul peak (stand-in roofline on a host with no GPU)",
                      xaxis_title="dtype", yaxis_title="GFLOP/s")
    return fig


# ---- serving -----------------------------------------------------------------------------------
def throughput_vs_concurrency(levels: pd.DataFrame, knee_level=None) -> go.Figure:
    lv = levels.sort_values("level")
    fig = go.Figure(go.Scatter(x=lv["level"], y=lv["output_throughput_tok_s"], mode="lines+markers",
                               name="output tok/s", hovertemplate="concurrency %{x}: %{y:,.0f} tok/s<extra></extra>"))
    if "client_suspect" in lv and lv["client_suspect"].any():
        sus = lv[lv["client_suspect"]]
        fig.add_trace(go.Scatter(x=sus["level"], y=sus["output_throughput_tok_s"], mode="markers",
                                 marker=dict(symbol="x", size=14, color="#cf222e"), name="client may have distorted"))
    if knee_level is not None:
        fig.add_vline(x=knee_level, line_dash="dash", annotation_text=f"knee at {knee_level}")
    fig.update_layout(title="Output throughput vs concurrency", xaxis_title="concurrency (requests in flight)",
                      yaxis_title="output tokens/s", xaxis_type="log")
    return fig


def latency_bands(levels: pd.DataFrame, metric: str, label: str) -> go.Figure:
    lv = levels.sort_values("level")
    ms = lambda c: lv[f"{metric}_{c}_us"] / 1e3  # noqa: E731
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=lv["level"], y=ms("p99"), mode="lines", line=dict(width=0), showlegend=False,
                             hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=lv["level"], y=ms("p50"), mode="lines", fill="tonexty", line=dict(width=0),
                             fillcolor="rgba(99,110,250,0.15)", name="p50-p99"))
    fig.add_trace(go.Scatter(x=lv["level"], y=ms("p90"), mode="lines", line=dict(dash="dot"), name="p90"))
    fig.add_trace(go.Scatter(x=lv["level"], y=ms("p50"), mode="lines+markers", name="p50"))
    fig.update_layout(title=f"{label} vs concurrency", xaxis_title="concurrency", yaxis_title=f"{label} (ms)",
                      xaxis_type="log")
    return fig


def latency_throughput_frontier(levels: pd.DataFrame) -> go.Figure:
    lv = levels.sort_values("level")
    fig = go.Figure(go.Scatter(x=lv["output_throughput_tok_s"], y=lv["tpot_p50_us"] / 1e3, mode="lines+markers+text",
                               text=[f"c={c}" for c in lv["level"]], textposition="top center"))
    fig.update_layout(title="Latency-throughput frontier", xaxis_title="output tokens/s",
                      yaxis_title="TPOT p50 (ms per output token)")
    return fig


def itl_distribution(requests: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    ok = requests[requests["ok"] & ~requests["warmup"]]
    for level, g in ok.groupby("level"):
        itl = [x / 1e3 for l in g["itl_us"] for x in l]
        fig.add_trace(go.Box(y=itl, name=f"c={level}", boxpoints=False))
    fig.update_layout(title="Inter-token latency per concurrency level", yaxis_title="ITL (ms)", yaxis_type="log")
    return fig


def failures_per_level(levels: pd.DataFrame) -> go.Figure:
    lv = levels.sort_values("level")
    fig = go.Figure([go.Bar(x=lv["level"].astype(str), y=lv["ok"], name="ok"),
                     go.Bar(x=lv["level"].astype(str), y=lv["failed"], name="failed",
                            text=lv["failure_reasons"], marker_color="#cf222e")])
    fig.update_layout(barmode="stack", title="Requests per level", xaxis_title="concurrency", yaxis_title="requests")
    return fig


def telemetry_over_time(server: pd.DataFrame, gpu: pd.DataFrame):
    """The server's running and waiting requests and KV-cache usage over the sweep, and per GPU its power
    and SM clock when NVML was sampled; each level shaded and named (serving.telemetry.timeseries's tables,
    x = sweep_s). None when nothing was sampled."""
    if server.empty and gpu.empty:
        return None
    # (title, [(column, trace name: None for one per GPU)], table, the column per GPU when there is one)
    wanted: list[tuple[str, list[tuple[str, str | None]]]] = [
        ("requests", [("running", "running"), ("waiting", "waiting")]),
        ("KV cache used (%)", [("kv_usage_pct", "KV cache")])]
    wanted = [(t, [(c, n) for c, n in cols if c in server]) for t, cols in wanted]
    panels: list[tuple[str, list[tuple[str, str | None]], pd.DataFrame, str | None]] = [
        (t, cols, server, None) for t, cols in wanted if cols]
    panels += [(title, [(col, None)], gpu, "gpu") for col, title in (("power_w", "GPU power (W)"),
                                                                     ("sm_clock_mhz", "SM clock (MHz)"))
               if col in gpu and gpu[col].notna().any()]
    if not panels:
        return None
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[p[0] for p in panels])
    for row, (title, cols, df, per) in enumerate(panels, start=1):
        for col, name in cols:
            groups = df.groupby(per) if per else [(None, df)]
            for key, g in groups:
                label = name or f"GPU {key}"
                # one legend entry per line: the server's once each, each GPU once (first GPU panel)
                first_gpu_panel = per is not None and all(p[3] is None for p in panels[:row - 1])
                fig.add_trace(go.Scatter(x=g["sweep_s"], y=g[col], mode="lines", name=label, legendgroup=label,
                                         showlegend=per is None or first_gpu_panel,
                                         hovertemplate=f"{label}: %{{y:.1f}} at %{{x:.1f}} s<extra></extra>"),
                              row=row, col=1)
        fig.update_yaxes(title_text=title, row=row, col=1)
    spans = pd.concat([server[["level", "sweep_s"]], gpu[["level", "sweep_s"]]]).groupby("level")["sweep_s"]
    for i, (level, lo) in enumerate(spans.min().sort_values().items()):
        hi = spans.max()[level]
        fig.add_vrect(x0=lo, x1=hi, fillcolor="#636efa" if i % 2 else "#00cc96", opacity=0.07, line_width=0,
                      row="all", col=1)
        fig.add_annotation(x=(lo + hi) / 2, y=1.0, xref="x", yref="y domain", yanchor="top", showarrow=False,
                           text=f"c={level}")
    fig.update_xaxes(title_text="seconds into the sweep (levels end to end)", row=len(panels), col=1)
    fig.update_layout(title="Server and GPU telemetry during the sweep", height=220 * len(panels) + 120)
    return fig


# ---- profile -----------------------------------------------------------------------------------
def category_stacked_bars(per_step: pd.DataFrame, step_kind: str) -> go.Figure:
    """Time per step by category, one bar per rank."""
    df = per_step.assign(category=per_step["category"].astype(str), rank=per_step["rank"].astype(str))
    order = df.groupby("category")["time_per_step_us"].sum().sort_values(ascending=False).index
    fig = go.Figure([go.Bar(x=g["rank"], y=g["time_per_step_us"] / 1e3, name=cat,
                            hovertemplate=f"{cat}<br>rank %{{x}}: %{{y:.3f}} ms/step<extra></extra>")
                     for cat in order for g in [df[df["category"] == cat]]])
    fig.update_layout(barmode="stack", title=f"Time per {step_kind} step by category, per rank",
                      xaxis_title="rank", yaxis_title="ms per step (median)")
    return fig


def step_timeline(ops: pd.DataFrame, steps: pd.DataFrame, step: int) -> go.Figure:
    """One step on every rank: each op a bar from its start, coloured by category."""
    sel = ops[ops["step"] == step]
    fig = go.Figure()
    for cat, g in sel.groupby(sel["category"].astype(str)):
        t0 = g["rank"].map(steps[steps["step"] == step].set_index("rank")["start_us"])
        y = [f"rank {r} / {l}" for r, l in zip(g["rank"], g["lane"])]
        fig.add_trace(go.Bar(x=g["dur_us"] / 1e3, base=(g["ts_us"] - t0) / 1e3, y=y, orientation="h", name=cat,
                             customdata=g["name"].astype(str),
                             hovertemplate="%{customdata}<br>start %{base:.3f} ms, %{x:.4f} ms<extra></extra>"))
    fig.update_layout(barmode="overlay", title=f"Step {step}: ops per rank and lane", xaxis_title="ms from step start",
                      height=300 + 30 * sel[["rank", "lane"]].drop_duplicates().shape[0])
    return fig


def collective_latency_histogram(calls: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    c = calls.assign(size=calls["msg_bytes"].map(lambda b: "size not recorded" if b != b or b < 0
                                                 else f"{b / 1024:,.1f} KiB"))
    for (cat, size), g in c.groupby([c["category"].astype(str), "size"]):
        fig.add_trace(go.Histogram(x=g["dur_us"], name=f"{cat}, {size}", opacity=0.7, nbinsx=60))
    fig.update_layout(barmode="overlay", title="Per-call collective latency by message size",
                      xaxis_title="duration (us)", yaxis_title="calls", xaxis_type="log")
    return fig


def expected_vs_observed_bars(expected: pd.DataFrame) -> go.Figure:
    df = expected.assign(label=[f"rank {r} {c}" for r, c in zip(expected["rank"], expected["collective"])])
    fig = go.Figure([go.Bar(x=df["label"], y=df["expected_per_step"], name="expected (arch)"),
                     go.Bar(x=df["label"], y=df["observed_per_step"], name="observed (trace)")])
    fig.update_layout(barmode="group", title="Collectives per decode step: expected vs observed",
                      yaxis_title="calls per step")
    return fig


def summed_vs_wall(busy: pd.DataFrame, step_kind: str) -> go.Figure:
    b = busy[busy["kind"] == step_kind] if step_kind in set(busy["kind"]) else busy
    med = b.groupby("rank")[["summed_us", "busy_us", "wall_us", "idle_us"]].median().reset_index()
    fig = go.Figure([go.Bar(x=med["rank"].astype(str), y=med[c] / 1e3, name=label)
                     for c, label in (("summed_us", "summed op time"), ("busy_us", "busy (union over lanes)"),
                                      ("wall_us", "wall-clock step"), ("idle_us", "idle"))])
    fig.update_layout(barmode="group", title=f"Summed vs wall time per {step_kind} step (median)",
                      xaxis_title="rank", yaxis_title="ms")
    return fig


def step_growth(growth: pd.DataFrame) -> go.Figure:
    """Per profiled level: each class's time per step stacked, with the wall step and the period
    (step + the host's time between steps) as lines."""
    g = growth.sort_values("concurrency")
    x = g["concurrency"].astype(str)
    classes = [c for c in g.columns if c.endswith("_us") and c not in
               ("wall_us", "period_us", "between_steps_us", "summed_us", "busy_us")]
    fig = go.Figure([go.Bar(x=x, y=g[c].fillna(0) / 1e3, name=c[:-3]) for c in classes])
    for col, label in (("wall_us", "wall-clock step"), ("period_us", "period (step + time between steps)")):
        if col in g and g[col].notna().any():
            fig.add_trace(go.Scatter(x=x, y=g[col] / 1e3, mode="lines+markers", name=label))
    fig.update_layout(barmode="stack", title="The decode step at each profiled level (median rank)",
                      xaxis_title="concurrency", yaxis_title="ms per step")
    return fig


# ---- micro-benchmarks ----------------------------------------------------------------------------
def gemm_time_vs_batch(gemm: pd.DataFrame, dtype: str) -> go.Figure:
    """Per op, measured time vs batch, with the roofline floor max(FLOPs/peak, bytes/bandwidth) dashed."""
    ok = gemm[(gemm["status"] == "ok") & (gemm["dtype"] == dtype)]
    fig = go.Figure()
    for op, g in ok.groupby("op"):
        g = g.sort_values("batch")
        fig.add_trace(go.Scatter(x=g["batch"], y=g["time_us"], mode="lines+markers", name=op, legendgroup=op))
        floor = _roofline_floor_us(g)
        if floor is not None:
            fig.add_trace(go.Scatter(x=g["batch"], y=floor, mode="lines", line=dict(dash="dot"), name=f"{op} roofline",
                                     legendgroup=op, showlegend=False, hoverinfo="skip"))
    fig.update_layout(title=f"GEMM time per call vs batch ({dtype}); dotted: roofline floor",
                      xaxis_title="batch (tokens per step)", yaxis_title="time per call (us)", xaxis_type="log",
                      yaxis_type="log")
    return fig


def _roofline_floor_us(g: pd.DataFrame):
    peak = g["peak_tflops"].iloc[0] if "peak_tflops" in g and g["peak_tflops"].notna().any() else None
    if not peak:
        return None
    groups = g["groups"] if "groups" in g else 1
    t_compute = 2 * g["m"] * g["n"] * g["k"] * groups / (peak * 1e12) * 1e6
    if "mem_gbps" in g and g["mem_gbps"].notna().any():
        t_memory = g["bytes"] / (g["mem_gbps"].iloc[0] * 1e9) * 1e6
        return pd.concat([t_compute, t_memory], axis=1).max(axis=1)
    return t_compute


def gemm_step_total(per_step: pd.DataFrame) -> go.Figure:
    fig = go.Figure([go.Scatter(x=g["batch"], y=g["step_gemm_us"] / 1e3, mode="lines+markers", name=dt)
                     for dt, g in per_step.groupby("dtype")])
    fig.update_layout(title="All GEMMs of one decode step (per rank) vs batch", xaxis_title="batch",
                      yaxis_title="ms per step", xaxis_type="log")
    return fig


def collective_latency_vs_size(coll: pd.DataFrame, fit: pd.DataFrame) -> go.Figure:
    ok = coll[(coll["part"] == "sweep") & (coll["status"] == "ok") & (coll["rank"] == coll["rank"].min())]
    ok = with_timing_columns(ok)
    fig = go.Figure()
    for (op, inplace, comm, timing), g in ok.groupby(["op", "inplace", "communicator", "timing"]):
        g = g.sort_values("bytes")
        name = f"{op} {comm} {timing} ({'in-place' if inplace else 'out-of-place'})"
        fig.add_trace(go.Scatter(x=g["bytes"], y=g["time_us"], mode="markers+lines", name=name,
                                 error_y=dict(type="data", symmetric=False, array=g["p90_us"] - g["time_us"],
                                              arrayminus=g["time_us"] - g["p10_us"])))
        f = fit[(fit["op"] == op) & (fit["inplace"] == inplace) & (fit.get("communicator", comm) == comm)
                & (fit.get("timing", timing) == timing)]
        if not f.empty:
            a, b = f["alpha_us"].iloc[0], f["beta_gbps"].iloc[0]
            xs = g["bytes"].sort_values()
            fig.add_trace(go.Scatter(x=xs, y=a + xs / (b * 1e9) * 1e6, mode="lines", line=dict(dash="dash"),
                                     name=f"fit {comm} {timing}: {a:.1f} us + n / {b:.2f} GB/s"))
    fig.update_layout(title="Collective latency vs message size", xaxis_title="bytes", yaxis_title="time (us)",
                      xaxis_type="log", yaxis_type="log")
    return fig


def burst_vs_batch(coll: pd.DataFrame) -> go.Figure:
    b = with_timing_columns(coll[(coll["part"] == "burst") & (coll["status"] == "ok")])
    b = b[b["rank"] == b["rank"].min()]
    fig = go.Figure([go.Scatter(x=g["batch"], y=g["time_us"] / 1e3, mode="lines+markers", name=f"{comm} {mode}",
                                customdata=g["calls"], hovertemplate="batch %{x}: %{y:.3f} ms for %{customdata} calls")
                     for (comm, mode), g in b.groupby(["communicator", "mode"])])
    fig.update_layout(title="All-reduce burst of one decode step vs batch", xaxis_title="batch",
                      yaxis_title="ms per step", xaxis_type="log")
    return fig


def all_to_all_vs_tokens(coll: pd.DataFrame) -> go.Figure:
    a = coll[(coll["part"] == "all_to_all") & (coll["status"] == "ok")]
    a = a[a["rank"] == a["rank"].min()]
    fig = go.Figure(go.Scatter(x=a["tokens_per_gpu"], y=a["time_us"], mode="lines+markers",
                               customdata=a["bytes"], hovertemplate="%{x} tokens/GPU (%{customdata} B): %{y:.1f} us"))
    fig.update_layout(title="All-to-all (expert-parallel dispatch size) vs tokens per GPU",
                      xaxis_title="tokens per GPU", yaxis_title="time (us)", xaxis_type="log", yaxis_type="log")
    return fig


# ---- verdict -------------------------------------------------------------------------------------
def attribution_bars(attribution: pd.DataFrame) -> go.Figure:
    df = attribution.assign(rank=attribution["rank"].astype(str))
    fig = go.Figure([go.Bar(x=g["rank"], y=100 * g["share"], name=cls,
                            hovertemplate=f"{cls}: %{{y:.1f}}% of the step's op time<extra></extra>")
                     for cls, g in df.groupby("cls")])
    fig.update_layout(barmode="stack", title="Where a decode step's time goes, per rank", xaxis_title="rank",
                      yaxis_title="% of summed op time per step")
    return fig


def projection_bars(proj: pd.DataFrame, wall_us: Optional[float]) -> go.Figure:
    """Projected TPOT per fix with its band, against the measured step (its line left out when the run
    has no profiled step: the step model priced the fixes without one)."""
    fig = go.Figure(go.Bar(y=proj["fix"], x=proj["tpot_us"] / 1e3, orientation="h",
                           error_x=dict(type="data", symmetric=False,
                                        array=(proj["tpot_high_us"] - proj["tpot_us"]) / 1e3,
                                        arrayminus=(proj["tpot_us"] - proj["tpot_low_us"]) / 1e3),
                           text=[f"{g:+.0f}%" for g in proj["gain_pct"]], textposition="auto",
                           hovertext=proj["assumptions"]))
    if wall_us is not None:
        fig.add_vline(x=wall_us / 1e3, line_dash="dash", annotation_text="measured step")
    fig.update_layout(title="Each fix priced on the measured step (TPOT, band from the step's overlap)",
                      xaxis_title="ms per output token", yaxis_autorange="reversed",
                      height=max(360, 28 * len(proj) + 120))
    return fig


def tpot_vs_throughput(curves: pd.DataFrame, measured_band: pd.DataFrame | None = None) -> go.Figure:
    """TPOT vs output tokens/s per GPU: the measured sweep (with its repeat band when there is one), the
    step model, and each fix as a curve with its band (shaded). Speculative-decoding curves beyond the
    first acceptance are hidden until clicked in the legend."""
    fig = go.Figure()
    seen_spec = 0
    for fix, g in curves.groupby("fix", sort=False):
        g = g.sort_values("batch")
        measured = fix == "measured (01)"
        visible: bool | str = True
        if fix.startswith("speculative"):
            seen_spec += 1
            visible = True if seen_spec == 1 else "legendonly"
        fig.add_trace(go.Scatter(x=g["tok_s_per_gpu"], y=g["tpot_us"] / 1e3, mode="lines+markers", name=fix,
                                 legendgroup=fix, visible=visible,
                                 line=dict(width=4 if measured else 2, dash=None if measured or fix != "step model" else "dot"),
                                 text=[f"batch {b:g}" for b in g["batch"]],
                                 hovertemplate="%{text}: %{y:.2f} ms/token, %{x:.1f} tok/s/GPU"))
        if (g["tpot_high_us"] > g["tpot_low_us"]).any():
            xs = list(g["batch"] * 1e6 / g["tpot_high_us"] * g["tok_s_per_gpu"] * g["tpot_us"] / (g["batch"] * 1e6))
            xs_low = list(g["batch"] * 1e6 / g["tpot_low_us"] * g["tok_s_per_gpu"] * g["tpot_us"] / (g["batch"] * 1e6))
            fig.add_trace(go.Scatter(x=xs + xs_low[::-1], y=list(g["tpot_high_us"] / 1e3) + list(g["tpot_low_us"][::-1] / 1e3),
                                     fill="toself", opacity=0.15, line=dict(width=0), name=f"{fix} band",
                                     legendgroup=fix, showlegend=False, visible=visible, hoverinfo="skip"))
    fig.update_layout(title="TPOT vs output tokens/s per GPU: measured, step model and each fix (bands shaded)",
                      xaxis_title="output tokens/s per GPU", yaxis_title="ms per output token (TPOT)",
                      height=520)
    return fig


def step_replay_bars(replay: pd.DataFrame) -> go.Figure:
    """The replayed step per batch: full, GEMMs only and collectives only, per mode."""
    fig = go.Figure()
    for (variant, mode), g in replay.groupby(["variant", "mode"]):
        g = g.sort_values("batch")
        fig.add_trace(go.Bar(x=g["batch"].astype(str), y=g["time_us"] / 1e3, name=f"{variant} ({mode})",
                             error_y=dict(type="data", symmetric=False, array=(g["p90_us"] - g["time_us"]) / 1e3,
                                          arrayminus=(g["time_us"] - g["p10_us"]) / 1e3)))
    fig.update_layout(barmode="group", title="The decode step replayed: full, GEMMs only, collectives only",
                      xaxis_title="batch", yaxis_title="ms per step (slowest rank, p10-p90)")
    return fig


def replay_vs_model(replay: pd.DataFrame) -> go.Figure:
    """Replayed step (03) and the step model's GEMMs + collectives per batch, per mode; model band as error bars."""
    fig = go.Figure()
    for mode, g in replay.groupby("mode"):
        g = g.sort_values("batch")
        fig.add_trace(go.Scatter(x=g["batch"], y=g["replay_us"] / 1e3, mode="lines+markers", name=f"replayed ({mode})"))
        fig.add_trace(go.Scatter(x=g["batch"], y=g["predicted_us"] / 1e3, mode="lines+markers", line=dict(dash="dot"),
                                 name=f"step model ({mode})",
                                 error_y=dict(type="data", symmetric=False, array=(g["high_us"] - g["predicted_us"]) / 1e3,
                                              arrayminus=(g["predicted_us"] - g["low_us"]) / 1e3)))
    fig.update_layout(title="The step replayed without the framework against the step model (GEMMs + collectives)",
                      xaxis_title="batch", yaxis_title="ms per step", xaxis_type="log")
    return fig


def variant_bars(variants: pd.DataFrame) -> go.Figure:
    """Per variant and level: measured TPOT, the baseline's, and the projection with its band."""
    d = variants[variants["tpot_p50_us"].notna()]
    x = [f"{r.variant} @ c={r.level}" for r in d.itertuples()]
    fig = go.Figure([go.Bar(x=x, y=d["baseline_tpot_p50_us"] / 1e3, name="baseline (measured)"),
                     go.Bar(x=x, y=d["tpot_p50_us"] / 1e3, name="variant (measured)")])
    if d["projected_tpot_us"].notna().any():
        fig.add_trace(go.Bar(x=x, y=d["projected_tpot_us"] / 1e3, name="variant (projected)",
                             error_y=dict(type="data", symmetric=False,
                                          array=(d["projected_high_us"] - d["projected_tpot_us"]) / 1e3,
                                          arrayminus=(d["projected_tpot_us"] - d["projected_low_us"]) / 1e3)))
    fig.update_layout(barmode="group", title="Variants: measured TPOT against the baseline and the projection",
                      yaxis_title="TPOT p50 (ms)")
    return fig


def spec_k_curves(spec_k: pd.DataFrame) -> go.Figure:
    """Speculative decoding's TPOT against k, per drafter and level: the projection as a line, the variants
    that ran a k as markers, the k projected best ringed."""
    fig = go.Figure()
    for (drafter, level), d in spec_k.sort_values("k").groupby(["drafter", "level"]):
        name = f"{drafter} drafter, c={level}"
        fig.add_trace(go.Scatter(x=d["k"], y=d["projected_tpot_us"] / 1e3, mode="lines", name=name + " (projected)",
                                 legendgroup=name))
        m = d[d["measured_tpot_us"].notna()]
        fig.add_trace(go.Scatter(x=m["k"], y=m["measured_tpot_us"] / 1e3, mode="markers", name=name + " (measured)",
                                 legendgroup=name, marker=dict(size=10, symbol="diamond")))
        best = d[d["best_projected"]]
        fig.add_trace(go.Scatter(x=best["k"], y=best["projected_tpot_us"] / 1e3, mode="markers", showlegend=False,
                                 legendgroup=name, marker=dict(size=16, symbol="circle-open")))
    fig.update_layout(title="Speculative decoding: TPOT against draft tokens k (ringed: the best k projected)",
                      xaxis_title="draft tokens a verify step (k)", yaxis_title="TPOT (ms)")
    return fig
