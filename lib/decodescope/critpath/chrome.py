"""The critical path as a Chrome-format trace (the JSON of chrome://tracing and Perfetto): to open beside
the engine's own rank traces, on the same clock.

One process, "decodescope critical path", holds:
- a `steps` track: one slice per step window (first rank's start to last rank's end), its number, kind and wall
  time in the args; a global instant at each step's start draws its boundary across every track;
- a `rank R: path` track per rank: the path's segments on that rank, each a slice: an op (its name; category,
  lane and whether on the CPU in the args), a collective's transfer (its instance, the late rank, this rank's
  arrival skew), or a gap (host, launch, idle). Segments of no rank (a step in which no piece ran) are on a
  `no rank: path` track. Every step's path slices sum to its wall time (critpath.py: the walk's invariant);
- a `rank R: collectives` track per rank: each collective instance in the steps, split into its `arrival skew`
  (this rank entered, the last rank had not: [its entry, the last entry]) and its `transfer` (from the last
  entry to its end), the late rank and the skew in the args, and whether it is on the path.

Timestamps are the rank traces' own (`ts`, microseconds, as torch.profiler wrote them: the trace table keeps
them unshifted), so both load together in one view. The slices' `cat` is the segment kind (op, transfer,
host, launch, idle) or `collective`; `args.step` names the step on every path slice.
"""
from __future__ import annotations

import gzip
import logging
from pathlib import Path

import numpy as np
import orjson
import pandas as pd

from decodescope.core.io import write_bytes_atomic
from decodescope.critpath.table import CriticalPaths
from decodescope.trace.reader import _generic, body_start, opened

try:  # the per-instance split of the collectives (critpath_split): each instance's class, where the tree has it
    from decodescope.critpath.split import collective_split
except ImportError:  # pragma: no cover - a tree without it: the instances without their class
    collective_split = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CHROME_TRACE = "critical_path.trace.json.gz"  # gzip: Perfetto, chrome://tracing and HTA open it as it is
CP_PID = 2_000_000_000  # above any Linux pid (pid_max <= 2^22): no clash with the rank traces' processes
STEPS_TID, NO_RANK_TID = 1, 2
PATH_KINDS = ("op", "transfer", "host", "launch", "idle")  # critpath.SEGMENT_KINDS: the path's slices' cat
GAP_NAMES = {"host": "host gap", "launch": "launch gap", "idle": "idle"}


def path_tid(rank: int) -> int:
    return NO_RANK_TID if rank < 0 else 100 + 2 * int(rank)


def collectives_tid(rank: int) -> int:
    return 101 + 2 * int(rank)


def _meta(tid: int, value, key: str = "name", what: str = "thread_name") -> dict:
    return {"ph": "M", "pid": CP_PID, "tid": tid, "name": what, "args": {key: value}}


def _instances(cp: CriticalPaths) -> pd.DataFrame:
    """Every collective instance on every rank, one row per (group, rank): the rank's entry (its first
    entering piece's start; a wait op joining the instance, Pieces.member_wait, does not enter it) and end
    (its last piece's end), the instance's last entry and late rank (the rank that entered last), its
    category and name (the late rank's entering piece's), and the step holding the last entry (-1: none).
    Where critpath.split is present, its class and the late rank's work before it join each row."""
    lab = cp.labelled
    p = lab.pieces
    rows = np.flatnonzero(p.group >= 0)
    cols = ["group", "rank", "entry_us", "end_us", "last_entry_us", "late_rank", "category", "name", "step"]
    if not len(rows):
        return pd.DataFrame(columns=cols)
    waits = getattr(p, "member_wait", None)
    enters = ~np.asarray(waits, bool)[rows] if waits is not None else np.ones(len(rows), bool)
    m = pd.DataFrame({"piece": rows, "group": p.group[rows].astype(np.int64), "rank": p.rank[rows].astype(np.int64),
                      "start": p.start[rows], "end": p.end[rows], "enters": enters})
    per = m.groupby(["group", "rank"]).agg(end_us=("end", "max")).reset_index()
    ent = m[m["enters"]].sort_values(["group", "start"], kind="stable")
    first = ent.groupby(["group", "rank"]).agg(entry_us=("start", "min")).reset_index()
    per = per.merge(first, on=["group", "rank"], how="inner")
    last = ent.groupby("group").tail(1).set_index("group")
    per["last_entry_us"] = last["start"].reindex(per["group"]).to_numpy()
    late_piece = last["piece"].reindex(per["group"]).to_numpy(np.int64)
    per["late_rank"] = p.rank[late_piece].astype(np.int64)
    per["category"] = lab.category_labels[lab.category_code[late_piece]].astype(str)
    per["name"] = lab.name_labels[lab.name_code[late_piece]].astype(str)
    w = cp.windows
    by = np.argsort(w["start_us"].to_numpy(float), kind="stable")
    starts, ends, steps = (w[c].to_numpy()[by] for c in ("start_us", "end_us", "step"))
    t = per["last_entry_us"].to_numpy(float)
    pos = np.clip(np.searchsorted(starts, t, side="right") - 1, -1, None)
    ok = (pos >= 0) & (t < ends[np.clip(pos, 0, None)]) if len(starts) else np.zeros(len(t), bool)
    per["step"] = np.where(ok, steps[np.clip(pos, 0, None)] if len(starts) else -1, -1).astype(np.int64)
    per = per[cols]
    if collective_split is None:
        return per
    split = collective_split(cp, kind="all")  # a kind no step has: every step
    keep = [c for c in ("group", "instance_class", "late_work") if c in split.columns]
    return per.merge(split[keep], on="group", how="left") if "group" in keep and len(keep) > 1 else per


