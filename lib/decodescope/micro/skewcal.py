"""The critical path's arrival skew calibrated against a known one (issue 51, item 4).

03's step replay (decodescope.probes.step, real torchrun ranks, the engine's communicator) runs with
`--skew-us D --skew-rank R`: rank R spins D us before every collective. Its profile (one trace per rank,
steps marked as vLLM marks decode steps) goes through decodescope's own reader and critical path
(trace.load, trace.analyze, critpath.table) and critpath.split.collective_split attributes
each collective instance's arrival skew (last entry - first entry) and its late rank. The skew recovers
the delay where its median over the instances is within RECOVERY_SHARE or RECOVERY_US of the delay rank R
ran: its spin's median duration in the trace (the decodescope::injected_skew ranges). The spin is a wall-clock
wait for D, so it runs over D only where the rank loses its core at the spin's end (a busy host, gloo's own
threads): the path is asked to attribute the lateness the rank had, not the one asked for, and the error
against D is kept beside it.

Beside it, read off the same events without the critical path: each collective's entry on rank R minus
the other ranks' last entry, the k-th collective of a step on every rank paired (raw_entry_skew), and the
spin's own duration in the trace (the decodescope::injected_skew ranges): where the split misses, these
tell whether the injection or the attribution missed.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from decodescope.core.cpupath import AVX2_ENV, AVX2_ONLY_DIR, CPU_PATH_ENV, apply_cpu_path
from decodescope.core.cpupath import cpu_path as current_cpu_path
from decodescope.core.io import write_json_atomic
from decodescope.core.rundir import TRACES
from decodescope.exec.hostcore import LocalHost
from decodescope.exec.server import log_tail
from decodescope.micro.bench import (PROBE_SHM_GLOBS, TORCHRUN_LOG_DIR, run_torchrun_probe, save_step_replay,
                                     step_plan, step_replay_job)
from decodescope.schema.records_critpath import SkewCalibration, SkewCalibrationRow
from decodescope.schema.records_probe import read_probe_output
from decodescope.schema.recordbase import write_record
from decodescope.schema.rundata import SKEW_CALIBRATION, RunDir
from decodescope.trace.analyze import find_steps, op_table
from decodescope.critpath.split import collective_split
from decodescope.critpath.table import critical_paths
from decodescope.trace.load import load_trace_dir

log = logging.getLogger(__name__)

RECOVERY_SHARE = 0.10
RECOVERY_US = 20.0
SKEW_RANGE = "decodescope::injected_skew"  # probes.step.SKEW_RANGE (that module imports torch)
# the entering op of a collective instance on a CPU trace (gloo's wait_tensor joins it; not an entry)
COLLECTIVE_CATEGORIES = ("allreduce", "allgather", "all_to_all", "reduce_scatter", "broadcast")


class CalibrationError(RuntimeError):
    pass


# One delay setting's row: the record's (data/skew_calibration.json), also the benchmark's table row.
SkewSetting = SkewCalibrationRow


def setting_line(r: SkewSetting) -> str:
    """The row as a line of the benchmark's table (HEADER)."""
    return (f"{r.cpu_path:>6} {r.communicator:>10} {r.injected_us:>8.0f} {r.instances:>5} "
            f"{r.skew_us_median:>9.1f} {r.skew_us_p10:>8.1f}-{r.skew_us_p90:<8.1f} {r.error_us:>+7.1f} "
            f"{r.delivered_error_us:>+8.1f} {'yes' if r.recovered else 'NO':>4} {r.late_rank_share:>6.0%} "
            f"{r.raw_skew_us_median:>8.1f} {r.spin_us_median:>7.1f} {r.transfer_us_median:>8.1f}")


HEADER = ("  path communicator  inj_us  inst  skew_med   p10-p90          err_us  err_run  ok? late=R  raw_med  spin_us "
          "xfer_med")


def recovered(attributed_us: float, injected_us: float) -> bool:
    """Within RECOVERY_SHARE of the delay injected, or RECOVERY_US of it."""
    return abs(attributed_us - injected_us) <= max(RECOVERY_SHARE * injected_us, RECOVERY_US)


