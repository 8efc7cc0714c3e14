"""What a fix of one category could buy at most: a step replayed with that category's pieces shorter.

Each piece starts once its dependencies allow: its binding one (critpath.link) plus the delay the trace
shows after it (host time, launch latency: what the fix leaves alone), the others with no delay; a
collective ends once its last rank has entered, plus its transfer. Replayed unchanged, a step takes
exactly its wall time; with a category's pieces shortened, no piece can start later than it did, so the
step's new wall time is the least a fix of that category leaves (the bound is on the trace's own
dependencies: it cannot know what a fix would add).

A piece still running at the step's end counts to its point there.
The replay walks a step's pieces one by one; it runs in C (_kscan.c: cp_replay, the same arithmetic in the
same order, so the bounds agree to the bit) where the scanner is built, in Python (replay_step) elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decodescope.critpath.path import LANE, LAUNCH, NONE, Links, Pieces, _lane_prev, lane_runs
from decodescope.trace.cscan import library


class _Flat:
    """The pieces and their links as Python lists, made once for all the replays."""

    def __init__(self, p: Pieces, ln: Links):
        self.start, self.end = p.start.tolist(), p.end.tolist()
        self.kind, self.pred, self.ready = ln.kind.tolist(), ln.pred.tolist(), ln.ready.tolist()
        self.group, self.entry = p.group.tolist(), ln.entry.tolist()
        self.lane_prev, self.launch = _lane_prev(p).tolist(), p.launch.tolist()


def ordered_lanes(p: Pieces) -> list[tuple[int, int, bool]]:
    """Each lane's run of pieces (critpath.lane_runs), and whether both their starts and their ends are in
    order (pieces that do not overlap): then a step's pieces on it are found by bisection."""
    def in_order(a: np.ndarray) -> bool:
        return bool((a[1:] >= a[:-1]).all())

    return [(a, b, in_order(p.start[a:b]) and in_order(p.end[a:b])) for a, b in lane_runs(p)]


def step_rows(p: Pieces, ln: Links, w0: float, w1: float,
              lanes: "list[tuple[int, int, bool]] | None" = None) -> np.ndarray:
    """The pieces of the step [w0, w1] in the order a replay takes them (a collective at its last entry);
    `lanes` (ordered_lanes) to find them lane by lane rather than with a pass over every piece."""
    if lanes is None:
        rows = np.flatnonzero((p.end > w0) & (p.start < w1))
    else:  # in position order, as the pass finds them
        parts = []
        for a, b, ordered in lanes:
            hi = a + int(np.searchsorted(p.start[a:b], w1, side="left")) if ordered else b
            lo = a + int(np.searchsorted(p.end[a:b], w0, side="right")) if ordered else a
            parts.append(np.arange(lo, hi) if ordered else
                         a + np.flatnonzero((p.end[a:b] > w0) & (p.start[a:b] < w1)))
        rows = np.concatenate(parts) if parts else np.flatnonzero((p.end > w0) & (p.start < w1))
    entry = ln.entry_at(rows)
    # a piece that waited for its instance's last entry comes at that entry; one that ended before it (an
    # async call) at its start, so that what follows it on its lane finds it placed
    key = np.where((entry > p.start[rows]) & (entry <= p.end[rows]), entry, p.start[rows])
    return rows[np.lexsort((p.start[rows], key))]


