"""Speculative decoding priced whole: tokens per verify step from the measured acceptance, the drafter's
own cost, and the step they make together.

A verify step at batch b with k draft tokens a request checks b x (k + 1) tokens.
It yields, a request, one token plus the drafted tokens accepted before the first rejection.
Over a level, vLLM counts the drafts (`vllm:spec_decode_num_drafts`).
It also counts the tokens accepted at each draft position (`..._num_accepted_tokens_per_pos`).
A token at position i is accepted only when every one before it was.
So accepted[i] / drafts is the probability that a draft reaches i + 1 accepted tokens.
The expected tokens per verify step is then 1 + sum_i accepted[i] / drafts (`server_spec_accept_len`).
The i.i.d. formula is (1 - a^(k+1)) / (1 - a), with a = accepted / drafted tokens.
It is right only when every position accepts alike.
Measured positions fall off: 92 / 76 / 67 of 273 drafts on the embedded default.
That is 1.86 tokens a verify step, where a = 0.29 i.i.d. reads 1.39.

A draft model's cost is its own forward passes: k of them a verify step at batch b.
The first also takes the tokens the last verify accepted.
The target itself may be the draft: the same architecture at the same tensor-parallel size.
Then each pass is a decode step of the target at batch b, which the step model prices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from decodescope.exec.serverlaunch import SELF_MODEL


def acceptance_per_position(accepted_per_pos: Sequence[float], drafts: float) -> list[float]:
    """P(a draft reaches position i + 1 accepted) for each position: accepted[i] / drafts."""
    if drafts <= 0:
        raise ValueError(f"drafts must be positive to read acceptance per position, got {drafts}")
    return [float(a) / drafts for a in accepted_per_pos]


def tokens_per_verify(per_position: Sequence[float]) -> float:
    """Expected tokens a request gains per verify step: the bonus token plus each position's acceptance."""
    return 1.0 + float(sum(per_position))


def tokens_per_verify_at_k(per_position: Sequence[float], k: int) -> float:
    """The same at k draft tokens: the first k positions measured; past them, each further position accepts
    at the last measured position's rate given the one before (a geometric tail)."""
    p = list(per_position)
    if k <= len(p):
        return tokens_per_verify(p[:k])
    ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else (p[-1] if p else 0.0)
    while len(p) < k:
        p.append((p[-1] if p else 1.0) * ratio)
    return tokens_per_verify(p)


def spec_tpot_us(verify_us: float, drafter_us: float, tokens: float) -> float:
    """Time per output token a request sees: one verify step and its drafter, over the tokens it yields."""
    return (verify_us + drafter_us) / tokens


def best_k(verify_us_at_k, drafter_us_at_k, per_position: Sequence[float],
           ks: Sequence[int] = (1, 2, 3, 4, 5)) -> tuple[int, dict[int, float]]:
    """(the k of least projected TPOT, TPOT per k) for the measured acceptance; verify_us_at_k(k) prices the
    verify step of k draft tokens a request, drafter_us_at_k(k) the drafter's time a verify step."""
    tpot = {k: spec_tpot_us(verify_us_at_k(k), drafter_us_at_k(k), tokens_per_verify_at_k(per_position, k))
            for k in ks}
    return min(tpot, key=lambda k: tpot[k]), tpot


def drafter_key(spec_config: dict) -> str:
    """What makes two speculative configs the same drafter: the method and the draft model, not k."""
    return f"{str(spec_config.get('method', '')).lower()}|{str(spec_config.get('model') or '').rstrip('/')}"


def drafter_of(spec_config: dict, target_model: Optional[str]) -> str:
    """Which drafter a speculative config names: 'self' (the target as its own draft), 'draft model',
    'ngram', 'eagle' or the method as given."""
    method = str(spec_config.get("method", "")).lower()
    if method in ("draft_model", "draft-model"):
        model = str(spec_config.get("model") or "").rstrip("/")
        same = model == SELF_MODEL or (target_model is not None and model == str(target_model).rstrip("/"))
        return "self" if same else "draft model"
    if method in ("ngram", "[ngram]"):
        return "ngram"
    return method or "unknown"