def _head(cp: CriticalPaths, ranks: list[int]) -> list[dict]:
    ev = [_meta(0, "decodescope critical path", what="process_name"), _meta(0, -1, "sort_index", "process_sort_index"),
          _meta(STEPS_TID, "steps"), _meta(STEPS_TID, 0, "sort_index", "thread_sort_index")]
    for r in ranks:
        ev += [_meta(path_tid(r), f"rank {r}: path"), _meta(path_tid(r), path_tid(r), "sort_index", "thread_sort_index"),
               _meta(collectives_tid(r), f"rank {r}: collectives"),
               _meta(collectives_tid(r), collectives_tid(r), "sort_index", "thread_sort_index")]
    if (cp.segments["rank"] < 0).any():
        ev.append(_meta(NO_RANK_TID, "no rank: path"))
    w = cp.windows
    for step, kind, s, wall, n in w[["step", "kind", "start_us", "wall_us", "ranks"]].itertuples(index=False):
        ev.append({"ph": "X", "pid": CP_PID, "tid": STEPS_TID, "cat": "step", "name": f"step {int(step)} ({kind})",
                   "ts": float(s), "dur": float(wall),
                   "args": {"step": int(step), "kind": str(kind), "wall_us": float(wall), "ranks": int(n)}})
        ev.append({"ph": "i", "s": "g", "pid": CP_PID, "tid": STEPS_TID, "cat": "step", "ts": float(s),
                   "name": f"step {int(step)} starts"})
    return ev


def _path_events(cp: CriticalPaths, inst: pd.DataFrame) -> list[dict]:
    """The path's segments, a slice each on its rank's path track; a transfer names its instance, the late
    rank and this rank's arrival skew."""
    seg, p = cp.segments, cp.labelled.pieces
    at = {(int(g), int(r)): k for k, (g, r) in enumerate(zip(inst["group"], inst["rank"]))}
    irec = inst.to_dict("records")
    ev = []
    cols = [seg[c].to_numpy() for c in ("step", "rank", "lane", "on_cpu", "piece", "start_us", "dur_us")]
    names, cats, kinds = (seg[c].astype(str).to_numpy() for c in ("name", "category", "segment"))
    for (step, rank, lane, on_cpu, piece, s, d), name, cat, kind in zip(zip(*cols), names, cats, kinds):
        args = {"step": int(step), "segment": kind, "category": cat, "lane": int(lane), "on_cpu": bool(on_cpu),
                "piece": int(piece)}
        k = at.get((int(p.group[piece]), int(rank))) if kind == "transfer" and piece >= 0 else None
        if k is not None:
            r = irec[k]
            args.update(instance=int(r["group"]), late_rank=int(r["late_rank"]),
                        arrival_skew_us=float(max(r["last_entry_us"] - r["entry_us"], 0.0)))
        label = (name or cat) if kind in ("op", "transfer") else GAP_NAMES.get(kind, kind)
        ev.append({"ph": "X", "pid": CP_PID, "tid": path_tid(int(rank)), "cat": kind, "name": label,
                   "ts": float(s), "dur": float(d), "args": args})
    return ev


