"""What each fix would buy, priced on the measured step: pure functions of measured inputs.

Every projection returns a `Projection`: the step time (and TPOT) it predicts, a band, and the
assumptions it rests on in words, so the verdict can print them beside the number. The band comes from
the one thing a projection cannot know from serial micro-benchmarks alone: how much of the changed work
sits on the step's critical path. The profile says how much overlaps (summed kernel time vs the
wall-clock step); the band runs from "the change is fully on the critical path" (saving in full) to
"it overlaps as much as the step does on average" (saving x wall / summed).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from decodescope.model import arch as archmod
from decodescope.verdict import stepparts as sp
from decodescope.micro.bench import with_timing_columns
from decodescope.exec.engine_comm import micro_communicator_for


@dataclass(frozen=True)
class MeasuredStep:
    """The step as the profile and the micro-benchmarks measured it (one rank, one decode step)."""

    wall_us: float              # wall-clock decode step (profile), or client TPOT
    summed_us: float            # summed kernel/op time per step (profile); >= wall when streams overlap
    allreduce_calls: int        # all-reduces per step (profile; the architecture's count when absent)
    allreduce_us_per_call: float  # what one all-reduce costs in the step (profile)
    batch: int = 1

    @property
    def overlap_factor(self) -> float:
        """wall / summed: the share of summed work that the wall-clock step pays for."""
        return min(1.0, self.wall_us / self.summed_us) if self.summed_us > 0 else 1.0


@dataclass(frozen=True)
class Projection:
    name: str
    step_us: float
    low_us: float
    high_us: float
    tokens_per_step: float = 1.0
    assumptions: list[str] = field(default_factory=list)

    @property
    def tpot_us(self) -> float:
        return self.step_us / self.tokens_per_step

    @property
    def gain(self) -> float:
        """Relative TPOT change against the measured step's wall (negative = faster)."""
        return self.tpot_us / self._base_us - 1.0 if self._base_us else float("nan")

    _base_us: float = 0.0


def _saving(step: MeasuredStep, name: str, saved_serial_us: float, assumptions: list[str]) -> Projection:
    """A change that removes saved_serial_us of serial work: the band runs from the saving discounted
    by the step's overlap to the saving in full; the central value is the discounted one."""
    full = step.wall_us - saved_serial_us
    discounted = step.wall_us - saved_serial_us * step.overlap_factor
    lo, hi = sorted((full, discounted))
    return Projection(name, discounted, lo, hi, 1.0, assumptions + [
        f"saving counted x {step.overlap_factor:.2f} (wall / summed, from the profile) in the central value; "
        "the band's low end counts it in full (all on the critical path)"], _base_us=step.wall_us)


def allreduce_latency(step: MeasuredStep, new_us_per_call: float, label: str) -> Projection:
    """Every all-reduce of the step at another per-call latency (another communicator measured by 03,
    a given latency, or another link through the fitted alpha-beta curve)."""
    saved = step.allreduce_calls * (step.allreduce_us_per_call - new_us_per_call)
    return _saving(step, f"all-reduce at {new_us_per_call:.1f} us per call ({label})", saved, [
        f"{step.allreduce_calls} all-reduces per step, each from {step.allreduce_us_per_call:.1f} us "
        f"to {new_us_per_call:.1f} us; nothing else changes"])


def expert_parallel(step: MeasuredStep, moe_layers: int, all_to_all_us: float) -> Projection:
    """MoE layers under expert parallelism: each MoE layer's all-reduce is replaced by a dispatch and a
    combine all-to-all (all_to_all_us each, measured by 03 at batch x top_k tokens per GPU)."""
    saved = moe_layers * (step.allreduce_us_per_call - 2 * all_to_all_us)
    return _saving(step, f"expert parallelism (2 all-to-all of {all_to_all_us:.1f} us per MoE layer)", saved, [
        f"{moe_layers} MoE layers: one all-reduce of {step.allreduce_us_per_call:.1f} us each replaced by "
        f"dispatch + combine all-to-all of {all_to_all_us:.1f} us each; expert GEMMs unchanged (the same "
        "tokens reach the same experts); load balance across GPUs assumed"])


