"""The critical path of each step across lanes and ranks, from plain arrays of pieces of work.

A piece is one stretch of one op on one lane: a GPU stream or a CPU thread of a rank.
The pieces of a lane never overlap (critpath/pieces.py cuts nested CPU ops into them).
A piece starts once its binding dependency is met.
That dependency is one of four:
- the piece before it on its lane;
- the CPU call that launched it: a GPU piece's correlation id, a CUDA graph's launch included;
- a piece on another stream of its rank that ended just before it: a cross-stream wait.
  The traces record no stream in cudaStreamWaitEvent.
  So a cross-stream wait is inferred only where nothing else explains the start.
  Likewise a rank's other CPU threads (an output thread woken by the main one, whose hand-over the trace
  does not record) wait for its main thread (the one with the most pieces): where such a piece started after
  a main-thread piece that ended later than its own lane's previous piece, that main-thread piece binds it.
- for a host call that waits for the GPU (cudaEventSynchronize and its kin), the GPU piece it waited for.
  Its piece starts where that GPU piece ended: the time before is the GPU's, not the host's.
A collective ends on every rank only after its last rank has entered it.
On an earlier rank, its time before that entry is waiting.
The path goes on from the last rank's entry.

The path is walked back from the step's end.
Every move sets the time at which the next segment ends to where the last one began.
So the segments (pieces, transfers, gaps) sum exactly to the step's wall time.
Runs of pieces each bound by the piece before on its lane are taken as a whole (index ranges).
So the walk's Python loop turns once per change of lane, not once per piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from decodescope.trace.cscan import library

# binding dependency of a piece's start
NONE, LANE, LAUNCH, CROSS, SYNC = 0, 1, 2, 3, 4
# segment kinds
OP, TRANSFER, HOST, LAUNCH_GAP, IDLE = 0, 1, 2, 3, 4
SEGMENT_KINDS = ("op", "transfer", "host", "launch", "idle")
CROSS_STREAM_US = 2.0  # a GPU piece starting this soon after another stream's piece ended waited for it


@dataclass
class Pieces:
    """Pieces sorted by (rank, lane, start): their lane ids are unique across ranks; `launch` is the
    position of the CPU piece that launched a GPU piece (-1: none); `group` numbers a collective
    instance, the same on every rank (-1: not a collective); `wait`, where given, the GPU piece a host
    call waited for (-1: none), the call's piece starting at that piece's end; `member_wait`, where given,
    marks the pieces of an instance that wait for it (gloo's wait_tensor after its async op): they do not
    enter it, so its last entry is its other pieces' latest start."""

    rank: np.ndarray
    lane: np.ndarray
    on_cpu: np.ndarray
    start: np.ndarray
    end: np.ndarray
    launch: np.ndarray
    group: np.ndarray
    wait: Optional[np.ndarray] = None
    member_wait: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.start)


@dataclass
class Links:
    """What each piece's start waited for: `kind` (NONE, LANE, LAUNCH, CROSS, SYNC) and `pred` (the piece), per
    piece. The rest is kept small and read through: `ready` (when the dependency allowed the start, at
    most the start; -inf: none) follows from kind and pred; a collective's `entry` (its last rank's entry,
    its start elsewhere) is its instance's (`group_entry`); `last` (the last rank's piece, where this rank
    entered early; -1 elsewhere) is kept for those pieces only (`late`, in order, and `late_last`); `head`
    (the nearest piece at or before each on its lane not bound by the one before) is found among those
    pieces (`heads`, in order). The properties make each per-piece array; the *_of methods read one."""

    pieces: Pieces
    kind: np.ndarray
    pred: np.ndarray
    group_entry: np.ndarray
    late: np.ndarray
    late_last: np.ndarray
    heads: np.ndarray

    @property
    def ready(self) -> np.ndarray:
        p, j = self.pieces, np.clip(self.pred, 0, None)
        dep = np.where(self.kind == LAUNCH, p.start[j], p.end[j])
        return np.where(self.kind == NONE, -np.inf, np.minimum(dep, p.start))

    def entry_at(self, idx: np.ndarray) -> np.ndarray:
        p = self.pieces
        g = p.group[idx]
        if not len(self.group_entry):  # no collective instance
            return p.start[idx]
        return np.where(g >= 0, self.group_entry[np.clip(g, 0, None)], p.start[idx])

    @property
    def entry(self) -> np.ndarray:
        return self.entry_at(np.arange(len(self.pieces)))

    @property
    def last(self) -> np.ndarray:
        out = np.full(len(self.pieces), -1, self.late_last.dtype)
        out[self.late] = self.late_last
        return out

    @property
    def head(self) -> np.ndarray:
        return self.heads[np.searchsorted(self.heads, np.arange(len(self.pieces)), side="right") - 1]

    def ready_of(self, j: int) -> float:
        k = self.kind[j]
        if k == NONE:
            return -np.inf
        q, p = int(self.pred[j]), self.pieces
        return min(float(p.start[q]) if k == LAUNCH else float(p.end[q]), float(p.start[j]))

    def last_of(self, i: int) -> int:
        at = int(np.searchsorted(self.late, i))
        return int(self.late_last[at]) if at < len(self.late) and self.late[at] == i else -1

    def entry_of(self, i: int) -> float:
        g = int(self.pieces.group[i])
        return float(self.group_entry[g]) if g >= 0 else float(self.pieces.start[i])

    def head_of(self, i: int) -> int:
        return int(self.heads[int(np.searchsorted(self.heads, i, side="right")) - 1])