def _collective_events(cp: CriticalPaths, inst: pd.DataFrame) -> list[dict]:
    """Each instance in a step on each rank's collectives track: its arrival skew (the rank's entry to the
    last entry) and its transfer (the last entry to the rank's end)."""
    seg, p = cp.segments, cp.labelled.pieces
    tr = seg.loc[(seg["segment"] == "transfer").to_numpy() & (seg["piece"].to_numpy() >= 0), "piece"].to_numpy()
    on_path = set(p.group[tr].tolist())
    ev = []
    for r in inst.to_dict("records"):
        if r["step"] < 0:
            continue
        s, e, last = float(r["entry_us"]), float(r["end_us"]), float(r["last_entry_us"])
        args = {"step": int(r["step"]), "collective": r["category"], "name": r["name"], "instance": int(r["group"]),
                "late_rank": int(r["late_rank"]), "arrival_skew_us": max(last - s, 0.0),
                "transfer_us": max(e - max(last, s), 0.0), "on_path": int(r["group"]) in on_path}
        args.update({k: r[k] for k in ("instance_class", "late_work") if isinstance(r.get(k), str)})
        tid = collectives_tid(int(r["rank"]))
        if last > s:
            ev.append({"ph": "X", "pid": CP_PID, "tid": tid, "cat": "collective", "ts": s, "dur": last - s,
                       "name": f"arrival skew: {r['category']} (waits for rank {int(r['late_rank'])})", "args": args})
        if e > max(last, s):
            ev.append({"ph": "X", "pid": CP_PID, "tid": tid, "cat": "collective", "ts": max(last, s),
                       "dur": e - max(last, s), "name": f"transfer: {r['category']}", "args": args})
    return ev


def chrome_events(cp: CriticalPaths) -> list[dict]:
    """The trace's events (see the module's docstring)."""
    ranks = sorted(int(r) for r in np.unique(cp.labelled.pieces.rank))
    inst = _instances(cp)
    return [*_head(cp, ranks), *_path_events(cp, inst), *_collective_events(cp, inst)]


def write_chrome_trace(cp: CriticalPaths, path: Path, source: str = "") -> Path:
    """The critical path's trace, written atomically to `path` (CHROME_TRACE by convention)."""
    trace = {"traceEvents": chrome_events(cp), "displayTimeUnit": "ms",
             "otherData": {"producer": "decodescope critical path", "clock": "the rank traces' ts (us)",
                           "source": source, "steps": int(len(cp.windows))}}
    data = orjson.dumps(trace, option=orjson.OPT_SERIALIZE_NUMPY)
    if str(path).endswith(".gz"):  # a level of the embedded default: 32 MB of JSON, 3 MB gzipped
        data = gzip.compress(data, compresslevel=6, mtime=0)
    out = write_bytes_atomic(Path(path), data)
    log.info("critical path of %d steps as a Chrome trace -> %s", len(cp.windows), out)
    return out


def read_chrome_trace(path: Path) -> pd.DataFrame:
    """A trace this module wrote (or any Chrome-format trace), read back through decodescope's streaming
    reader (trace.reader: the generic layout, every event kept): a DataFrame of ph, pid, tid, cat, name,
    ts_us, dur_us, args, and step (args.step; -1 where none)."""
    path = Path(path)
    with opened(path) as (meta, chunks):
        _, rest, layout = body_start(chunks, path, meta)
        events = [] if layout == "empty" else [e for batch in _generic(rest, chunks, path, meta) for e in batch]
    df = pd.DataFrame({"ph": [e.get("ph") for e in events], "pid": [e.get("pid") for e in events],
                       "tid": [e.get("tid") for e in events], "cat": [e.get("cat") for e in events],
                       "name": [e.get("name") for e in events],
                       "ts_us": pd.to_numeric(pd.Series([e.get("ts") for e in events], dtype=object)),
                       "dur_us": pd.to_numeric(pd.Series([e.get("dur") for e in events], dtype=object)),
                       "args": [e.get("args") or {} for e in events]})
    df["step"] = [int(a.get("step", -1)) if isinstance(a, dict) else -1 for a in df["args"]]
    return df
