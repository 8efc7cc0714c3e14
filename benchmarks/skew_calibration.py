"""The critical path's arrival skew against a known delay (issue 51, item 4; decodescope.micro.skewcal):

    python benchmarks/skew_calibration.py [--paths native,avx2] [--delays 0,50,250,1000] [--steps 10]
                                          [--lock /tmp/ds-heavy.lock] [--out benchmarks/results/cpu_skew_calibration.txt]

03's step replay (the embedded default model, params/default.yaml: TP=2, batch 1, the engine's communicator,
ranks bound as the engine binds them) on two real torchrun ranks, `--steps` steps profiled per setting, rank 1
spinning D us before each of a step's 10 collectives. Each trace set goes through decodescope's reader and
critical path, and critpath.split.collective_split attributes each instance's arrival skew. Per path
and delay: the attributed skew's median and p10-p90 over the instances, its error against the delay, whether
it recovers it (within 10% or 20 us), the share of instances that name rank 1 late, and beside them the raw
entry skew off the events (rank 1's entry minus rank 0's, the k-th collective of a step paired) and the
spin's own duration in the trace. native = this host's vLLM CPU path (shm all-reduce where AVX-512 is
there); avx2 = vLLM CPU's AVX2 path forced (gloo). With --lock each replay holds that lock (flock), one at
a time; the analysis runs outside it.
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodescope.micro import skewcal as sc  # noqa: E402
from decodescope.micro.bench import engine_rank_cpus  # noqa: E402
from decodescope.schema.params import load_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("skew_calibration")


@contextmanager
def held(lock_path: str | None):
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="native,avx2")
    ap.add_argument("--delays", default="0,50,250,1000")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skew-rank", type=int, default=1)
    ap.add_argument("--unbound", action="store_true",
                    help="leave the ranks unbound (default: bound as the engine binds them, VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--lock", default=None)
    ap.add_argument("--keep", default=None, help="keep the trace sets under this folder")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/cpu_skew_calibration.txt"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    params = load_params(REPO / "params/default.yaml")
    bind = None if args.unbound else engine_rank_cpus(params)
    plan = {**sc.phase_plan(params), "rank_cpus": bind}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="skewcal-"))
    rows = []
    for path in [p for p in args.paths.split(",") if p]:
        for delay in [float(d) for d in args.delays.split(",") if d]:
            out = root / f"{path}_d{delay:g}"
            t0 = time.monotonic()
            with held(args.lock):
                sc.run_skewed_replay(plan, out, delay, args.skew_rank, args.steps, cpu_path=path)
            row = sc.calibrate_dir(out, path)
            rows.append(row)
            log.info("%s  (%.0f s)", sc.setting_line(row), time.monotonic() - t0)
    table = sc.settings_table(rows)
    head = (f"# benchmarks/skew_calibration.py{' --unbound' if args.unbound else ''} --paths {args.paths} --delays {args.delays} --steps {args.steps}\n"
            f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, params/default.yaml TP=2 "
            f"batch 1, {len(plan['steps'][0]['program'])} ops a step, ranks bound to {bind or 'no cores (--unbound)'}; rank {args.skew_rank} late by inj_us before "
            "each collective\n# skew: critpath.split.collective_split per instance, median and p10-p90; "
            "err = median - inj; err_run = median - spin_us (the delay rank ran);\n# ok: err_run within 10% or 20 us of spin_us;\n# late=R: instances naming the delayed rank late; raw_med: "
            "entry skew off the events; spin_us: the injected_skew range in the trace; xfer_med: transfer\n")
    Path(args.out).write_text(head + table + "\n")
    sc.write_settings(Path(args.out).with_suffix(".json"), rows)
    print(head + table)
    return 0 if all(r.recovered for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
