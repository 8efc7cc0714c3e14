"""The whole per-rank analysis of one set of traces, and its files in the run directory."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from decodescope.model import arch as archmod
from decodescope.core.io import write_parquet_atomic
from decodescope.core.stats import trimmed_mean
from decodescope.schema.records import CallsWithWait, ProfileSummary, StepMedians, write_record
from decodescope.schema.rundata import PROFILE_SUMMARY
from decodescope.trace import analyze as an
from decodescope.trace.draftsteps import drafter_steps, gpu_drafter_ops
from decodescope.trace.categorize import communicator_of
from decodescope.trace.load import LoadedTraces


KERNEL_COLUMNS = ["rank", "step", "category", "name", "ts_us", "dur_us", "time_us", "lane", "msg_bytes",
                  "correlation", "coll_name"]


@dataclass
class ProfileResult:
    device: str
    ops: pd.DataFrame
    steps: pd.DataFrame
    breakdown: pd.DataFrame
    per_step: pd.DataFrame
    expected: pd.DataFrame
    busy: pd.DataFrame
    gaps: pd.DataFrame
    skew: pd.DataFrame
    skew_summary: pd.DataFrame
    calls: pd.DataFrame
    top: pd.DataFrame
    unknown: pd.DataFrame
    schedule: pd.DataFrame
    warnings: list[str] = field(default_factory=list)
    step_kind: str = "decode"
    host_steps: Optional[pd.DataFrame] = None   # the steps as the host's execute ranges hold them (user_annotation)

    def summary(self) -> ProfileSummary:
        """profile_summary.json: the figures the verdict and the report read."""
        kind_busy = self.busy[self.busy["kind"] == self.step_kind] if not self.busy.empty else self.busy
        ar = self.breakdown[self.breakdown["category"].astype(str).isin(an.ALLREDUCE_CATEGORIES)]
        total = self.breakdown.groupby("rank")["time_us"].sum()
        ar_share = (ar.groupby("rank")["time_us"].sum() / total).fillna(0.0)
        decode_ar = self.per_step[self.per_step["category"].astype(str).isin(an.ALLREDUCE_CATEGORIES)]
        return ProfileSummary(
            device=self.device,
            ranks=sorted(int(r) for r in self.ops["rank"].unique()),
            step_kind=self.step_kind,
            steps={str(k): int(v) for k, v in self.steps.groupby("kind").size().items()},
            allreduce_share_of_time={int(r): float(v) for r, v in ar_share.items()},
            allreduce_calls_per_step={int(r): float(v) for r, v in
                                      decode_ar.groupby("rank")["calls_per_step"].sum().items()},
            allreduce_mean_us={int(r): float(g["time_us"].sum() / max(g["calls"].sum(), 1))
                               for r, g in ar.groupby("rank")},
            allreduce_communicators=allreduce_communicators(self.ops),
            per_step=StepMedians(
                summed_us_median=float(kind_busy["summed_us"].median()) if len(kind_busy) else None,
                busy_us_median=float(kind_busy["busy_us"].median()) if len(kind_busy) else None,
                wall_us_median=float(kind_busy["wall_us"].median()) if len(kind_busy) else None,
                idle_us_median=float(kind_busy["idle_us"].median()) if len(kind_busy) else None,
                **step_periods(self.steps, self.step_kind),
                host_between_steps_us_median=(step_periods(self.host_steps, self.step_kind)["between_steps_us_median"]
                                              if self.host_steps is not None else None),
            ),
            # the tables' rows (to_dict boxes numpy scalars) validate into records_profile's row models
            expected_vs_observed=self.expected.to_dict("records"),
            per_step_categories=self.per_step.assign(
                category=self.per_step["category"].astype(str)).to_dict("records"),
            breakdown=self.breakdown.assign(category=self.breakdown["category"].astype(str)).to_dict("records"),
            other_share=float(self.breakdown.loc[self.breakdown["category"].astype(str) == an.OTHER, "time_us"].sum()
                              / max(self.breakdown["time_us"].sum(), 1e-9)),
            top_unknown=self.unknown.assign(category=self.unknown["category"].astype(str)).to_dict("records"),
            allreduce_transfer_us_per_step=allreduce_transfer_per_step(self.skew, self.steps, self.step_kind),
            allreduce_with_wait=calls_with_wait_stats(an.calls_with_wait(self.ops), self.steps, self.step_kind),
            collective_wait=self.skew_summary.assign(
                category=self.skew_summary["category"].astype(str)).to_dict("records"),
            schedule=self.schedule.to_dict("records"),
            warnings=self.warnings,
        )


def allreduce_transfer_per_step(skew: pd.DataFrame, steps: pd.DataFrame, kind: str) -> Optional[float]:
    """The all-reduces' own time per `kind` step: the median call at its least time over the ranks (the
    rank that arrives last waits for no one: its time is the collective's own) x the median calls per
    step. Per call, not per step: a step's sum takes in every call a preempted rank stretched, which
    is the host's time, booked to the wait. None with one rank."""
    ar = skew[skew["category"].astype(str).isin(an.ALLREDUCE_CATEGORIES)] if not skew.empty else skew
    calls = _instances_in(ar, steps, kind)  # an instance's transfer is the same on every rank
    if calls.empty:
        return None
    return float(calls["transfer_us"].median() * calls.groupby("step").size().median())


