"""The trace table -> the pieces the critical path is walked over (critpath.Pieces), and their labels.

GPU traces: each kernel, memcpy and memset is a piece on its stream; the kept CPU calls (launches, the
communication ops) are cut into pieces on their thread, and a GPU piece links to the call that launched
it by correlation id (a CUDA graph's kernels all carry its launch's). CPU traces: each thread's nested
ops are cut at their children, so a piece is one stretch of an op's self time, except a collective, kept
whole (what it calls is part of its transfer). A collective's k-th call of its category on every rank is
one instance, as trace.analyze.collective_skew matches them. A collective's wait is part of its instance:
on CPUs a rank's wait op (gloo's wait_tensor after its async all-reduce) joins the instance of the latest
collective that rank issued before it and waits for it (Pieces.member_wait); on GPUs a wait kernel (a
symmetric-memory barrier) is an instance of its own, entered by every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from decodescope.trace.analyze import thread_order
from decodescope.trace.categorize import default_rules
from decodescope.critpath.path import Pieces
from decodescope.trace.cscan import library
from decodescope.trace.nesting import parents_in_order, prev_in_thread

CALL_CATS = ("cuda_runtime", "cuda_driver", "cpu_op")
# host calls that return only once GPU work has ended: their time up to that end is the GPU's
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "dispatch_combine", "other")
LAUNCH_CATEGORY = "launch"  # a CUDA runtime or driver call on the path
HOST_CATEGORY = "host"  # a CPU op of a GPU trace (a collective's enqueue) on the path


def collective_categories() -> set[str]:
    rules = default_rules()
    return {c for kind in COLLECTIVES for c in rules.categories(collective=kind)}


def wait_categories() -> set[str]:
    """The categories of a rank's wait for a collective (collective: wait in the category rules)."""
    return set(default_rules().categories(collective="wait"))


@dataclass
class Labelled:
    """The pieces, and per piece: its name and category (codes into sorted lists of distinct labels: equal
    codes, equal labels; `name` and `category` make the arrays of str), its lane's number (stream or thread
    id: `lane_tid` per lane, `lane_id` per piece) and whether the source row is a GPU op (`op` is its row in
    the op table, -1 for a CPU call of a GPU trace)."""

    pieces: Pieces
    name_code: np.ndarray
    name_labels: np.ndarray
    category_code: np.ndarray
    category_labels: np.ndarray
    lane_tid: np.ndarray
    op: np.ndarray

    @property
    def name(self) -> np.ndarray:
        return self.name_labels[self.name_code]

    @property
    def category(self) -> np.ndarray:
        return self.category_labels[self.category_code]

    @property
    def lane_id(self) -> np.ndarray:
        return self.lane_tid[self.pieces.lane]


