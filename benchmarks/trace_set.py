"""Traces of any size from a real capture: its decode steps repeated, written gzip'd as vLLM writes them.

The trace benchmark needs captures from 20 MB to 1 GB of JSON, and running vLLM long enough to profile
1 GB is neither quick nor repeatable. So a real capture (the embedded default's vLLM CPU TP=2 traces,
the GPU step replay's traces) is grown: the events inside its decode-step window (from the first decode
step's start to the last one's end, CPU and GPU timelines both) are appended again and again, each copy
shifted in time by the window's period and given new ids (External id, correlation, Ev Idx, flow ids),
until each rank file holds its share of the target size. The text keeps the capture's own layout (it is
edited, never re-serialized), and the file is gzip'd at level 9, as torch.profiler's export does for a
.gz path (vLLM's traces). Every rank file of the capture grows the same way, so a TP=2 capture gives two
rank files of half the target each. Front-end traces (vLLM's async_llm file) are left out: they are not
ranks, and HTA would read one as a rank.

python benchmarks/trace_set.py SRC_DIR OUT_DIR --name cpu_tp2 --mb 20 200 1000
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

DECODE_STEP = re.compile(r"execute_context_0\(0\)_generation_[1-9]\d*\(\d+\)")
EVENT = re.compile(r"\n  \{.*?\n  \}", re.S)
TS = re.compile(r'("ts": )(-?[0-9.]+)')
IDS = re.compile(r'("(?:External id|correlation|Ev Idx|id)": )(\d+)')
FRONTEND = re.compile(r"async_llm|api_server|frontend", re.I)


def _split(text: str) -> tuple[str, list[str], str]:
    """(header through '[', event texts, trailer from the closing ']')."""
    start = text.index("[", text.index('"traceEvents"')) + 1
    end = text.rindex("]")
    events = EVENT.findall(text, start, end)
    return text[:start], events, text[end:]


def _window(events: list[dict]) -> tuple[float, float, float]:
    """(start, end, period) of the decode steps: the span from the first decode step's start to the
    last one's end, and the distance one copy is shifted (the span plus one step spacing)."""
    steps = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "gpu_user_annotation")
                   and DECODE_STEP.fullmatch(str(e.get("name", ""))))
    if not steps:
        raise SystemExit("no decode step (execute_context_0(0)_generation_N(N)) in the capture")
    w0, w1 = steps[0][0], max(e for _, e in steps)
    starts = sorted({s for s, _ in steps})
    spacing = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else 0.1 * (w1 - w0)
    return w0, w1, (w1 - w0) + spacing


def grow_file(src: Path, dst: Path, target_json_bytes: int) -> int:
    """Write dst: src's events plus as many shifted copies of its decode window as reach the target;
    returns the JSON bytes written."""
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        text = f.read()
    head, texts, tail = _split(text)
    decoded = [json.loads(t) for t in texts]
    w0, w1, period = _window(decoded)
    in_window = [t for t, e in zip(texts, decoded)
                 if e.get("ph") in ("X", "s", "f") and isinstance(e.get("ts"), (int, float)) and w0 <= e["ts"] <= w1]
    id_stride = 1 + max([int(m.group(2)) for t in texts for m in IDS.finditer(t)] or [0])
    # whole copies of the window, then the first events of one more copy up to the target size
    need = target_json_bytes - (len(head) + len(",".join(texts)) + len(tail))
    blocks: list[list[str]] = []
    while need > 0:
        take, n = [], 0
        for t in in_window:
            if n >= need:
                break
            take.append(t)
            n += len(t) + 1
        blocks.append(take)
        need -= n

    def shifted(k: int, block: str) -> str:
        dt = k * period
        out = TS.sub(lambda m: f"{m.group(1)}{float(m.group(2)) + dt:.3f}", block)
        return IDS.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + k * id_stride}", out)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    written = 0
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as out:
        # metadata and the capture's own events first, the copies after, the trailer events last:
        # the order torch writes (one pass over its event buffer, then the profiler's own spans)
        first_trailer = next((i for i, e in enumerate(decoded) if e.get("cat") == "Trace"), len(texts))
        for part in (head, ",".join(texts[:first_trailer])):
            out.write(part)
            written += len(part)
        for k, block in enumerate(blocks, start=1):
            part = "," + shifted(k, ",".join(block))
            out.write(part)
            written += len(part)
        for part in ("," + ",".join(texts[first_trailer:]) if first_trailer < len(texts) else "", tail):
            out.write(part)
            written += len(part)
    tmp.replace(dst)
    return written


def grow_dir(src_dir: Path, out_dir: Path, target_json_mb: float) -> Path:
    """out_dir holding src_dir's rank traces grown to target_json_mb of JSON in all (split evenly);
    kept as it is when it already exists (the set is made once, then reused)."""
    out_dir = Path(out_dir)
    if (out_dir / "DONE").exists():
        return out_dir
    files = sorted(p for p in Path(src_dir).iterdir() if re.search(r"\.json(\.gz)?$", p.name))
    ranks = [p for p in files if not FRONTEND.search(p.name)]
    total = 0
    for p in ranks:
        dst = out_dir / (p.name if p.suffix == ".gz" else p.name + ".gz")
        total += grow_file(p, dst, int(target_json_mb * 1e6 / len(ranks)))
    (out_dir / "DONE").write_text(json.dumps({"source": str(src_dir), "json_bytes": total}))
    return out_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--name", default="trace", help="the sets are OUT_DIR/NAME_<MB>MB")
    ap.add_argument("--mb", type=float, nargs="+", required=True, help="target JSON MB of each trace set")
    args = ap.parse_args()
    for mb in args.mb:
        d = grow_dir(Path(args.src_dir), Path(args.out_dir) / f"{args.name}_{mb:g}MB", mb)
        print(d, json.loads((d / "DONE").read_text())["json_bytes"] / 1e6, "MB of JSON")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
