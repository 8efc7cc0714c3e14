"""The variants measured against the baseline and the projection of the change each makes, and the step replay
against the step model (decodescope.verdict.verdict)."""
from __future__ import annotations

import json
from pathlib import Path
from dataclasses import replace as dc_replace
from typing import Optional

import pandas as pd

from decodescope.verdict import graphless
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import stepparts as sp
from decodescope.engines.vllm_log import last_engine_modes
from decodescope.exec.serverlaunch import dashed
from decodescope.micro.bench import STEP_REPLAY
from decodescope.schema.params import with_experiment
from decodescope.schema.records import ProfileCapture, ProfileSummary, read_record
from decodescope.schema.records_manifest import VariantEntry
from decodescope.schema.records_spec import DrafterSteps
from decodescope.trace.draftsteps import DRAFTER_STEPS
from decodescope.schema.rundata import PROFILE_SUMMARY, RunDir
from decodescope.verdict.speculative import DrafterCost, drafter_key, drafter_of, drafter_us, nearest_drafter
from decodescope.verdict.fixes import (EAGER_STEP, Fix, ModelInputs, _read_parquet, baseline_tpot, capped_fix,
                                       eager_fix, expected_tokens_per_verify, level_tpot, profile_summaries)
from decodescope.engines import engine


# ---- the variants (params.experiments), measured against their projections ----------------------------
def _spec_config(engine_args: dict) -> Optional[dict]:
    raw = engine_args.get(engine().speculative_arg)
    if raw is None:
        return None
    try:
        return raw if isinstance(raw, dict) else json.loads(raw)
    except ValueError:
        return None


def _acceptance(levels: pd.DataFrame) -> tuple[Optional[float], bool, Optional[float], str]:
    """(per drafted token acceptance, anything drafted, tokens per verify step, acceptance per position) from
    the variant's server telemetry (01), medians over its levels: vllm:spec_decode_num_accepted_tokens /
    num_draft_tokens; 1 + accepted / drafts (what the positions' acceptance adds up to); each position's."""
    col = "server_spec_acceptance_pct"
    if col not in levels:
        return None, False, None, ""
    v = levels[col].dropna()
    if not len(v):
        return None, False, None, ""
    length = levels["server_spec_accept_len"].dropna() if "server_spec_accept_len" in levels else pd.Series([], dtype=float)
    per_pos = (levels["server_spec_accepted_per_pos"].dropna() if "server_spec_accepted_per_pos" in levels
               else pd.Series([], dtype=object))
    pos = [[float(x) for x in str(p).split(",")] for p in per_pos if p]
    median_pos = ",".join(f"{pd.Series(col).median():.3f}" for col in zip(*pos)) if pos else ""
    return float(v.median()) / 100.0, True, float(length.median()) if len(length) else None, median_pos


def variant_spec(vparams) -> Optional[dict]:
    """A variant's speculative config (its params, with_experiment), or None where it has none."""
    return _spec_config(dashed(vparams.server.engine_args))


def drafter_component(us: float, how: str) -> sp.Component:
    """A drafter measured whole (a profiled variant's passes): host time inside the verify step."""
    return sp.Component(sm.DRAFTER, us, us, us, how, [], sp.Kind.HOST_IN_STEP)


def drafter_sources(run_dir: Path, params) -> dict[str, dict[str, list[DrafterCost]]]:
    """drafter (speculative.drafter_key) -> profiled speculative variant -> the drafter's cost at each level
    its 04 profiled (variants/<name>/data/profile/c<N>/drafter_steps.json, scaled by its capture)."""
    out: dict[str, dict[str, list[DrafterCost]]] = {}
    for exp in params.experiments:
        spec = variant_spec(with_experiment(params, exp.name)) if exp.profile else None
        if spec is None:
            continue
        vdir = RunDir(run_dir).variant(exp.name)
        costs = []
        for level, cap in sorted(vdir.level_captures().items()):
            path = vdir.level_file(level, DRAFTER_STEPS)
            if not path.is_file():
                continue
            m = read_record(path, DrafterSteps)
            scale = (cap.engine_itl_unprofiled_us / cap.engine_itl_profiled_us
                     if cap.engine_itl_unprofiled_us and cap.engine_itl_profiled_us else 1.0)
            summary = vdir.level_file(level, PROFILE_SUMMARY)
            apart = summary.is_file() and read_record(summary, ProfileSummary).device == "gpu"
            costs.append(DrafterCost(exp.name, int(spec.get("num_speculative_tokens", 1)), float(level), m.lead_us,
                                     m.first_pass_us, m.next_pass_us, scale, m.verify_us, apart))
        out.setdefault(drafter_key(spec), {})[exp.name] = costs
    return out