def _lane_prev(p: Pieces, dtype=np.int64) -> np.ndarray:
    n = len(p)
    prev = np.arange(-1, n - 1, dtype=dtype)
    if n:
        prev[0] = -1
        prev[1:][(p.lane[1:] != p.lane[:-1]) | (p.rank[1:] != p.rank[:-1])] = -1
    return prev


def _collective_entries(p: Pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group_entry, late, late_last): per collective instance, its last entry over the ranks (the latest
    start of its entering pieces, member_wait ones left out); the pieces of an instance entered or waited
    on before that (in order), and the last rank's entering piece of each."""
    rows = np.flatnonzero(p.group >= 0)
    n_groups = int(p.group[rows].max()) + 1 if len(rows) else 0
    group_entry = np.zeros(n_groups)
    if not len(rows):
        return group_entry, rows, rows.copy()
    ent = rows if p.member_wait is None else rows[~p.member_wait[rows]]
    g = p.group[ent]
    order = np.lexsort((p.start[ent], g))  # by group, the last entry last
    ent, g = ent[order], g[order]
    tail = np.r_[g[1:] != g[:-1], True] if len(g) else np.zeros(0, bool)
    last_piece = np.full(n_groups, -1, np.int64)
    last_piece[g[tail]] = ent[tail]
    group_entry[g[tail]] = p.start[ent[tail]]
    last_of = last_piece[p.group[rows]]
    entry = group_entry[p.group[rows]]
    # where this rank's op ended before the last one entered, it did not wait for it (an async call)
    waited = (entry > p.start[rows]) & (entry <= p.end[rows]) & (last_of >= 0)
    late = rows[waited]
    by = np.argsort(late, kind="stable")
    return group_entry, late[by], last_of[waited][by]


def _cross_stream(p: Pieces, gpu: np.ndarray, ready: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, pieces): the GPU pieces (`gpu`, their dependencies ready at `ready`) whose start nothing else
    explains, and for each the piece of another stream of its rank that ended latest, within
    CROSS_STREAM_US, before it started (-1: none)."""
    want = gpu[ready < p.start[gpu] - CROSS_STREAM_US]
    out = np.full(len(want), -1)
    for r in np.unique(p.rank[want]):
        mine = gpu[p.rank[gpu] == r]
        by_end = mine[np.argsort(p.end[mine], kind="stable")]
        at = np.flatnonzero(p.rank[want] == r)
        w = want[at]
        pos = np.searchsorted(p.end[by_end], p.start[w], side="right")
        for back in (1, 2):  # the latest, or the one before where the latest is on the piece's own lane
            cand = pos - back
            ok = cand >= 0
            piece = by_end[np.where(ok, cand, 0)]
            ok &= (p.lane[piece] != p.lane[w]) & (p.end[piece] >= p.start[w] - CROSS_STREAM_US) & (out[at] < 0)
            out[at[ok]] = piece[ok]
    return want, out


def _thread_handoffs(p: Pieces, pred: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, pieces): the CPU pieces off their rank's main thread (its lane with the most CPU pieces) that
    started after the end of a main-thread piece later than their own dependency's end, and for each the
    latest such main-thread piece (critpath's module docstring)."""
    cpu = np.flatnonzero(p.on_cpu & ((kind == LANE) | (kind == NONE)))
    if not len(cpu):
        return cpu, cpu
    out_rows, out_pred = [], []
    for r in np.unique(p.rank[cpu]):
        mine = cpu[p.rank[cpu] == r]
        lanes, counts = np.unique(p.lane[mine], return_counts=True)
        if len(lanes) < 2:
            continue
        main_lane = lanes[np.argmax(counts)]
        main = np.flatnonzero(p.on_cpu & (p.rank == r) & (p.lane == main_lane))
        by_end = main[np.argsort(p.end[main], kind="stable")]
        off = mine[p.lane[mine] != main_lane]
        at = np.searchsorted(p.end[by_end], p.start[off], side="right") - 1
        has = at >= 0
        off, cand = off[has], by_end[at[has]]
        own = np.where(kind[off] == LANE, p.end[np.clip(pred[off], 0, None)], -np.inf)
        take = p.end[cand] > own
        out_rows.append(off[take])
        out_pred.append(cand[take])
    if not out_rows:
        return cpu[:0], cpu[:0]
    return np.concatenate(out_rows), np.concatenate(out_pred).astype(pred.dtype)