def replay_step(p: Pieces, ln: Links, w0: float, w1: float, scale: np.ndarray, flat: "_Flat | None" = None,
                rows: "np.ndarray | None" = None, gap_scale: "np.ndarray | None" = None,
                skew_free: bool = False) -> float:
    """The step [w0, w1]'s wall time with each piece's duration times `scale` (per piece: 0 = free), the
    delay before it (host time, launch latency) times `gap_scale` (per piece; None: as traced), and, with
    `skew_free`, every rank going on from a collective as if the others had entered when it did."""
    f = flat or _Flat(p, ln)
    rows = step_rows(p, ln, w0, w1) if rows is None else rows
    if not len(rows):
        return w1 - w0
    order = rows.tolist()
    start, end, kind, pred, ready = f.start, f.end, f.kind, f.pred, f.ready
    group, entry, lane_prev, launch = f.group, f.entry, f.lane_prev, f.launch
    sc = dict(zip(order, scale[rows].tolist()))
    gsc = dict(zip(order, gap_scale[rows].tolist())) if gap_scale is not None else {}
    waits = set(np.asarray(rows)[p.member_wait[rows]].tolist()) if p.member_wait is not None else set()
    s_new: dict[int, float] = {}
    e_new: dict[int, float] = {}
    members: dict[int, list[int]] = {}
    for i in order:
        if group[i] >= 0 and i not in waits:
            members.setdefault(group[i], []).append(i)

    def begin(i: int) -> float:
        k, j = kind[i], pred[i]
        if k == NONE or j < 0:
            t = start[i]
        else:
            base = s_new.get(j, start[j]) if k == LAUNCH else e_new.get(j, end[j])
            t = base + max(0.0, start[i] - ready[i]) * gsc.get(i, 1.0)
        lp, la = lane_prev[i], launch[i]
        if lp >= 0 and k != LANE:
            t = max(t, e_new.get(lp, end[lp]))
        if la >= 0 and k != LAUNCH:
            t = max(t, s_new.get(la, start[la]))
        return min(t, start[i])

    def finish(m: int, last_in: float) -> float:
        synced = entry[m] <= end[m]
        from_ = max(s_new[m], last_in) if synced and not skew_free else s_new[m]
        return from_ + (end[m] - max(start[m], entry[m] if synced else start[m])) * sc[m]

    for i in order:
        if i in e_new:
            continue
        g = group[i]
        if g < 0 or (i not in waits and entry[i] > end[i]):  # no collective, or an async call that did not wait
            s_new[i] = begin(i)
            e_new[i] = s_new[i] + (end[i] - start[i]) * sc[i]
            continue
        mem = members.get(g, [])
        todo = [m for m in mem if m not in e_new]  # the entering pieces not placed yet, placed together
        for m in todo:
            s_new[m] = begin(m)
        last_in = max((s_new[m] for m in mem), default=-np.inf)
        for m in todo:
            e_new[m] = finish(m, last_in)
        if i in waits:  # a wait: from its own start, until the instance's last entry and its transfer
            s_new[i] = begin(i)
            e_new[i] = finish(i, last_in)
    tail = w1 - float(np.minimum(p.end[rows], w1).max())
    # a piece still running at w1 counts to its point at w1, not to its end
    last_end = max(s_new[i] + (w1 - start[i]) * sc[i] if end[i] > w1 else e_new[i] for i in order)
    return last_end + tail - w0


def member_chains(p: Pieces, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, next): per position in `rows` (replay order), the position of its collective instance's first
    entering member and of the entering member after it (in that order; -1: none or the last); a wait
    member (Pieces.member_wait) has its instance's first, and no next."""
    g = p.group[rows]
    first, nxt = np.full(len(rows), -1, np.int64), np.full(len(rows), -1, np.int64)
    waits = p.member_wait[rows] if p.member_wait is not None else np.zeros(len(rows), bool)
    at = np.flatnonzero((g >= 0) & ~waits)
    at = at[np.argsort(g[at], kind="stable")]
    if not len(at):
        return first, nxt
    same = g[at[1:]] == g[at[:-1]]
    nxt[at[:-1][same]] = at[1:][same]
    heads = np.flatnonzero(np.r_[True, ~same])
    first[at] = np.repeat(at[heads], np.diff(np.r_[heads, len(at)]))
    w_at = np.flatnonzero((g >= 0) & waits)
    if len(w_at):  # a wait's instance's first entering member in this step, -1 where none is in it
        head_of = dict(zip(g[at[heads]].tolist(), at[heads].tolist()))
        first[w_at] = [head_of.get(x, -1) for x in g[w_at].tolist()]
    return first, nxt


