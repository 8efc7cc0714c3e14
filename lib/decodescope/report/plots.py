"""Plotly figure builders: each takes a DataFrame with unit-suffixed columns and returns a figure."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

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