def codes(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """A column's values as (codes, labels): labels[codes] is the array of str .astype(str) gives, one str
    per distinct value (a categorical's categories; a missing value's label is "nan")."""
    c = col if isinstance(col.dtype, pd.CategoricalDtype) else col.astype("category")
    labels = np.array([str(v) for v in c.cat.categories] + ["nan"], dtype=object)
    raw = c.cat.codes.to_numpy().astype(np.int32)
    return np.where(raw < 0, np.int32(len(labels) - 1), raw), labels


def joint_codes(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list[np.ndarray], np.ndarray]:
    """(codes, labels) of several parts -> each part's codes into one list of labels, their distinct values
    sorted (so codes compare and sort as their labels do), in the smallest integer that holds them."""
    labels, inv = np.unique(np.concatenate([lab for _, lab in parts]), return_inverse=True)
    dtype = np.int16 if len(labels) < 2**15 else np.int32
    out, at = [], 0
    for c, lab in parts:
        out.append(inv.reshape(-1)[at:at + len(lab)].astype(dtype)[c])
        at += len(lab)
    return out, labels


def _parents(order: np.ndarray, rank: np.ndarray, tid: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each row's parent position in `order` (rows by rank, thread, start, longest first); -1 at top level."""
    prev = prev_in_thread(len(ts), tid[order], rank[order]).astype(np.int64)
    return parents_in_order(prev, ts[order], end[order]).astype(np.int64)


def _inside(parent: np.ndarray, mark: np.ndarray) -> np.ndarray:
    """Rows with a marked ancestor."""
    out = np.zeros(len(parent), dtype=bool)
    anc = parent.copy()
    while (anc >= 0).any():
        up = anc >= 0
        out[up] |= mark[anc[up]]
        anc[up] = parent[anc[up]]
    return out


def cut_nested(rank, tid, ts, end, whole=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nested ops of each thread -> (row, start, end) of their self-time stretches, in (rank, thread,
    start) order; rows marked `whole` are not cut and what they hold is dropped. One sweep in C
    (_kscan.c: cp_cut) where the scanner is built and the times are numbers, numpy passes elsewhere."""
    rank, tid = np.asarray(rank, dtype=np.int64), np.asarray(tid, dtype=np.int64)
    ts, end = np.asarray(ts, dtype=np.float64), np.asarray(end, dtype=np.float64)
    order = thread_order(rank, tid, ts, end - ts)
    lib = library()
    if lib is None or np.isnan(ts).any() or np.isnan(end).any():
        return _cut_in_numpy(order, rank, tid, ts, end, whole)
    args = [np.ascontiguousarray(a) for a in (order.astype(np.int64, copy=False), rank, tid, ts, end)]
    flags = None if whole is None else np.ascontiguousarray(whole, dtype=np.uint8)
    ptrs = [a.ctypes.data for a in args] + [None if flags is None else flags.ctypes.data]
    n = lib.cp_cut(len(ts), *ptrs, None, None, None)  # counted first, then written into arrays of that size
    out = (np.empty(max(n, 0), np.int64), np.empty(max(n, 0)), np.empty(max(n, 0)))
    if n < 0 or lib.cp_cut(len(ts), *ptrs, *(a.ctypes.data for a in out)) != n:
        raise MemoryError(f"cp_cut: no memory to cut {len(ts)} nested ops into stretches")
    return out


def _cut_in_numpy(order, rank, tid, ts, end, whole) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cut_nested's reference: rows in `order` (by rank, thread, start, longest first), cut with vector passes."""
    parent = _parents(order, rank, tid, ts, end)
    s, e = ts[order], end[order]
    if whole is not None:
        drop = _inside(parent, np.asarray(whole)[order])
        keep = np.flatnonzero(~drop)
        remap = np.full(len(order), -1)
        remap[keep] = np.arange(len(keep))
        order, s, e, parent = order[keep], s[keep], e[keep], parent[keep]
        parent = np.where(parent >= 0, remap[np.clip(parent, 0, None)], -1)
    has = parent >= 0
    e = np.where(has, np.minimum(e, e[np.clip(parent, 0, None)]), e)  # a child ends inside its parent
    # first stretch of each op: from its start to its first child's start (or its end)
    first_child = np.full(len(s), np.inf)
    np.minimum.at(first_child, parent[has], s[has])
    head_end = np.minimum(first_child, e)
    # after each child: its parent, from the child's end to the next sibling's start (or the parent's end)
    kids = np.flatnonzero(has)
    kids = kids[np.lexsort((s[kids], parent[kids]))]
    nxt = np.r_[kids[1:], -1]
    same = np.r_[parent[kids[1:]] == parent[kids[:-1]], False]
    after_end = np.where(same, s[np.clip(nxt, 0, None)], e[parent[kids]])
    rows = np.r_[np.arange(len(s)), parent[kids]]
    starts = np.r_[s, e[kids]]
    ends = np.r_[head_end, after_end]
    ok = ends > starts
    rows, starts, ends = rows[ok], starts[ok], ends[ok]
    src = order[rows]
    by = np.lexsort((starts, tid[src], rank[src]))
    return src[by], starts[by], ends[by]


def pieces_of(events: pd.DataFrame, ops: pd.DataFrame) -> Labelled:
    """The pieces of a trace table and its op table (trace.analyze.op_table)."""
    gpu = ops.attrs.get("device") == "gpu"
    counted = ops["counted"].to_numpy(bool)
    waits = ops["category"].isin(wait_categories()).to_numpy() & counted
    coll = ops["category"].isin(collective_categories()).to_numpy() & counted
    if gpu:  # a barrier kernel: every rank enters it, an instance of its own
        coll, waits = coll | waits, np.zeros(len(ops), bool)
    rank, tid = ops["rank"].to_numpy(np.int64), ops["lane"].to_numpy(np.int64)
    rank32 = rank.astype(np.int32)  # a piece's rank, lane, op row, launch and group: 32 bits
    ts = ops["ts_us"].to_numpy(float)
    end = ts + ops["dur_us"].to_numpy(float)
    name, cat = codes(ops["name"]), codes(ops["category"])
    if gpu:
        row, s, e = np.arange(len(ops), dtype=np.int32), ts, end
        calls = events[events["cat"].isin(CALL_CATS).to_numpy()]
        c_rank, c_tid = calls["rank"].to_numpy(np.int64), calls["tid"].to_numpy(np.int64)
        c_ts = calls["ts_us"].to_numpy(float)
        c_row, c_s, c_e = cut_nested(c_rank, c_tid, c_ts, c_ts + calls["dur_us"].to_numpy(float))
        (names, c_name), name_labels = joint_codes([name, codes(calls["name"])])
        c_host = (calls["cat"] == "cpu_op").to_numpy()[c_row]
        (cats, c_cat), cat_labels = joint_codes([cat, (np.where(c_host, 0, 1), np.array([HOST_CATEGORY, LAUNCH_CATEGORY],
                                                                                           dtype=object))])
        parts = [[rank32, tid, s, e, row, names, cats, False],
                 [c_rank[c_row].astype(np.int32), c_tid[c_row], c_s, c_e, (-1 - c_row).astype(np.int32), c_name[c_row],
                  c_cat, True]]
    else:
        row, s, e = cut_nested(rank, tid, ts, end, whole=coll | waits)
        (names,), name_labels = joint_codes([name])
        (cats,), cat_labels = joint_codes([cat])
        parts = [[rank32[row], tid[row], s, e, row.astype(np.int32), names[row], cats[row], True]]
        del row
    lab = _assemble(parts, name_labels, cat_labels)
    lab.pieces.group[:] = _groups(lab, ops, coll)
    if waits.any():
        lab.pieces.member_wait = _join_waits(lab, waits)
    if gpu:
        lab.pieces.launch[:] = _launches(lab, ops, events)
        lab.pieces.wait = sync_waits(lab)
    return lab


def sync_waits(lab: Labelled) -> np.ndarray:
    """Per piece, the GPU piece a synchronizing call (SYNC_CALLS) waited for (-1: none): of its rank's GPU
    pieces, the last to end by the call's end, where that end falls inside the call. Such a call's piece
    is made to start at that end (it stays in its lane's order: the start moves later within the piece).
    Which stream's work the call waited for, the trace does not say; a piece of another stream that ended
    between the awaited one and the call's return (its last few microseconds) would be taken instead."""
    p = lab.pieces
    out = np.full(len(p), -1, np.int32)
    sync = np.isin(lab.name_labels, SYNC_CALLS)[lab.name_code] & p.on_cpu
    for r in np.unique(p.rank[sync]):
        gpu = np.flatnonzero(~p.on_cpu & (p.rank == r))
        by_end = gpu[np.argsort(p.end[gpu], kind="stable")]
        calls = np.flatnonzero(sync & (p.rank == r))
        at = np.searchsorted(p.end[by_end], p.end[calls], side="right") - 1
        g = by_end[np.clip(at, 0, None)]
        ok = (at >= 0) & (p.end[g] > p.start[calls]) if len(by_end) else np.zeros(len(calls), bool)
        out[calls[ok]] = g[ok]
    has = np.flatnonzero(out >= 0)
    p.start[has] = p.end[out[has]]
    return out


def _lane_ids(rank: np.ndarray, on_cpu: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Per piece (sorted by rank, on_cpu, thread): its lane, numbered in (rank, on_cpu, 40-bit thread) order."""
    key = ((rank.astype(np.int64) * 2 + on_cpu.astype(np.int64)) << 40) | (tid.astype(np.int64) & ((1 << 40) - 1))
    step = np.diff(key)
    if (step >= 0).all():  # the keys already in order (no negative thread id): no sort
        return np.r_[np.int32(0), np.cumsum(step > 0, dtype=np.int32)]
    return np.unique(key, return_inverse=True)[1].astype(np.int32).reshape(-1)


def _assemble(parts: list[list], name_labels: np.ndarray, cat_labels: np.ndarray) -> Labelled:
    """The parts' columns joined, sorted by (rank, on_cpu, thread, start) a column at a time, and each part's
    array let go once joined (one part comes in that order from cut_nested: nothing to sort)."""
    on_cpu = np.concatenate([np.full(len(p[2]), p[7]) for p in parts]).astype(bool)
    by = None
    if len(parts) > 1:
        s_, tid_, rank_ = (np.concatenate([np.asarray(p[k]) for p in parts]) for k in (2, 1, 0))
        by = np.lexsort((s_, tid_, on_cpu, rank_))
        del s_, tid_, rank_
        on_cpu = on_cpu[by]
    cols = []
    for k in range(7):
        c = np.asarray(parts[0][k]) if by is None else np.concatenate([np.asarray(p[k]) for p in parts])[by]
        for p in parts:
            p[k] = None
        cols.append(c)
    rank, tid, s, e, row, name, cat = cols
    n = len(s)
    lane = _lane_ids(rank, on_cpu, tid) if n else rank
    lane_tid = np.zeros(int(lane.max()) + 1 if n else 0, np.int64)
    lane_tid[lane] = tid
    del tid
    pieces = Pieces(rank=rank, lane=lane, on_cpu=on_cpu, start=s.astype(float, copy=False),
                    end=e.astype(float, copy=False), launch=np.full(n, -1, np.int32), group=np.full(n, -1, np.int32))
    return Labelled(pieces=pieces, name_code=name, name_labels=name_labels, category_code=cat,
                    category_labels=cat_labels, lane_tid=lane_tid, op=row.astype(np.int32, copy=False))


def _groups(lab: Labelled, ops: pd.DataFrame, coll: np.ndarray) -> np.ndarray:
    """The collective instance of each piece (-1: none): the k-th call of its category on every rank."""
    out = np.full(len(lab.op), -1)
    p = lab.pieces
    sel = np.flatnonzero((lab.op >= 0) & coll[np.clip(lab.op, 0, None)])
    n_ranks = len(np.unique(p.rank))
    if not len(sel) or n_ranks < 2:
        return out
    first = pd.DataFrame({"piece": sel, "op": lab.op[sel], "rank": p.rank[sel], "cat": lab.category_code[sel],
                          "start": p.start[sel]}).drop_duplicates("op")  # an op's first piece
    first = first.sort_values(["rank", "start"], kind="stable")
    first["k"] = first.groupby(["rank", "cat"]).cumcount()
    complete = first.groupby(["cat", "k"])["rank"].transform("nunique") == n_ranks
    first = first[complete]
    out[first["piece"].to_numpy()] = first.groupby(["cat", "k"]).ngroup().to_numpy()
    return out


def instance_codes(lab: Labelled) -> np.ndarray:
    """Per piece, the category code of the collective instance it belongs to (its entering pieces'
    category: a wait op counts as the collective it waits for); -1 for a piece of no instance."""
    p = lab.pieces
    out = np.full(len(p), -1, np.int64)
    rows = np.flatnonzero(p.group >= 0)
    if not len(rows):
        return out
    enters = rows if p.member_wait is None else rows[~p.member_wait[rows]]
    n = int(p.group[rows].max()) + 1
    of_group = np.full(n, -1, np.int64)
    of_group[p.group[enters]] = lab.category_code[enters]
    out[rows] = of_group[p.group[rows]]
    return np.where((out < 0) & (p.group >= 0), lab.category_code, out)


def path_category_codes(lab: Labelled) -> np.ndarray:
    """Per piece, the category it counts as on the path: its own, a collective's wait its instance's."""
    inst = instance_codes(lab)
    return np.where(inst >= 0, inst, lab.category_code)


def _join_waits(lab: Labelled, waits: np.ndarray) -> np.ndarray:
    """Each wait op's pieces join the instance of the latest collective its rank entered before the wait
    began and no earlier wait took (an async call is waited for once); returns the member_wait mask. A wait
    with no such collective, or one whose collective is no instance (not on every rank), stays alone."""
    p = lab.pieces
    out = np.zeros(len(p), bool)
    op = lab.op
    is_wait = (op >= 0) & waits[np.clip(op, 0, None)]
    entering = np.flatnonzero((p.group >= 0) & ~is_wait)
    for r in np.unique(p.rank[is_wait]):
        mine = entering[p.rank[entering] == r]
        # an instance's first piece on this rank is where the rank entered it
        g_first = pd.DataFrame({"g": p.group[mine], "s": p.start[mine]}).groupby("g")["s"].min()
        opened = list(zip(g_first.to_numpy().tolist(), g_first.index.to_numpy().tolist()))
        opened.sort()
        w_rows = np.flatnonzero(is_wait & (p.rank == r))
        w_ops = pd.DataFrame({"piece": w_rows, "op": op[w_rows], "s": p.start[w_rows]}).groupby("op").agg(
            s=("s", "min"), pieces=("piece", list)).sort_values("s")
        pending: list[int] = []
        at = 0
        for s0, pieces in zip(w_ops["s"].tolist(), w_ops["pieces"].tolist()):
            while at < len(opened) and opened[at][0] <= s0:
                pending.append(opened[at][1])
                at += 1
            if not pending:
                continue
            g = pending.pop()  # the latest collective issued before the wait
            idx = np.asarray(pieces)
            p.group[idx] = g
            out[idx] = True
    return out


def _launches(lab: Labelled, ops: pd.DataFrame, events: pd.DataFrame) -> np.ndarray:
    """Each GPU piece's launching call piece (-1: none found), by rank and correlation id."""
    p = lab.pieces
    out = np.full(len(p), -1)
    cpu = np.flatnonzero(lab.op < 0)
    # a CPU piece's op is -1 - its row among the CALL_CATS rows; their correlation ids
    corr_call = events.loc[events["cat"].isin(CALL_CATS).to_numpy(), "correlation"].to_numpy(np.int64)[-1 - lab.op[cpu]]
    has = corr_call >= 0
    call_at = pd.Series(cpu[has], index=pd.MultiIndex.from_arrays([p.rank[cpu][has], corr_call[has]]))
    call_at = call_at[~call_at.index.duplicated()]  # a call cut into pieces: its first
    gpu = np.flatnonzero(lab.op >= 0)
    corr = ops["correlation"].to_numpy(np.int64)[lab.op[gpu]]
    found = call_at.reindex(pd.MultiIndex.from_arrays([p.rank[gpu], corr])).to_numpy()
    ok = ~np.isnan(found) & (corr >= 0)
    out[gpu[ok]] = found[ok].astype(np.int64)
    return out