def cpu_path_env(cpu_path: Optional[str]) -> dict:
    """The environment that puts the replay's ranks on `cpu_path` (None: this process's own)."""
    if cpu_path is None:
        return {}
    if cpu_path == "native" and (os.environ.get(CPU_PATH_ENV) == "avx2"
                                 or str(AVX2_ONLY_DIR) in os.environ.get("PYTHONPATH", "")):
        raise CalibrationError(f"cpu path native asked for, but this process runs with {CPU_PATH_ENV}=avx2 (its "
                               "children inherit it): start it without, or ask for avx2")
    env: dict = {k: os.environ[k] for k in ("PYTHONPATH", *AVX2_ENV) if k in os.environ}
    apply_cpu_path(cpu_path, env)
    return env


def run_skewed_replay(plan: dict, out_dir: Path, skew_us: float, skew_rank: int = 1, steps: int = 10,
                      world: int = 2, cpu_path: Optional[str] = None, timeout_s: float = 600.0) -> Path:
    """The step replay on `world` torchrun ranks, `steps` steps profiled with rank `skew_rank` late by
    `skew_us` before every collective; returns `out_dir` (its traces and step_rank<r>.json)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "plan.json"
    write_json_atomic(plan_path, plan)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            f"--log-dir={out_dir / TORCHRUN_LOG_DIR}", "-m", "decodescope.probes.step"]
    argv += [str(a) for a in calibration_job(plan_path, out_dir, skew_us, steps, skew_rank=skew_rank)]
    env = {"OMP_NUM_THREADS": "1", **cpu_path_env(cpu_path)}
    log_path = out_dir / "step_replay.log"
    rc = LocalHost().run_job(argv, log_path, timeout_s, env=env, shm_globs=PROBE_SHM_GLOBS)
    if rc != 0:
        raise CalibrationError(f"step replay at --skew-us {skew_us:g} exited with {rc}; last lines of {log_path}:\n"
                               f"{log_tail(log_path, 25)}")
    return out_dir


def _paired_entries(ops: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The entering op of every collective on every rank, with its step and its order k in the step."""
    coll = ops[ops["category"].astype(str).isin(COLLECTIVE_CATEGORIES)]
    out = []
    for rank, g in coll.groupby("rank"):
        s = steps[steps["rank"] == rank].sort_values("start_us")
        g = g.sort_values("ts_us")
        pos = np.searchsorted(s["start_us"].to_numpy(), g["ts_us"].to_numpy(), side="right") - 1
        inside = (pos >= 0) & (g["ts_us"].to_numpy() < s["end_us"].to_numpy()[np.clip(pos, 0, None)])
        g = g[inside].assign(step=s["step"].to_numpy()[pos[inside]])
        g["k"] = g.groupby("step").cumcount()
        out.append(g[["rank", "step", "k", "ts_us"]])
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=["rank", "step", "k", "ts_us"])


