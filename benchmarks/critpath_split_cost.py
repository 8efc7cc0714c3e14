"""What the arrival-skew/transfer split costs analyze-trace --critical-path, in one process, each figure the
best of REPEATS:
- path w/o: the critical paths, shares, waits and one bound per category (the analysis before the split);
- + split: that plus the split (collective_split + split_summary) alone: its ratio is the split's cost;
- new: the summary 04 writes now (the split, and the bounds that free a collective's transfer, a class, the
  host and the skew: more replays);
- command: the whole `decodescope analyze-trace DIR --critical-path` (read, analysis, files written); its
  ratio is the command against the command less the split's own time.

    python benchmarks/critpath_split_cost.py TRACE_DIR [TRACE_DIR ...]
"""
import contextlib
import io
import sys
import tempfile
import time

from decodescope.cli.main import main as cli
from decodescope.trace.analyze import find_steps, op_table
from decodescope.critpath.record import critical_path_summary
from decodescope.critpath.split import collective_split, split_summary
from decodescope.critpath.summary import attribution, collective_waits, fix_bounds
from decodescope.critpath.table import critical_paths
from decodescope.trace.load import load_trace_dir

REPEATS = 3


def without_split(events, ops, steps):
    cp = critical_paths(events, ops, steps)
    seg = cp.segments
    cats = sorted({str(c) for c in seg.loc[seg["segment"].isin(["op", "transfer"]), "category"].unique()}
                  - {"host", "launch"})
    return cp, attribution(cp, ops), collective_waits(cp), fix_bounds(cp, categories=cats)


def plus_split(events, ops, steps):
    cp = without_split(events, ops, steps)[0]
    return split_summary(collective_split(cp), len(cp.windows))


def new_summary(events, ops, steps):
    cp = critical_paths(events, ops, steps)
    return critical_path_summary(cp, ops, sorted(int(r) for r in ops["rank"].unique()))


def command(d: str) -> None:
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        assert cli(["analyze-trace", d, "--critical-path", "--out", out]) == 0


def best(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(dirs: list[str]) -> None:
    print(f"{'traces':40s} {'steps':>5s} {'path w/o':>8s} {'+ split':>7s} {'ratio':>5s} {'new':>6s} {'ratio':>5s} "
          f"{'command':>7s} {'ratio':>5s}   (seconds)")
    for d in dirs:
        loaded = load_trace_dir(d)
        ops = op_table(loaded.events)
        steps = find_steps(loaded.events, ops)
        a = best(without_split, loaded.events, ops, steps)
        b = best(plus_split, loaded.events, ops, steps)
        c = best(new_summary, loaded.events, ops, steps)
        n = len(critical_paths(loaded.events, ops, steps).windows)
        whole = best(command, d)
        print(f"{d[-40:]:40s} {n:5d} {a:8.3f} {b:7.3f} {b / a:5.2f} {c:6.3f} {c / a:5.2f} {whole:7.3f} "
              f"{whole / (whole - (b - a)):5.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