def variant_fix(inp: ModelInputs, params, vparams, exp, batch: float, acceptance: tuple,
                lost_async: bool = False,
                drafters: Optional[dict[str, dict[str, list[DrafterCost]]]] = None) -> tuple[Optional[Fix], str]:
    """The verdict's projection of what this variant changes, at `batch`; (None, why) when there is none.
    lost_async: the variant's engine scheduled synchronously where the baseline's did not (their logs).
    drafters: drafter_sources, the drafters the run's profiled speculative variants measured."""
    ea, base_ea = dashed(vparams.server.engine_args), dashed(params.server.engine_args)
    tp, vtp = inp.tp, vparams.server.tensor_parallel
    if vtp != tp:
        fix = inp.at_tensor_parallel(vtp, batch)
        return (fix, "") if fix is not None else (None, f"02 did not measure the GEMMs at tensor-parallel {vtp}")
    spec = _spec_config(ea)
    if spec is not None:
        k = int(spec.get("num_speculative_tokens", 1))
        alpha, drafted, accept_len, per_pos = acceptance
        if alpha is None:
            return _synchronous(inp, nothing_drafted_fix(inp, batch, k), batch, lost_async), ""
        measured = nearest_drafter((drafters or {}).get(drafter_key(spec), {}), exp.name, k)
        return _synchronous(inp, spec_fix(inp, batch, k, spec, alpha, accept_len, per_pos, measured), batch,
                            lost_async), ""
    if ea.get("enable-expert-parallel"):
        if inp.coll.empty or inp.coll[(inp.coll["part"] == "all_to_all") & (inp.coll["status"] == "ok")].empty:
            return None, "03 measured no all-to-all"
        c = sm.expert_parallel_collectives(inp.coll, inp.arch, tp, int(batch), inp.communicator, inp.timing)
        return Fix("expert parallelism", inp.predict(batch, collectives=c), 1.0, tp), ""
    cap = ea.get("max-num-seqs")
    if cap is not None and cap != base_ea.get("max-num-seqs"):
        return capped_fix(inp, batch, int(cap)), ""
    # a flag reaches the server only as True (serverlaunch.engine_flags)
    if ea.get("enforce-eager") is True and base_ea.get("enforce-eager") is not True:
        return eager_fix(inp, batch)
    return None, "no projection for this change"


