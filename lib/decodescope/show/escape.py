"""The one place where text from params, files, logs or traces is made safe for HTML.

Every caption, table cell, note and header goes through these, so a run name, a model name, a server
log line or a trace op name is shown as text and never runs as markup.
"""
from __future__ import annotations

import html
import re

# code spans are escaped by the markdown renderer itself; everything else is escaped here
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_SCRIPT_URL = re.compile(r"\]\(\s*(javascript|vbscript|data):", re.I)


def html_text(value: object) -> str:
    """Any value as HTML text (quotes included, so it is safe inside attributes too)."""
    return html.escape(str(value), quote=True)


def markdown_text(markdown: str) -> str:
    """Markdown whose HTML characters outside code spans are escaped and whose links cannot run script:
    markdown formatting still works, markup from data does not."""
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(markdown):
        out.append(html.escape(markdown[pos:m.start()], quote=False))
        out.append(m.group(0))
        pos = m.end()
    out.append(html.escape(markdown[pos:], quote=False))
    return _SCRIPT_URL.sub(lambda m: "](unsafe-" + m.group(1) + ":", "".join(out))
