"""What a vLLM CPU server start costs with inductor's compile cache kept between starts, against a start that
finds it empty, side by side in one process: the embedded default's server (params/default.yaml) started
and stopped three times in a row.

    python benchmarks/server_start_cache.py [--params params/default.yaml] [--port 8799]

1. cold: the server's TMPDIR (server.env) a new, empty folder: its inductor cache, linked from the server's
   own folder to beside it (Engine.tmp_caches), empty (what the first start on a fresh machine pays);
2. warm: the same TMPDIR again (what a launch now gives every later start);
3. reference: the same TMPDIR, no link: the cache in the server's own folder, removed at teardown (what
   every start paid from 71129a0 to this change).
Each line: the start's wall (launch to healthy), vLLM's "init engine ... took" (profile, KV cache, warm-up,
the compile among them) and the CPU time of the server's processes up to healthy, their reaped children's
included (core-seconds, /proc).
"""
from __future__ import annotations

import argparse
import getpass
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))

from decodescope.exec.modeldir import resolve_model_dir  # noqa: E402
from decodescope.exec.server import VllmServer  # noqa: E402
from decodescope.exec.serverlaunch import launch_spec  # noqa: E402
from decodescope.schema.params import load_params  # noqa: E402

INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def tree_cpu_s(pids: list[int]) -> float:
    """User + system seconds of the live processes among pids and of the children they reaped (inductor's
    compiler processes)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def one_start(params, model: str, tokenizer: str, tmp_root: Path, linked: bool, log: Path) -> dict:
    server_env = {**params.server.env, "TMPDIR": str(tmp_root)}
    params = params.model_copy(update={"server": params.server.model_copy(update={"env": server_env})})
    spec = launch_spec(params, model, tokenizer)
    if not linked:
        spec = replace(spec, tmp_caches=[])
    cache_dir = tmp_root / spec.tmp_caches[0].format(user=getpass.getuser()) if linked else Path(spec.tmp_dir)
    t0 = time.monotonic()
    server = VllmServer.launch(spec, log, params.server.startup_timeout_s)
    try:
        wall_s = time.monotonic() - t0
        cpu_s = tree_cpu_s(server.process_tree())
        files = sum(1 for p in cache_dir.rglob("*") if p.is_file())
    finally:
        server.stop()
    init = INIT_ENGINE.findall(log.read_text(errors="replace"))
    return {"wall_s": wall_s, "init_engine_s": float(init[-1]) if init else float("nan"), "cpu_core_s": cpu_s,
            "cache_files": files}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default=str(REPO / "params/default.yaml"))
    ap.add_argument("--port", type=int, default=8799)
    args = ap.parse_args()
    params = load_params(args.params)
    params = params.model_copy(update={"server": params.server.model_copy(update={"port": args.port})})
    model, tokenizer = resolve_model_dir(params)
    with tempfile.TemporaryDirectory(prefix="ds-start-cache-") as tmp:
        root = Path(tmp)
        rows = []
        for label, linked in (("cold (empty cache)", True), ("warm (the cache kept)", True),
                              ("reference (cache in its folder)", False)):
            r = one_start(params, model, tokenizer, root, linked, root / f"server-{len(rows)}.log")
            rows.append((label, r))
            print(f"{label:32s} wall {r['wall_s']:6.1f} s  init engine {r['init_engine_s']:5.1f} s  "
                  f"CPU {r['cpu_core_s']:6.1f} core-s  files in its cache while up {r['cache_files']}", flush=True)
        warm, ref = rows[1][1], rows[2][1]
        print(f"warm / reference: wall {warm['wall_s'] / ref['wall_s']:.2f}, init engine "
              f"{warm['init_engine_s'] / ref['init_engine_s']:.2f}, CPU {warm['cpu_core_s'] / ref['cpu_core_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