def spec_fix(inp: ModelInputs, batch: float, k: int, spec: dict, alpha: float, accept_len: Optional[float],
             per_pos: str, measured: Optional[list[DrafterCost]] = None) -> Fix:
    """Speculative decoding that drafted, priced whole (verdict.speculative).

    The verify step is priced at batch x (k + 1).
    Where a profiled variant of it measured the drafter, that measurement prices it (rejection, inputs, k passes).
    Without that, where the drafter is the target itself, it is k decode steps of the target at the batch.
    The sum is taken over the tokens per verify step the server measured (1 + accepted / drafts).
    Without that measurement, the i.i.d. formula gives them."""
    drafter = drafter_of(spec, None)
    verify = inp.predict(batch * (k + 1))
    notes = [f"verify step = the step model at batch {batch:g} x {k + 1}"]
    comps = list(verify.components)
    if measured:
        d_us, how = drafter_us(measured, k, batch, verify.wall_us)
        comps.append(drafter_component(d_us, how))
        notes.append(f"drafter: {drafter}, {d_us:,.0f} us a verify step, {how}")
    elif drafter == "self":
        draft = inp.predict(batch)
        comps.append(sp.Component(sm.DRAFTER, k * draft.wall_us, k * draft.wall_us, k * draft.wall_us,
                                  "the step model at the batch (the target as its own draft)",
                                  [f"{k} draft passes, each a decode step of the target at batch {batch:g}"],
                                  sp.Kind.HOST_IN_STEP))
        notes.append(f"drafter: the target itself, {k} x {draft.wall_us:,.0f} us a verify step")
    else:
        notes.append(f"drafter: {drafter}, its own cost not priced")
    if accept_len:
        tokens = accept_len
        notes.append(f"{tokens:.2f} tokens a verify step, measured (1 + accepted / drafts"
                     + (f"; per position {per_pos}" if per_pos else "") + ")")
    else:
        tokens = expected_tokens_per_verify(k, min(alpha, 0.999))
        notes.append(f"{tokens:.2f} tokens a verify step from alpha {alpha:.2f} i.i.d. (positions not measured)")
    return Fix(f"speculative decoding k={k}, {drafter} drafter, {tokens:.2f} tokens a verify step (measured)",
               sm.StepPrediction(verify.batch, comps, verify.overlap), tokens, inp.tp, notes,
               measured_us=d_us if measured else 0.0)


def _synchronous(inp: ModelInputs, fix: Fix, batch: float, lost_async: bool) -> Fix:
    """The fix with the baseline's host time between steps added where the variant lost async scheduling."""
    gap, idle, source = inp.host_gap_at(batch) if lost_async else (None, 0.0, "")
    comp = graphless.lost_async_component(gap, idle, source)
    if comp is None:
        return fix
    pred = fix.prediction
    return dc_replace(fix, prediction=sm.StepPrediction(pred.batch, pred.components + [comp], pred.overlap),
                      assumptions=fix.assumptions + [
                          f"its engine schedules synchronously (its log), the baseline's did not: the baseline's host "
                          f"time between steps ({gap:,.0f} us) adds to every step, less what its GPU already sat idle "
                          f"a step ({idle:,.0f} us): {comp.us:,.0f} us"])


def nothing_drafted_fix(inp: ModelInputs, batch: float, k: int) -> Fix:
    """Speculative decoding that drafted nothing (n-gram on text that never repeats): every step decodes one
    token a request, which is no uniform batch of 1 + k tokens, so vLLM replays its piecewise graphs and runs
    their splitting ops on the host (graphless.piecewise_items, walked); without 04's un-graphed capture or 02's
    host cost per call, the base step."""
    name = f"speculative decoding k={k}, nothing drafted (measured)"
    base = inp.predict(batch)
    gpu_us, attention_us = inp.gpu_us(base)
    call_us, host_ops = inp.call_us(batch), inp.host_ops
    items, notes = (graphless.piecewise_items(host_ops, inp.per_event_us, inp.splitting_ops, call_us, gpu_us,
                                              attention_us) if host_ops is not None and call_us is not None
                    else ([], []))
    if host_ops is None or not items:
        return Fix(name, base, 1.0, inp.tp, [
            "the server's vllm:spec_decode_* metrics show no draft tokens: the step is the base step (04 priced no "
            "op outside the CUDA graph)"])
    comp = graphless.piecewise_component(items, notes, gpu_us, host_ops.step_tokens, inp.per_event_how,
                                         inp.per_event_us)
    return Fix(name + ": piecewise CUDA graphs", sm.StepPrediction(base.batch, base.components + [comp], base.overlap),
               1.0, inp.tp, ["the server's vllm:spec_decode_* metrics show no draft tokens: each step decodes one "
                             "token a request, no uniform batch of 1 + k, so the engine replays its piecewise graphs and "
                             f"the host runs their splitting ops, {comp.us:,.0f} us a step at their cost in 04's "
                             "un-graphed step"])