def link(p: Pieces) -> Links:
    """Each piece's binding dependency, found with vector passes over the pieces a launch or another stream
    may explain (the GPU ones): over the rest, nothing but the piece before on the lane, in 32 bits."""
    n = len(p)
    pos = np.int32 if n < 2**31 else np.int64  # positions of pieces: half the memory where they fit
    pred = _lane_prev(p, pos)
    kind = np.where(pred >= 0, np.int8(LANE), np.int8(NONE))
    at = np.flatnonzero(p.launch >= 0)  # launched: bound by the launch where it started later
    dep = np.where(pred[at] >= 0, p.end[np.clip(pred[at], 0, None)], -np.inf)
    by = at[p.start[p.launch[at]] > dep]
    kind[by], pred[by] = LAUNCH, p.launch[by]
    del at, dep, by
    gpu = np.flatnonzero(~p.on_cpu)
    j = np.clip(pred[gpu], 0, None)
    ready = np.where(kind[gpu] == LAUNCH, p.start[j], np.where(pred[gpu] >= 0, p.end[j], -np.inf))
    rows, cross = _cross_stream(p, gpu, ready)
    del gpu, j, ready
    rows = rows[cross >= 0]
    kind[rows], pred[rows] = CROSS, cross[cross >= 0]
    del rows, cross
    rows, woke = _thread_handoffs(p, pred, kind)
    kind[rows], pred[rows] = CROSS, woke
    del rows, woke
    if p.wait is not None:  # a host call bound by the GPU piece it waited for, where that ended after its lane's
        at = np.flatnonzero(p.wait >= 0)
        dep = np.where(kind[at] == LANE, p.end[np.clip(pred[at], 0, None)], -np.inf)
        by = at[p.end[p.wait[at]] > dep]
        kind[by], pred[by] = SYNC, p.wait[by]
        del at, dep, by
    group_entry, late, late_last = _collective_entries(p)
    plain = kind == LANE
    plain[late] = False
    heads = np.flatnonzero(~plain).astype(pos)
    del plain
    return Links(pieces=p, kind=kind, pred=pred, group_entry=group_entry, late=late.astype(pos),
                 late_last=late_last.astype(pos), heads=heads)


@dataclass
class Walk:
    """One step's path: `ranges` of pieces taken whole, (first, last, end of the last one's segment, start
    of the first one's), and the other segments, (piece, kind, start, end): a gap names the piece whose
    start it delayed."""

    ranges: list
    extra: list


def walk_step(p: Pieces, ln: Links, w0: float, w1: float, terminal: int) -> Walk:
    """The path of one step [w0, w1], back from `terminal` (the piece that ends the step)."""
    walk = Walk([], [])
    t = min(float(p.end[terminal]), w1)
    if t < w1:
        walk.extra.append((terminal, HOST if p.on_cpu[terminal] else IDLE, t, w1))
    i = terminal
    for _ in range(len(p) + 1):
        j = _take_run(p, ln, walk, i, t, w0)
        if j < 0:
            return walk
        while True:  # explain piece j's start; a launch call's own start in turn
            s = float(p.start[j])
            kind, pred = int(ln.kind[j]), int(ln.pred[j])
            g0 = w0 if kind == NONE else max(min(ln.ready_of(j), s), w0)
            if s > g0:
                gap = LAUNCH_GAP if kind == LAUNCH else (HOST if p.on_cpu[j] else IDLE)
                walk.extra.append((j, gap, g0, s))
            if kind == NONE or g0 <= w0:
                return walk
            if kind != LAUNCH:
                break
            j = pred
        i, t = pred, g0
    raise RuntimeError("critical path walk did not end: a dependency cycle in the pieces")


