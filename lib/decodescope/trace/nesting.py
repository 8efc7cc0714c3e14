"""Which op a CPU op is nested in, found with vector passes only (numpy; no pandas): shared by the
table's self times (analyze.self_times) and the streamed reduction (stream.py)."""
from __future__ import annotations

import numpy as np

NEST_EPS_US = 1e-9  # an op is inside another when the other ends more than this after it starts


def parents_in_order(prev: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each row's parent, or -1 at top level.

    Rows come in (thread, start, longest first) order.
    `prev` is the row before in the same thread, -1 at a thread's first.
    A row's parent is the latest earlier row of its thread still open at its start.
    Open means it ends more than NEST_EPS_US after that start: what a stack of open ops would hold.

    The array `up` links each row to the latest earlier row of its thread that ends after it does.
    It is built by pointer jumping, in a few dozen vector passes.
    The parent is then a short walk along those links from the row before.
    Each hop skips rows already closed.
    `prev` is consumed: it becomes the result."""
    up = prev.copy()
    todo = np.flatnonzero(up >= 0)
    while len(todo):
        todo = todo[end[up[todo]] <= end[todo]]
        up[todo] = up[up[todo]]
        todo = todo[up[todo] >= 0]
    par = prev
    todo = np.flatnonzero(par >= 0)
    threshold = ts + NEST_EPS_US
    while len(todo):
        todo = todo[end[par[todo]] <= threshold[todo]]
        par[todo] = up[par[todo]]
        todo = todo[par[todo] >= 0]
    return par


def prev_in_thread(n: int, *keys: np.ndarray) -> np.ndarray:
    """For rows sorted by `keys` (thread first): the row before in the same keys, -1 at each first.
    32-bit positions where they fit: half the memory of the walks."""
    idx = np.int32 if n < 2**31 else np.int64
    prev = np.arange(-1, n - 1, dtype=idx)
    for key in keys:
        if n > 1:
            prev[1:][key[1:] != key[:-1]] = -1
    if n:
        prev[0] = -1
    return prev