def _calibration(inp: ModelInputs, fix: Fix, level: float, calibration: dict[int, float],
                 base: dict[int, float]) -> tuple[float, str]:
    """(scale, how): the fix x the baseline's TPOT / the base model at the batch that calibrates it (the
    level's own, or the cap's for a capped batch), so the model's own error there cancels."""
    if not fix.calibrated:
        return 1.0, "the model's own value (not calibrated: a step of another kind than the baseline's)"
    ref = fix.calibrate_at if fix.calibrate_at is not None else level
    if int(ref) not in base:
        return 1.0, f"the model's own value (the baseline did not measure level {ref:g})"
    model = inp.predict(ref).period_us
    where = "this level" if ref == level else f"level {ref:g}, the batch it runs at"
    return (calibration.get(int(ref), model) / model,
            f"calibrated by the baseline's TPOT at {where}" + (" (the mean of its 01 and 04 measurements)"
                                                               if calibration.get(int(ref)) != base.get(int(ref)) else ""))


def _implied_host_per_kernel(fix: Fix, tpot_us: float) -> str:
    """For an eager projection: the host time per kernel the measured TPOT implies (TPOT less the time
    between steps, over the kernels), beside the cost per call the projection used."""
    if fix.per_kernel is None:
        return ""
    kernels, between_us = fix.per_kernel
    return (f"; the measured TPOT implies {(tpot_us - between_us) / kernels:,.1f} us of host time per profiled kernel "
            f"((TPOT - {between_us:,.0f} us between steps) / {kernels:.0f}), where the projection issued each at "
            "02's cost of a bare GEMM call")


def _lost_async_scheduling(base, variant) -> str:
    """A note where the variant's engine scheduled synchronously and the baseline's did not (both logs say so)."""
    if base is None or variant is None or not (base.async_scheduling is True and variant.async_scheduling is False):
        return ""
    return ("; its engine ran without async scheduling (its log), the baseline's with it: the host schedules each "
            "step once the one before has ended, a serial cost that the projection, priced on the baseline's "
            "overlapped host time, leaves out")


def own_profile_note(variant: Optional[ProfileSummary], base: Optional[ProfileSummary]) -> str:
    """Where the variant was profiled at this level (`profile: true`): its step under the profiler, the
    part of it the GPU was busy and the rest, the host's, set beside the baseline's profile at the level."""
    if variant is None:
        return ""
    period, busy = variant.per_step.period_us, variant.per_step.busy_us_median
    if not period or busy is None:
        return ""
    text = (f"; its own profile here: a step of {period:,.0f} us under the profiler, the GPU busy {busy:,.0f} us "
            f"of it, {period - busy:,.0f} us the host's")
    b_period, b_busy = (base.per_step.period_us, base.per_step.busy_us_median) if base is not None else (None, None)
    if b_period and b_busy is not None:
        text += f" (the baseline's: {b_period:,.0f} us, GPU {b_busy:,.0f} us, host {b_period - b_busy:,.0f} us)"
    return text