def lane_runs(p: Pieces) -> list[tuple[int, int]]:
    """Each lane's pieces, (first, end): a run of positions (the pieces come by rank, lane, start)."""
    cuts = np.r_[0, np.flatnonzero((p.lane[1:] != p.lane[:-1]) | (p.rank[1:] != p.rank[:-1])) + 1, len(p)]
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist())) if len(p) else []


def _latest(p: Pieces, key: np.ndarray, t: np.ndarray, side: Literal["left", "right"]) -> np.ndarray:
    """Per time in t: the piece with the greatest key at or before t (side "right") or before it ("left"),
    the last such piece where several share that key (-1: none): searched lane by lane (a lane's pieces
    come in start order, so a lane's keys are mostly in order already), not over the pieces sorted whole."""
    best = np.full(len(t), -1)
    best_key = np.zeros(len(t))
    for a, b in lane_runs(p):
        k = key[a:b]
        by = None if (k[1:] >= k[:-1]).all() else np.argsort(k, kind="stable")
        at = np.searchsorted(k, t, side=side, sorter=by) - 1
        found = at >= 0
        piece = a + (at if by is None else by[np.clip(at, 0, None)])
        kp = k[piece - a]
        take = found & ((best < 0) | (kp >= best_key))  # later lanes hold later pieces: a tie goes to them
        best[take], best_key[take] = piece[take], kp[take]
    return best


