"""03's collectives probe with its ranks where the engine binds its workers (the plan's rank_cpus, from
server.env VLLM_CPU_OMP_THREADS_BIND) against the same probe unbound, side by side in one process, rounds
alternated: the probe's wall time and its small-message all-reduce figures, and the ratio bound/unbound.

    python benchmarks/probe_placement.py [PARAMS] [--rounds 2]

PARAMS defaults to params/default.yaml. Set DECODESCOPE_CPU_PATH=avx2 to run vLLM CPU's AVX2 path (gloo).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodescope.core.cpupath import apply_cpu_path_here  # noqa: E402
from decodescope.core.rundir import ensure_layout  # noqa: E402
from decodescope.micro.bench import run_collectives_probe  # noqa: E402
from decodescope.schema.params import load_params  # noqa: E402

BIND = "VLLM_CPU_OMP_THREADS_BIND"
SMALL_BYTES = 512


def figures(table) -> dict[str, float]:
    """Median per-call us of each (communicator, timing) all-reduce at SMALL_BYTES, rank 0."""
    t = table[(table["part"] == "sweep") & (table["op"] == "all_reduce") & (table["bytes"] == SMALL_BYTES)
              & (table["status"] == "ok") & (table["rank"] == 0)]
    return {f"{r.communicator} {r.timing}": float(r.time_us) for r in t.itertuples()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default=str(Path(__file__).resolve().parents[1] / "params/default.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = apply_cpu_path_here()
    bound = load_params(args.params)
    if not bound.server.env.get(BIND):
        raise SystemExit(f"{args.params}: server.env has no {BIND}: nothing to bind the ranks to")
    unbound = bound.model_copy(deep=True)
    unbound.server.env.pop(BIND)
    results: dict[str, list] = {"bound": [], "unbound": []}
    for i in range(args.rounds):
        for name, params in (("unbound", unbound), ("bound", bound)):
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = ensure_layout(Path(tmp) / "run")
                t0 = time.monotonic()
                table = run_collectives_probe(params, run_dir, "cpu")
                wall = time.monotonic() - t0
            results[name].append((wall, figures(table)))
            print(f"round {i + 1} {name:8s} {wall:6.1f} s  " + "  ".join(f"{k} {v:7.1f} us"
                                                                    for k, v in sorted(figures(table).items())))
    print(f"cpu path {path}, {BIND}={bound.server.env[BIND]!r}, median over {args.rounds} rounds, bound / unbound:")
    walls = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
    print(f"  probe wall time        {walls['bound']:7.1f} s vs {walls['unbound']:7.1f} s   x {walls['bound'] / walls['unbound']:.2f}")
    for key in sorted(results["bound"][0][1]):
        b = statistics.median(f[key] for _, f in results["bound"])
        u = statistics.median(f[key] for _, f in results["unbound"])
        print(f"  {key:22s} {b:7.1f} us vs {u:7.1f} us   x {b / u:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