def _gist(error: str) -> str:
    """An error's first line and, when it quotes a log tail, the tail's last line (where vLLM says why)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    if not lines:
        return ""
    return (lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}")[:400]


def variant_rows(run_dir: Path, params, inp: Optional[ModelInputs], levels: Optional[pd.DataFrame],
                 captures: Optional[dict[int, ProfileCapture]] = None,
                 drafters: Optional[dict[str, dict[str, list[DrafterCost]]]] = None,
                 priced: Optional[list[dict]] = None) -> list[dict]:
    """Per variant and serving level: its TPOT against the baseline's (01) and against its projection
    (calibrated like the fixes: the baseline's TPOT, baseline_tpot, x fix / base model). drafters:
    drafter_sources where the caller read them already. priced: speccurve.loo_rows, each speculative variant
    projected from the baseline and the other variants, never its own measurements; where a row has one, it
    is the variant's projection (else its profiled drafter, or whole decode steps, price it)."""
    run = RunDir(run_dir)
    manifest = run.manifest()
    states = manifest.variants if manifest is not None else {}
    base = {int(r.level): level_tpot(r)[0] for r in levels.itertuples()} if levels is not None else {}
    calibration = {int(k): v for k, v in baseline_tpot(levels, captures).items()}
    utils = ({int(r.level): r.gpu_util_mean_pct for r in levels.itertuples()}
             if levels is not None and "gpu_util_mean_pct" in levels.columns else {})
    base_modes = last_engine_modes(Path(run_dir) / "logs" / "server.log")
    base_profiles = profile_summaries(run_dir, params)
    drafters = drafter_sources(run_dir, params) if drafters is None else drafters
    loo = {(r["variant"], r["level"]): r for r in priced or [] if "projected_tpot_us" in r}
    rows = []
    for exp in params.experiments:
        state = states.get(exp.name) or VariantEntry(status="not run")
        vlev = run.variant(exp.name).serving_levels()
        status = state.status
        if vlev is None or vlev.empty:
            rows.append({"variant": exp.name, "status": status if status != "ok" else "failed",
                         "error": _gist(state.error or "no serving levels measured")})
            continue
        vparams = with_experiment(params, exp.name)
        acceptance = _acceptance(vlev)
        modes = last_engine_modes(run.variant(exp.name).path / "logs" / "server.log")
        lost_async = _lost_async_scheduling(base_modes, modes)
        own_profiles = profile_summaries(run.variant(exp.name).path, vparams) if exp.profile else {}
        for lv in vlev.sort_values("level").itertuples():
            b, (tpot, basis) = float(lv.level), level_tpot(lv)
            row = {"variant": exp.name, "status": status, "error": state.error.splitlines()[0][:300]
                   if state.error else "", "level": int(lv.level), "tpot_p50_us": tpot, "reference": basis,
                   "tok_s_per_gpu": float(lv.output_throughput_tok_s) / vparams.server.tensor_parallel}
            if int(lv.level) in base:
                row.update(baseline_tpot_p50_us=base[int(lv.level)], measured_gain_pct=100 * (tpot / base[int(lv.level)] - 1))
                split = gpu_host_split(base[int(lv.level)], utils.get(int(lv.level)), tpot,
                                       getattr(lv, "gpu_util_mean_pct", None))
            else:
                split = None
            if inp is not None:
                # the level's own acceptance where it drafted (sampling and batching move it), else the variant's
                own = _acceptance(vlev[vlev["level"] == lv.level])
                fix, why = variant_fix(inp, params, vparams, exp, b, own if own[0] is not None else acceptance,
                                       lost_async=bool(lost_async), drafters=drafters)
                if fix is None:
                    row["notes"] = why
                else:
                    scale, how = _calibration(inp, fix, b, calibration, base)
                    lo, hi = fix.prediction.band_us
                    proj = fix.tpot_us(fix.prediction.period_us, scale)
                    parts = {c.name for c in fix.prediction.components}
                    priced_sync = sm.LOST_ASYNC in parts
                    # a step priced with host time the baseline's graphs hid says how, in the row
                    said = fix.assumptions if parts & {sm.OUTSIDE_GRAPH, sm.LOST_ASYNC, EAGER_STEP, sm.DRAFTER} else []
                    row.update(projection=fix.name, projected_tpot_us=proj,
                               projected_low_us=fix.tpot_us(lo, scale), projected_high_us=fix.tpot_us(hi, scale),
                               projection_error_pct=100 * (proj / tpot - 1),
                               notes=how + "".join(f"; {a}" for a in said)
                               + _implied_host_per_kernel(fix, tpot) + ("" if priced_sync else lost_async)
                               + own_profile_note(own_profiles.get(int(lv.level)), base_profiles.get(int(lv.level))))
            if (exp.name, int(lv.level)) in loo:
                row.update(_left_out_projection(loo[(exp.name, int(lv.level))], tpot,
                                                own_profile_note(own_profiles.get(int(lv.level)),
                                                                 base_profiles.get(int(lv.level)))))
            if split:
                row["gpu_host_split"] = split
            if modes:
                row["engine_modes"] = modes.describe()
            rows.append(row)
    return rows


def _left_out_projection(priced: dict, tpot_us: float, note: str) -> dict:
    """A speculative variant's row fields from its projection without its own measurements (speccurve.loo_rows)."""
    proj = priced["projected_tpot_us"]
    return {"projection": f"speculative decoding k={priced['k']}, {priced['drafter']} drafter, priced without its "
                          "own measurements", "projected_tpot_us": proj, "projected_low_us": proj,
            "projected_high_us": proj, "projection_error_pct": 100 * (proj / tpot_us - 1), "notes": priced["how"] + note}


def gpu_host_split(base_tpot_us: float, base_util_pct: Optional[float], tpot_us: float,
                   util_pct: Optional[float]) -> str:
    """Where a variant's TPOT change went, from the GPU's busy share over each level (NVML utilization: the
    share of time a kernel ran): GPU time per token = busy share x TPOT, the rest is time the GPU waited on
    the host (launches, drafting, scheduling). '' where either level has no GPU telemetry."""
    if base_util_pct is None or util_pct is None or pd.isna(base_util_pct) or pd.isna(util_pct):
        return ""
    gpu_base, gpu_var = base_util_pct / 100 * base_tpot_us, util_pct / 100 * tpot_us
    host_base, host_var = base_tpot_us - gpu_base, tpot_us - gpu_var
    return (f"GPU busy {util_pct:.0f}% of the level against {base_util_pct:.0f}% in the baseline: GPU time per "
            f"token {gpu_var / 1e3:.2f} ms vs {gpu_base / 1e3:.2f} ms, the GPU waiting on the host "
            f"{host_var / 1e3:.2f} ms vs {host_base / 1e3:.2f} ms")


REPLAY_TOLERANCE = 0.10  # the step model's GEMMs + collectives against the replayed step


def replay_rows(run_dir: Path, params, inp: Optional[ModelInputs]) -> list[dict]:
    """03's step replay (GEMMs and collectives in model order, nothing else) against the step model's
    GEMMs (02) + collectives (03, the communicator the replay ran: the engine's shm all-reduce on a CPU
    with vLLM, else torch's)."""
    replay = _read_parquet(run_dir, STEP_REPLAY)
    if inp is None or replay is None or replay.empty:
        return []
    rows = []
    for mode in sorted(set(replay["mode"])):
        comm, timing = (("torch_nccl", "cuda_graph") if mode == "cuda_graph" else
                        ("torch_nccl", "back_to_back") if inp.timing == "cuda_graph" else ("torch_gloo", "back_to_back"))
        if "communicator" in replay:
            ran = replay.loc[replay["mode"] == mode, "communicator"].dropna()
            comm = str(ran.iloc[0]) if len(ran) else comm
        batches = sorted(int(b) for b in replay.loc[replay["mode"] == mode, "batch"].unique())
        # an eager GPU step is issued op by op by its host: priced by the host's measured cost per call
        # when 02 and 03 measured it, else as GEMMs + collectives in series
        eager_gpu = mode == "eager" and inp.timing == "cuda_graph" and sp.has_host_costs(inp.gemm, inp.coll, comm)
        try:
            pred = (sp.predict_replay_eager(inp.gemm, inp.coll, inp.arch, inp.tp, batches, comm,
                                            host_ref_us=sp.replay_host_refs(replay)) if eager_gpu else
                    sp.predict_replay(inp.gemm, inp.coll, inp.arch, inp.tp, batches, comm, timing))
        except (ValueError, KeyError):
            continue
        for r in sp.compare_with_replay(pred, replay, mode=mode).itertuples():
            rows.append({"batch": int(r.batch), "mode": mode, "replay_us": float(r.replay_us),
                         "predicted_us": float(r.predicted_us), "low_us": float(r.low_us), "high_us": float(r.high_us),
                         "error": float(r.error), "communicator": comm,
                         "model": "host_paced" if eager_gpu else "serial"})
    return rows