def _instances_in(calls: pd.DataFrame, steps: pd.DataFrame, kind: str) -> pd.DataFrame:
    """One row per collective instance (the first rank's), in that rank's steps of `kind`."""
    if calls.empty or steps.empty:
        return calls.iloc[0:0]
    first = calls[calls["rank"] == calls["rank"].min()]
    kinds = steps[steps["rank"] == first["rank"].iloc[0]][["step", "kind"]]
    first = first.merge(kinds, on="step")
    return first[first["kind"] == kind]


def calls_with_wait_stats(calls: pd.DataFrame, steps: pd.DataFrame, kind: str) -> Optional[CallsWithWait]:
    """The `kind` steps' all-reduce calls with their wait ops (trace.analyze.calls_with_wait), each at its
    least time over the ranks; None where the calls wait in no op of their own."""
    least = _instances_in(calls, steps, kind)
    if least.empty:
        return None
    return CallsWithWait(median_us=float(least["least_us"].median()), mean_us=float(least["least_us"].mean()),
                         p90_us=float(least["least_us"].quantile(0.9)),
                         calls_per_step=float(least.groupby("step").size().median()), calls=len(least))


def allreduce_communicators(ops: pd.DataFrame) -> dict[str, float]:
    """Which all-reduce implementation ran (from op/kernel names), as shares of all-reduce time."""
    ar = ops[ops["category"].astype(str).isin(an.ALLREDUCE_CATEGORIES)]
    if ar.empty:
        return {}
    by_name = ar.groupby(ar["name"].astype(str), observed=True)["time_us"].sum()
    by_comm = by_name.groupby([communicator_of(n) for n in by_name.index]).sum()
    return {str(k): float(v / by_comm.sum()) for k, v in by_comm.sort_values(ascending=False).items()}


def analyze_traces(loaded: LoadedTraces, model_config: Optional[dict] = None, tp: Optional[int] = None,
                   batch: int = 1, rules=None) -> ProfileResult:
    events = loaded.events
    ops = an.op_table(events, rules)
    device = ops.attrs.get("device", "gpu")
    steps = an.find_steps(events, ops)
    ops = an.assign_steps(ops, steps, events)
    ops.attrs["device"] = device
    kinds = set(steps["kind"]) if not steps.empty else set()
    step_kind = "decode" if "decode" in kinds else ("unknown" if "unknown" in kinds else next(iter(kinds), "unknown"))
    per_step = an.calls_per_step(ops, steps, step_kind) if not steps.empty else pd.DataFrame(
        columns=["rank", "category", "calls_per_step", "time_per_step_us"])
    schedule = pd.DataFrame()
    exp_ar = exp_ag = None
    if model_config is not None:
        tp = tp or len(loaded.ranks)
        arch = archmod.normalize_config(model_config)
        calls = archmod.collective_schedule(arch, tp, batch)
        schedule = archmod.schedule_frame(calls)
        exp_ar = sum(c.count for c in calls if c.op == "all_reduce")
        exp_ag = sum(c.count for c in calls if c.op == "all_gather")
    expected = an.expected_vs_observed(per_step, exp_ar, exp_ag) if not per_step.empty else pd.DataFrame()
    skew = an.collective_skew(ops)
    return ProfileResult(
        device=device, ops=ops, steps=steps, breakdown=an.category_breakdown(ops), per_step=per_step,
        expected=expected, busy=an.busy_vs_sum(ops, steps), gaps=an.idle_gaps(ops), skew=skew,
        skew_summary=an.skew_summary(skew), calls=an.per_call_latency(ops), top=an.top_ops(ops),
        unknown=an.unknown_ops(ops), schedule=schedule, warnings=list(loaded.warnings), step_kind=step_kind,
        host_steps=an.steps_from_annotations(events[events["cat"] != "gpu_user_annotation"]))


