"""What the arrival-skew/transfer split costs analyze-trace --critical-path: the same traces analysed in one
process with the split (collective_split + split_summary, and the bounds that free each part) and without it
(the shares, the waits and one bound per category, as before the split), each timed best of REPEATS; and
the whole command's ratio, the traces' read (load, op table, steps: timed once) added to both sides.

    python benchmarks/critpath_split_cost.py TRACE_DIR [TRACE_DIR ...]
"""
import sys
import time

from decodescope.trace.analyze import find_steps, op_table
from decodescope.trace.critpath_record import critical_path_summary
from decodescope.trace.critpath_split import collective_split, split_summary
from decodescope.trace.critpath_summary import attribution, collective_waits, fix_bounds
from decodescope.trace.critpath_table import critical_paths
from decodescope.trace.load import load_trace_dir

REPEATS = 3


def without_split(events, ops, steps):
    cp = critical_paths(events, ops, steps)
    seg = cp.segments
    cats = sorted({str(c) for c in seg.loc[seg["segment"].isin(["op", "transfer"]), "category"].unique()}
                  - {"host", "launch"})
    return attribution(cp, ops), collective_waits(cp), fix_bounds(cp, categories=cats)


def with_split(events, ops, steps):
    cp = critical_paths(events, ops, steps)
    return critical_path_summary(cp, ops, sorted(int(r) for r in ops["rank"].unique()))


def best(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(dirs: list[str]) -> None:
    print(f"{'traces':44s} {'steps':>5s} {'path w/o s':>10s} {'with s':>7s} {'ratio':>5s} {'split s':>7s} "
          f"{'+ read s':>8s} {'whole ratio':>11s}")
    for d in dirs:
        t0 = time.perf_counter()
        loaded = load_trace_dir(d)
        ops = op_table(loaded.events)
        steps = find_steps(loaded.events, ops)
        read = time.perf_counter() - t0
        a = best(without_split, loaded.events, ops, steps)
        b = best(with_split, loaded.events, ops, steps)
        cp = critical_paths(loaded.events, ops, steps)
        c = best(lambda: split_summary(collective_split(cp), len(cp.windows)))
        print(f"{d[-44:]:44s} {len(cp.windows):5d} {a:10.3f} {b:7.3f} {b / a:5.2f} {c:7.3f} {read:8.3f} "
              f"{(read + b) / (read + a):11.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