@dataclass(frozen=True)
class DrafterCost:
    """A drafter's time per verify step as one profiled level of a speculative variant measured it (04's
    drafter_steps.json), scaled to the unprofiled step: x the level's unprofiled over profiled inter-token
    latency (its profile_capture.json), as the profiler slows each host op alike.

    verify_host_us is the verify step's host time there; apart says the engine's device runs apart from its
    host (a GPU trace), so the drafter's lead can overlap the verify's device work."""

    variant: str
    k: int
    batch: float
    lead_us: float
    first_pass_us: float
    next_pass_us: Optional[float]
    scale: float
    verify_host_us: Optional[float] = None
    apart: bool = False

    def at_k(self, k: int, verify_us: Optional[float] = None) -> float:
        """The lead on the step's path + the first pass + (k - 1) later passes, unprofiled; a later pass costs
        the first where this level ran one pass only. verify_us: the verify step as priced."""
        later = self.next_pass_us if self.next_pass_us is not None else self.first_pass_us
        if self.overlaps_verify(verify_us):
            return self.lead_on_path(verify_us) + self.scale * (self.first_pass_us + (k - 1) * later)
        return self.scale * (self.lead_us + self.first_pass_us + (k - 1) * later)

    def overlaps_verify(self, verify_us: Optional[float]) -> bool:
        """Whether the lead can run beside the verify's device work: a GPU's, with the verify priced."""
        return self.apart and verify_us is not None and self.verify_host_us is not None

    def lead_on_path(self, verify_us: Optional[float]) -> float:
        """The lead's unprofiled time that lengthens the step.

        The lead starts when the host has launched the verify.
        On a GPU the device still runs the verify then, and the host prepares the drafter meanwhile.
        The step waits for both, so only what the host's verify and lead take past the verify as priced counts.
        Where the host is the device (vLLM CPU), the host's verify is the verify's work: the lead follows it whole."""
        if not self.overlaps_verify(verify_us) or verify_us is None or self.verify_host_us is None:
            return self.scale * self.lead_us
        return max(0.0, self.scale * (self.verify_host_us + self.lead_us) - verify_us)


def drafter_us(costs: Sequence[DrafterCost], k: int, batch: float,
               verify_us: Optional[float] = None) -> tuple[float, str]:
    """The drafter's time per verify step at k draft tokens and `batch`, from one variant's profiled levels:
    linear in batch between them, held at the nearest one outside. costs: one variant's, any order.
    verify_us: the verify step as priced, which a GPU's lead overlaps (DrafterCost.lead_on_path)."""
    pts = sorted(costs, key=lambda c: c.batch)
    xs, ys = [c.batch for c in pts], [c.at_k(k, verify_us) for c in pts]
    src = pts[0]
    scales = sorted({f"{c.scale:.2f}" for c in pts})
    lead = ("rejection and inputs past the verify's device work" if src.overlaps_verify(verify_us)
            else "rejection and inputs")
    how = (f"drafter measured in {src.variant}'s profile (k={src.k}, levels "
           + ", ".join(f"c{c.batch:g}" for c in pts)
           + f"): {lead} + first pass + {k - 1} later passes, x {'-'.join(scales)} unprofiled")
    if len(xs) == 1 or batch <= xs[0]:
        return ys[0], how
    if batch >= xs[-1]:
        return ys[-1], how
    return float(np.interp(batch, xs, ys)), how


def nearest_drafter(sources: dict[str, list[DrafterCost]], own: str, k: int) -> Optional[list[DrafterCost]]:
    """The measurements to price a variant's drafter by: its own profile's, else those of the variant of the
    same drafter whose k is nearest (the passes are the same model's forwards at any k)."""
    if sources.get(own):
        return sources[own]
    ranked = sorted((abs(c[0].k - k), name) for name, c in sources.items() if c)
    return sources[ranked[0][1]] if ranked else None
