"""Showing figures and tables from notebooks so they work in JupyterLab and in the offline report.

A figure is displayed as plotly's own mimetype (JupyterLab renders it with its plotly extension) plus an
HTML div that calls the global `Plotly`; the report embeds plotly.js once and nbconvert keeps the div.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd
from IPython.display import HTML, Markdown, display

from decodescope.show.escape import html_text, markdown_text

FIGURE_HEIGHT_PX = 460


def figure_bundle(fig) -> dict:
    html = fig.to_html(full_html=False, include_plotlyjs=False, default_height=f"{FIGURE_HEIGHT_PX}px",
                       default_width="100%", config={"displaylogo": False, "responsive": True})
    return {"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/html": html,
            "text/plain": f"<plotly figure: {fig.layout.title.text or 'untitled'}>"}


def show(fig) -> None:
    """Displays a plotly figure; None shows nothing (a builder with nothing to draw says why in a note)."""
    if fig is not None:
        display(figure_bundle(fig), raw=True)


def show_table(df: pd.DataFrame, caption: Optional[str] = None, max_rows: int = 60) -> None:
    """A styled table; the caption says where the numbers came from. Cells, headers and caption are
    escaped: they hold names from params, traces and logs."""
    display(HTML(table_html(df, caption, max_rows)))


def table_html(df: pd.DataFrame, caption: Optional[str] = None, max_rows: int = 60) -> str:
    shown = df.head(max_rows)
    styler = (shown.style.format(precision=3, thousands=",", na_rep="–", escape="html")
              .format_index(escape="html", axis=1).hide(axis="index"))
    if caption:
        styler = styler.set_caption(html_text(caption))
    more = f"<p><em>{len(df) - max_rows} more rows in the data file.</em></p>" if len(df) > max_rows else ""
    return styler.to_html() + more


def show_note(markdown: str) -> None:
    """A note in markdown; text from data inside it is shown as text (see report.escape)."""
    display(Markdown(markdown_text(markdown)))