def terminals(p: Pieces, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """Per step window: the piece that ends it, the last to end by w1 (or one still running at w1);
    -1 where no piece falls in the window."""
    out = _latest(p, p.end, w1, "right")
    run = _latest(p, p.start, w1, "left")
    r = np.clip(run, 0, None)
    running = (run >= 0) & (p.start[r] < w1) & (p.end[r] > w1) & (p.start[r] >= w0)
    out = np.where(running, run, out)
    ok = out >= 0
    ok[ok] &= p.end[out[ok]] > w0[ok]
    return np.where(ok, out, -1)


def walk_all(p: Pieces, w0: np.ndarray, w1: np.ndarray) -> tuple[Links, list[Walk]]:
    """Each step window's path (an empty one where no piece falls in it)."""
    ln = link(p)
    ends = terminals(p, w0, w1)
    walks = []
    for a, b, t in zip(w0.tolist(), w1.tolist(), ends.tolist()):
        walks.append(walk_step(p, ln, a, b, t) if t >= 0 else Walk([], [(-1, IDLE, a, b)]))
    return ln, walks


def _take_run(p: Pieces, ln: Links, walk: Walk, i: int, t: float, w0: float) -> int:
    """Pieces head[i]..i onto the path (the segment of i ending at t); returns the piece whose start
    explains the run's (the last rank's piece of a collective this rank entered early), or -1 where the
    step starts inside the run."""
    h = ln.head_of(i)
    last = ln.last_of(h)
    lo = ln.entry_of(h) if last >= 0 else float(p.start[h])
    if lo > w0:
        walk.ranges.append((h, i, t, lo))
        return last if last >= 0 else h
    if i == h:
        walk.ranges.append((h, i, t, w0))
        return -1
    a = h + _ends_at_or_before(p, h, i, w0)
    if a > h and p.start[a] > w0:
        walk.extra.append((a, HOST if p.on_cpu[a] else IDLE, w0, float(p.start[a])))
    walk.ranges.append((a, i, t, max(w0, float(p.start[a])) if a > h else w0))
    return -1


def _ends_at_or_before(p: Pieces, h: int, i: int, t: float) -> int:
    """How many of pieces h..i-1 end their segment (their end, or the next piece's start) by t: what
    np.searchsorted(np.minimum(p.end[h:i], p.start[h + 1:i + 1]), t, side="right") gives, probing the
    same positions, without making the run's ends (a run can hold a lane's pieces since the trace began:
    made per step, they cost time and memory growing with the trace, not the step)."""
    end, start = p.end, p.start
    lo, hi = 0, i - h
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)
        k = h + mid
        if t < min(end[k], start[k + 1]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _range_segments(p: Pieces, walks: list[Walk]) -> list[list[np.ndarray]]:
    """The ranges' segments, all at once, as two parts of [step, piece, kind, start, end]: each piece's own,
    and the gap before it (the first piece of a range has none)."""
    rs = [(k, *r) for k, w in enumerate(walks) for r in w.ranges]
    if not rs:
        return []
    step, a, i = (np.array([r[c] for r in rs], dtype=np.int64) for c in range(3))
    t, lo = (np.array([r[c] for r in rs], dtype=float) for c in (3, 4))
    n = i - a + 1
    of = np.repeat(np.arange(len(rs)), n)
    idx = a[of] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    first, last = idx == a[of], idx == i[of]
    seg_end = np.where(last, t[of], np.minimum(p.end[idx], p.start[np.minimum(idx + 1, len(p) - 1)]))
    del last
    own = [step[of], idx, np.where(p.group[idx] >= 0, TRANSFER, OP), np.where(first, lo[of], p.start[idx]), seg_end]
    del of
    g = idx[~first]  # the gap before each piece after a range's first: from the one before's end
    gap = [own[0][~first], g, np.where(p.on_cpu[g], HOST, IDLE), np.minimum(p.end[g - 1], p.start[g]), p.start[g]]
    return [own, gap]


def segments(p: Pieces, walks: list[Walk]) -> dict[str, np.ndarray]:
    """Every step's segments as columns: step (position in `walks`), piece, kind, start_us, end_us;
    zero-length segments left out (each part filtered before the parts are joined)."""
    names = ["step", "piece", "kind", "start_us", "end_us"]
    parts = _range_segments(p, walks)
    extra = [(k, *x) for k, w in enumerate(walks) for x in w.extra]
    if extra:
        e = np.array(extra, dtype=float).reshape(-1, 5)
        parts.append([e[:, 0].astype(np.int64), e[:, 1].astype(np.int64), e[:, 2].astype(np.int64), e[:, 3], e[:, 4]])
    for k, part in enumerate(parts):
        keep = part[4] > part[3]
        parts[k] = [v[keep] for v in part]
    if not parts:
        return {c: np.empty(0, np.int64) if c in ("step", "piece", "kind") else np.empty(0) for c in names}
    return {c: np.concatenate([part[j] for part in parts]) for j, c in enumerate(names)}


def ordered_segments(p: Pieces, walks: list[Walk]) -> dict[str, np.ndarray]:
    """segments() in the table's order: step by step (`walks` in step order), by start within a step, at a
    tie as the parts were joined; `step` as int32 positions, `kind` as int8. Made in C where the scanner is
    built (_kscan.c: cp_segments: each step's few hundred sorted, nothing the size of the path made twice)."""
    lib = library()
    if lib is None:
        seg = segments(p, walks)
        order = np.lexsort((seg["start_us"], seg["step"]))
        return {c: v[order].astype(np.int32 if c == "step" else np.int8 if c == "kind" else v.dtype, copy=False)
                for c, v in seg.items()}
    rs = [r for w in walks for r in w.ranges]
    xs = [x for w in walks for x in w.extra]
    roff = np.r_[0, np.cumsum([len(w.ranges) for w in walks], dtype=np.int64)].astype(np.int64)
    xoff = np.r_[0, np.cumsum([len(w.extra) for w in walks], dtype=np.int64)].astype(np.int64)
    cols = [np.fromiter((r[c] for r in rs), np.int64 if c < 2 else np.float64, len(rs)) for c in range(4)]
    cols += [np.fromiter((x[c] for x in xs), (np.int64, np.int8, np.float64, np.float64)[c], len(xs)) for c in range(4)]
    cols += [np.ascontiguousarray(p.start, dtype=np.float64), np.ascontiguousarray(p.end, dtype=np.float64),
             np.ascontiguousarray(p.group, dtype=np.int32), np.ascontiguousarray(p.on_cpu, dtype=np.uint8)]
    args = [len(walks), len(p), roff.ctypes.data] + [c.ctypes.data for c in cols[:4]] + [xoff.ctypes.data] + \
        [c.ctypes.data for c in cols[4:]]  # cols holds every array C reads until it returns
    n = lib.cp_segments(*args, None, None, None, None, None)  # counted first, then written into arrays of that size
    out = {"step": np.empty(max(n, 0), np.int32), "piece": np.empty(max(n, 0), np.int64),
           "kind": np.empty(max(n, 0), np.int8), "start_us": np.empty(max(n, 0)), "end_us": np.empty(max(n, 0))}
    if n < 0 or lib.cp_segments(*args, *(v.ctypes.data for v in out.values())) != n:
        raise MemoryError(f"cp_segments: no memory to sort the segments of {len(walks)} steps")
    return out