def entry_table(ops: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Each collective (the k-th of a step on every rank) as a row of its ranks' entry times, us."""
    e = _paired_entries(ops, steps)
    if e.empty:
        return pd.DataFrame()
    return e.pivot_table(index=["step", "k"], columns="rank", values="ts_us", aggfunc="first").dropna()


def raw_entry_spread(t: pd.DataFrame) -> np.ndarray:
    """Per collective (a row of entry_table): the last rank's entry minus the first's, us, over every rank;
    off the ops, without the critical path. What its attributed arrival skew must equal."""
    return (t.max(axis=1) - t.min(axis=1)).to_numpy(float) if not t.empty else np.empty(0)


def raw_entry_skew(t: pd.DataFrame, skew_rank: int) -> np.ndarray:
    """Per collective (a row of entry_table): rank `skew_rank`'s entry minus the last entry of the other
    ranks, us; off the ops, without the critical path."""
    if t.empty:
        return np.empty(0)
    if skew_rank not in t.columns:
        raise CalibrationError(f"rank {skew_rank} has no collective in the traces (ranks: {list(t.columns)})")
    others = t.drop(columns=[skew_rank])
    return (t[skew_rank] - others.max(axis=1)).to_numpy(float)


def spin_durations(events: pd.DataFrame, skew_rank: int) -> np.ndarray:
    ev = events[(events["name"] == SKEW_RANGE) & (events["rank"] == skew_rank)]
    return ev["dur_us"].to_numpy(float)


def read_setting(trace_dir: Path, kind: str = "decode") -> tuple[pd.DataFrame, dict]:
    """One trace set through decodescope's reader and critical path: the collective split
    (critpath.split.collective_split) and the raw figures beside it."""
    meta = read_probe_output(Path(trace_dir) / "step_rank0.json", "step").meta
    loaded = load_trace_dir(Path(trace_dir))
    ops = op_table(loaded.events)
    steps = find_steps(loaded.events, ops)
    split = collective_split(critical_paths(loaded.events, ops, steps), kind)
    rank = int(meta["skew_rank"])
    entries = entry_table(ops, steps)
    raw = {"raw_skew_us": raw_entry_skew(entries, rank), "raw_spread_us": raw_entry_spread(entries),
           "spin_us": spin_durations(loaded.events, rank)}
    return split, {**meta, **raw}


def calibrate(split: pd.DataFrame, injected_us: float, skew_rank: int, cpu_path: str, communicator: str,
              raw_skew_us: np.ndarray = np.empty(0), spin_us: np.ndarray = np.empty(0),
              raw_spread_us: np.ndarray = np.empty(0)) -> SkewSetting:
    """One setting's row from its collective split: the attributed skew's median and p10-p90 over the
    instances, against the delay injected. raw_spread_us: each instance's last entry minus its first
    (raw_entry_spread; on two ranks |raw_skew_us|)."""
    if split.empty:
        raise CalibrationError(f"no collective instance in the traces at {injected_us:g} us injected: the critical "
                               "path found no step every rank has, or no collective in them")
    skew = split["skew_us"].to_numpy(float)
    med = float(np.median(skew))
    late = (split["late_rank"].to_numpy() == skew_rank).mean() if injected_us > 0 else float("nan")
    delivered = float(np.median(spin_us)) if injected_us > 0 and len(spin_us) else float(injected_us)
    return SkewSetting(
        cpu_path=cpu_path, communicator=communicator, injected_us=float(injected_us), skew_rank=skew_rank,
        instances=len(split), late_rank_share=float(late), skew_us_median=med,
        skew_us_p10=float(np.percentile(skew, 10)), skew_us_p90=float(np.percentile(skew, 90)),
        error_us=med - injected_us, delivered_us=delivered, delivered_error_us=med - delivered,
        recovered=recovered(med, delivered),
        raw_skew_us_median=float(np.median(raw_skew_us)) if len(raw_skew_us) else float("nan"),
        raw_abs_skew_us_median=float(np.median(raw_spread_us)) if len(raw_spread_us) else float("nan"),
        spin_us_median=float(np.median(spin_us)) if len(spin_us) else 0.0,
        transfer_us_median=float(split["transfer_us"].median()))


def calibrate_dir(trace_dir: Path, cpu_path: Optional[str] = None, kind: str = "decode") -> SkewSetting:
    """One setting's folder as a row, at the delay and late rank its meta records; cpu_path None: where the
    replay ran (replay_path_name)."""
    split, meta = read_setting(trace_dir, kind)
    cpu_path = replay_path_name(meta) if cpu_path is None else cpu_path
    return calibrate(split, float(meta["skew_us"]), int(meta["skew_rank"]), cpu_path, str(meta["communicator"]),
                     meta["raw_skew_us"], meta["spin_us"], meta["raw_spread_us"])


def write_settings(path: Path, rows: list[SkewSetting]) -> None:
    write_json_atomic(path, [r.model_dump() for r in rows])


def settings_table(rows: list[SkewSetting]) -> str:
    return "\n".join([HEADER] + [setting_line(r) for r in rows])


def load_settings(path: Path) -> list[SkewSetting]:
    return [SkewSetting(**r) for r in json.loads(Path(path).read_text())]


def phase_plan(params) -> dict:
    """03's calibration plan: the run's step replay (micro.bench.step_plan) at its first microbench batch,
    profiled only (no timed iterations), its ranks bound as the engine binds them."""
    plan = step_plan(params.model_copy(update={"microbench": params.microbench.model_copy(
        update={"batches": params.microbench.batches[:1]})}))
    return {**plan, "iters": 1, "warmup": 1}


def replay_path_name(meta: dict) -> str:
    """Where the replay ran: gpu, or the CPU path (native, or avx2 where forced)."""
    if str(meta.get("device", "cpu")).startswith("cuda"):
        return "gpu"
    return current_cpu_path()


def calibration_record(params) -> SkewCalibration:
    """03's calibration record before any setting ran: whether it runs, and why not where it does not."""
    mb = params.microbench
    world, delays = params.server.tensor_parallel, list(mb.skew_calibration_us)
    return SkewCalibration(world=world, steps=mb.skew_calibration_steps, ran=bool(delays) and world > 1,
                           why_not=("microbench.skew_calibration_us is []" if not delays else
                                    "one rank: no collective waits for another" if world < 2 else ""))


def calibration_job(plan_path: Path, out_dir: Path, delay_us: float, steps: int, device: Optional[str] = None,
                    skew_rank: int = 1) -> list:
    """One delay setting's job of probes.step: the plan's steps profiled only, rank skew_rank late by delay_us."""
    return (["--plan", plan_path, "--out-dir", out_dir, "--variants", "", "--profile-steps", str(steps),
             "--skew-us", f"{delay_us:g}", "--skew-rank", str(skew_rank)] + (["--device", device] if device else []))


THEN = "--then"  # probes.step.THEN (that module imports torch): the next job's arguments follow


def one_launch(jobs: list[list]) -> list:
    """Jobs of probes.step as the arguments of one launch, each after --then."""
    return [a for i, job in enumerate(jobs) for a in ([THEN] if i else []) + job]


def phase_jobs(params, run_dir: Path, record: SkewCalibration, device: Optional[str] = None) -> tuple[list, list, list]:
    """03's jobs of probes.step: the replay (micro.bench.step_replay_job), then one per
    microbench.skew_calibration_us delay where the record runs; with the plans to push and the folders to
    bring back (over ssh). The plans are written and the folders made here."""
    replay_args, replay_plan, replay_out = step_replay_job(params, run_dir, device)
    jobs, inputs, outputs = [replay_args], [replay_plan], [replay_out]
    if record.ran:
        plan_path = RunDir(run_dir).file(SKEW_CALIBRATION).with_name("skew_calibration_plan.json")
        write_json_atomic(plan_path, phase_plan(params))
        inputs.append(plan_path)
        for delay in params.microbench.skew_calibration_us:
            out_dir = Path(run_dir) / TRACES / "skew_calibration" / f"d{delay:g}"  # its traces and probe rows
            out_dir.mkdir(parents=True, exist_ok=True)
            jobs.append(calibration_job(plan_path, out_dir, delay, params.microbench.skew_calibration_steps, device))
            outputs.append(out_dir)
    return jobs, inputs, outputs


def replay_and_calibrate_for_phase(params, run_dir: Path,
                                   device: Optional[str] = None) -> tuple[pd.DataFrame, SkewCalibration]:
    """03's step replay (micro.bench.step_replay_job) and its skew calibration, one job per
    microbench.skew_calibration_us delay (rank 1 late by it before every collective, each profile read back
    through the critical path), in one torchrun launch: torchrun, torch and vLLM's kernels start once, not
    once a job (~17 s a launch on the 2-core AVX2 host, benchmarks/results/step_probe_launches.txt).
    data/step_replay.parquet and data/skew_calibration.json are written once the launch ends, the record
    again after every setting is read back; a launch stopped midway leaves the jobs that finished in their
    folders (data/step_ranks, traces/skew_calibration)."""
    path = RunDir(run_dir).file(SKEW_CALIBRATION)
    record = calibration_record(params)
    write_record(path, record)
    jobs, inputs, outputs = phase_jobs(params, run_dir, record, device)
    run_torchrun_probe(params, run_dir, "decodescope.probes.step", one_launch(jobs), params.server.tensor_parallel,
                       inputs=tuple(inputs), outputs=tuple(outputs), log_name="step_probe")
    replay = save_step_replay(outputs[0], run_dir)
    for out_dir in outputs[1:]:
        row = calibrate_dir(out_dir)
        log.info("skew calibration: %s", setting_line(row))
        record.settings.append(row)
        write_record(path, record)
    return replay, record