def expected_tokens_per_verify(k: int, alpha: float) -> float:
    """Speculative decoding with k draft tokens and per-token acceptance alpha (i.i.d.): expected tokens
    per verify step, (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al.)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative(step: MeasuredStep, k: int, alpha: float, verify_step_us: float, draft_us: float = 0.0,
                verify_band_us: tuple[float, float] | None = None) -> Projection:
    """TPOT with k draft tokens at acceptance alpha: (verify step at batch x (k+1) + draft cost) / expected
    tokens. verify_step_us comes from the step model at b x (k+1): GEMMs and message sizes grow with the
    tokens, the number of all-reduces does not; draft_us is ~0 for n-gram, a draft model's step otherwise."""
    tokens = expected_tokens_per_verify(k, alpha)
    lo, hi = verify_band_us or (verify_step_us, verify_step_us)
    return Projection(f"speculative decoding k={k}, alpha={alpha:.2f}", verify_step_us + draft_us,
                      lo + draft_us, hi + draft_us, tokens, [
                          f"expected tokens per verify step (1 - a^(k+1)) / (1 - a) = {tokens:.2f}",
                          f"verify step {verify_step_us / 1e3:.2f} ms (the step at batch x {k + 1}), draft "
                          f"{draft_us / 1e3:.2f} ms; acceptance independent per token"], _base_us=step.wall_us)


def projection_rows(projections: list[Projection]) -> list[dict]:
    """The table the verdict shows, ranked by projected TPOT change (best first)."""
    rows = [{"fix": p.name, "step_us": p.step_us, "low_us": p.low_us, "high_us": p.high_us,
             "tokens_per_step": p.tokens_per_step, "tpot_us": p.tpot_us,
             "tpot_low_us": p.low_us / p.tokens_per_step, "tpot_high_us": p.high_us / p.tokens_per_step,
             "gain_pct": 100 * p.gain, "assumptions": "; ".join(p.assumptions)} for p in projections]
    return sorted(rows, key=lambda r: r["gain_pct"])


def measured_projections(step: MeasuredStep, coll, gemm, arch, tp: int, profile_communicator: str,
                         spec_k: tuple[int, ...] = (1, 3), spec_alpha: tuple[float, ...] = (0.5, 0.7, 0.9),
                         dtype: str = "bf16") -> list[Projection]:
    """Every projection the measured inputs allow: all-reduce through each communicator 03 measured (at
    the step's message size, timed as a step issues them), expert parallelism from 03's all-to-all at
    batch x top_k tokens per GPU, and speculative decoding with the verify step grown by the GEMMs (02)
    and collectives (03) at batch x (k+1)."""
    out: list[Projection] = []
    msg = next(c.msg_bytes for c in archmod.collective_schedule(arch, tp, step.batch, dtype) if c.op == "all_reduce")
    sweep = with_timing_columns(coll[(coll["part"] == "sweep") & (coll["status"] == "ok")]) if coll is not None \
        else None
    best_timing: dict[str, str] = {}
    if sweep is not None and not sweep.empty:
        for comm, g in sweep[sweep["op"] == "all_reduce"].groupby("communicator"):
            timing = "cuda_graph" if (g["timing"] == "cuda_graph").any() else "back_to_back"
            curve = sp.latency_curve(coll, comm, timing)
            if curve.empty:
                continue
            best_timing[comm] = timing
            lat, extrapolated = sp.latency_at(curve, msg)
            label = f"{comm}, 03 {timing}" + (", extrapolated" if extrapolated else "")
            out.append(allreduce_latency(step, lat, label))
        a2a = coll[(coll["part"] == "all_to_all") & (coll["status"] == "ok")]
        if arch.moe_layers and not a2a.empty:
            tokens = step.batch * arch.top_k
            nearest = int(a2a.iloc[(a2a["tokens_per_gpu"] - tokens).abs().argsort()[:1]]["tokens_per_gpu"].iloc[0])
            p = expert_parallel(step, arch.moe_layers,
                                float(a2a.loc[a2a["tokens_per_gpu"] == nearest, "time_us"].median()))
            out.append(replace(p, assumptions=p.assumptions + [
                f"all-to-all measured at {nearest} tokens per GPU (batch {step.batch} x top-{arch.top_k} = {tokens})"]))
    micro_comm = micro_communicator_for(profile_communicator)
    sm_comm = micro_comm if micro_comm in best_timing else next(iter(best_timing), None)
    if sm_comm is not None and gemm is not None and not gemm.empty:
        for k in spec_k:
            grown = step.batch * (k + 1)
            d_gemm = (sp.gemm_component(gemm, arch, tp, grown, dtype).us - sp.gemm_component(gemm, arch, tp, step.batch, dtype).us)
            d_coll = (sp.collective_component(coll, arch, tp, grown, sm_comm, best_timing[sm_comm], dtype).us
                      - sp.collective_component(coll, arch, tp, step.batch, sm_comm, best_timing[sm_comm], dtype).us)
            verify = step.wall_us + d_gemm + d_coll
            for alpha in spec_alpha:
                p = speculative(step, k, alpha, verify)
                out.append(replace(p, assumptions=p.assumptions + [
                    f"verify step = measured step + GEMMs (02) {d_gemm / 1e3:+.2f} ms + collectives (03, {sm_comm}) "
                    f"{d_coll / 1e3:+.2f} ms at batch {grown}; n-gram drafting, cost ~0"]))
    return out