class _CReplay:
    """replay_step in C: the pieces' arrays as C reads them (32-bit positions: fewer than 2**31 pieces), and
    its scratch (each piece's new start and end, and whether it is placed), made once for all the replays
    and touched at the replayed steps' pieces only."""

    def __init__(self, lib, p: Pieces, ln: Links):
        def f64(a):
            return np.ascontiguousarray(a, dtype=np.float64)

        def i32(a):
            return np.ascontiguousarray(a, dtype=np.int32)

        self.lib, self.end = lib, f64(p.end)
        self.cols = [f64(p.start), self.end, np.ascontiguousarray(ln.kind, dtype=np.int8), i32(ln.pred), i32(p.group),
                     f64(ln.group_entry), i32(p.lane), i32(p.rank), i32(p.launch)]
        self.scratch = [np.empty(len(p)), np.empty(len(p)), np.zeros(len(p), np.uint8)]  # pages made as touched
        self.wait = None if p.member_wait is None else np.ascontiguousarray(p.member_wait, dtype=np.uint8)

    def __call__(self, rows: np.ndarray, chains: tuple, scale: np.ndarray, w0: float, w1: float) -> float:
        """The step's wall time, `scale` per piece."""
        return self.replay(rows, chains, np.asarray(scale, dtype=np.float64)[rows], w0, w1)

    def replay(self, rows: np.ndarray, chains: tuple, row_scale: np.ndarray, w0: float, w1: float,
               row_gap_scale: "np.ndarray | None" = None, skew_free: bool = False) -> float:
        """The step's wall time, `row_scale` (and `row_gap_scale`, the delay before each) per piece of `rows`."""
        if not len(rows):
            return w1 - w0
        order = np.ascontiguousarray(rows, dtype=np.int64)
        row_scale = np.ascontiguousarray(row_scale, dtype=np.float64)
        gaps = None if row_gap_scale is None else np.ascontiguousarray(row_gap_scale, dtype=np.float64)
        ptrs = [a.ctypes.data for a in (order, *chains, *self.cols, row_scale, *self.scratch)]
        last_end = self.lib.cp_replay(len(order), *ptrs, w1, None if self.wait is None else self.wait.ctypes.data,
                                      None if gaps is None else gaps.ctypes.data, int(skew_free))
        tail = w1 - float(np.minimum(self.end[rows], w1).max())
        return last_end + tail - w0


@dataclass(frozen=True)
class Fix:
    """What a fix frees in a replay: the pieces whose `codes` (a per-piece code array passed to fix_walls by
    `field`) are among `codes` run `speedup` times faster; with `host`, the delay before each CPU piece is
    freed too; with `skew_free`, no rank waits for another to enter a collective."""

    name: str
    kind: str  # category | transfer | class | host | skew
    field: str = "category"
    codes: tuple = ()
    host: bool = False
    skew_free: bool = False


def fix_walls(p: Pieces, ln: Links, w0: np.ndarray, w1: np.ndarray, fields: dict, fixes: list,
              speedup: float = float("inf")) -> dict:
    """Per fix (Fix): each step's wall time with what the fix frees `speedup` times faster (inf: free).
    `fields` maps a Fix.field to its per-piece code array."""
    lib = library()
    fast = _CReplay(lib, p, ln) if lib is not None and len(p) < 2**31 else None
    flat = _Flat(p, ln) if fast is None else None
    walls: dict = {f.name: [] for f in fixes}
    scale = np.ones(len(p) if fast is None else 0)  # the Python replay's: read at each step's rows, set there
    gap = np.ones(len(p) if fast is None else 0)
    lanes = ordered_lanes(p)
    fast_by = 0.0 if np.isinf(speedup) else 1.0 / speedup
    for a, b in zip(w0.tolist(), w1.tolist()):  # one step's rows held at a time
        r = step_rows(p, ln, a, b, lanes)
        ch = member_chains(p, r) if fast is not None else ()
        cols = {k: v[r] for k, v in fields.items()}
        cpu = p.on_cpu[r]
        for f in fixes:
            hit = np.isin(cols[f.field], f.codes) if f.codes else np.zeros(len(r), bool)
            sc = np.where(hit, fast_by, 1.0)
            gs = np.where(cpu, fast_by, 1.0) if f.host else None
            if fast is not None:
                walls[f.name].append(fast.replay(r, ch, sc, a, b, gs, f.skew_free))
            else:
                scale[r] = sc
                if gs is not None:
                    gap[r] = gs
                walls[f.name].append(replay_step(p, ln, a, b, scale, flat, r, gap if gs is not None else None,
                                                 f.skew_free))
                gap[r] = 1.0
    return {k: np.array(v) for k, v in walls.items()}


def bounds(p: Pieces, ln: Links, w0: np.ndarray, w1: np.ndarray, category: np.ndarray,
           categories: list, speedup: float = float("inf")) -> dict:
    """Per category: each step's wall time with that category's pieces `speedup` times faster (inf: free).
    `category` per piece and `categories` alike: labels, or codes (critpath_pieces.Labelled.category_code)."""
    fixes = [Fix(name=str(k), kind="category", codes=(c,)) for k, c in enumerate(categories)]
    got = fix_walls(p, ln, w0, w1, {"category": np.asarray(category)}, fixes, speedup)
    return {c: got[str(k)] for k, c in enumerate(categories)}