# The share of step periods left out at each end of the trimmed mean: the profiler's own slow steps (its start,
# its stop, its buffer flushes) that the engine's inter-token latency under the profiler does not hold. On 16
# profiled levels of five H200 runs the 2%-trimmed mean was within -2.2..+1.7% of that latency on 15
# (the median -9.6..+7.7%, the plain mean +0.4..+5.1%): the period the profiler's measured cost comes off.
PERIOD_TRIM = 0.02


def step_periods(steps: pd.DataFrame, kind: str) -> dict[str, Optional[float]]:
    """Medians over steps of `kind` that another step follows on the same rank: start-to-start period,
    end-to-start gap (what the host does between steps), and the decoded batch; and the period's trimmed mean."""
    out: dict[str, Optional[float]] = {"period_us_median": None, "period_us_trimmed_mean": None,
                                       "between_steps_us_median": None, "batch_median": None}
    if steps.empty or "start_us" not in steps:
        return out
    s = steps.sort_values(["rank", "start_us"])
    nxt = s.groupby("rank")["start_us"].shift(-1)
    mine = (s["kind"] == kind) & nxt.notna()
    if mine.any():
        periods_us = (nxt - s["start_us"])[mine]
        out["period_us_median"] = float(periods_us.median())
        out["period_us_trimmed_mean"] = trimmed_mean(periods_us.to_numpy(), PERIOD_TRIM)
        out["between_steps_us_median"] = float((nxt - s["end_us"])[mine].clip(lower=0).median())
    if "gen_reqs" in s and (s["kind"] == kind).any():
        out["batch_median"] = float(s.loc[s["kind"] == kind, "gen_reqs"].median())
    return out


def write_profile(result: ProfileResult, data_dir: Path, concurrency: Optional[int] = None) -> ProfileSummary:
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    kernels = result.ops[[c for c in KERNEL_COLUMNS if c in result.ops.columns]].copy()
    for c in ("category", "name", "coll_name"):
        if c in kernels:
            kernels[c] = kernels[c].astype(str)
    write_parquet_atomic(data_dir / "kernels.parquet", kernels)
    write_parquet_atomic(data_dir / "profile_steps.parquet", result.steps)
    summary = result.summary().model_copy(update={"concurrency": concurrency})
    write_record(data_dir / PROFILE_SUMMARY, summary)
    return summary


def level_drafter(loaded: LoadedTraces, result: ProfileResult, concurrency: Optional[int]):
    """The level's drafter (draftsteps), or None. On a GPU trace its marks are the host's, read from the rank
    files, and its steps the host's annotations: a GPU step's own span is its kernels'."""
    if result.device != "gpu":
        return drafter_steps(result.ops, result.steps, result.step_kind, concurrency)
    steps = result.host_steps if result.host_steps is not None else result.steps
    if not (steps["gen_tokens"] > steps["gen_reqs"]).any():
        return None  # no step verified drafts (one token a request): no second pass over the rank files
    files = {int(m.rank): Path(m.path) for m in loaded.metas if m.rank is not None}
    return drafter_steps(gpu_drafter_ops(loaded.events, files), steps, result.step_kind, concurrency)
