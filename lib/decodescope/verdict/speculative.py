"""Speculative decoding priced whole: tokens per verify step from the measured acceptance, the drafter's
own cost, and the step they make together.

A verify step at batch b with k draft tokens a request checks b x (k + 1) tokens and yields, a request,
one token plus the drafted tokens accepted before the first rejection. vLLM counts, over a level, the
drafts (`vllm:spec_decode_num_drafts`) and the tokens accepted at each draft position
(`..._num_accepted_tokens_per_pos`); a token at position i is accepted only when every one before it
was, so accepted[i] / drafts is the probability that a draft reaches i + 1 accepted tokens, and the
expected tokens per verify step is 1 + sum_i accepted[i] / drafts (`server_spec_accept_len`). The
i.i.d. formula (1 - a^(k+1)) / (1 - a) with a = accepted / drafted tokens is right only when every
position accepts alike; measured positions fall off (92 / 76 / 67 of 273 drafts on the embedded
default: 1.86 tokens a verify step, where a = 0.29 i.i.d. reads 1.39).

A draft model's cost is its own forward passes: k of them a verify step at batch b (the first also takes
the tokens the last verify accepted). With the target itself as draft (the same architecture at the same
tensor-parallel size) each is a decode step of the target at batch b, which the step model prices.
"""
from __future__ import annotations

from typing import Optional, Sequence

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


def spec_period_us(verify_us: float, draft_step_us: float, k: int) -> float:
    """One verify step and its k draft passes, end to end."""
    return verify_us + k * draft_step_us


def spec_tpot_us(verify_us: float, draft_step_us: float, k: int, tokens: float) -> float:
    """Time per output token a request sees: the speculative period over the tokens it yields."""
    return spec_period_us(verify_us, draft_step_us, k) / tokens


def best_k(verify_us_at_k, draft_step_us: float, per_position: Sequence[float],
           ks: Sequence[int] = (1, 2, 3, 4, 5)) -> tuple[int, dict[int, float]]:
    """(the k of least projected TPOT, TPOT per k) for the measured acceptance; verify_us_at_k(k) prices the
    verify step of k draft tokens a request."""
    tpot = {k: spec_tpot_us(verify_us_at_k(k), draft_step_us, k, tokens_per_verify_at_k(per_position, k)) for k in ks}
    return min(tpot, key=lambda k: tpot[k]), tpot


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
