"""Noise of a figure measured several times (repeats), and whether two sets of repeats differ by more
than that noise.

Method (one, everywhere): the **percentile bootstrap of the median**, 95%, `N_BOOT` resamples drawn
with a fixed seed (`SEED`), so the same repeats always give the same band and the same call.

- `band(values)`: the median of the repeats and the 2.5th-97.5th percentiles of the medians of
  resamples (with replacement, same size) of them. One value (or none) has no band: the record says
  `no repeats` and its low/high are None; nothing is invented.
- `differ(a, b)`: the difference of medians b - a and its band, from resampling a and b independently.
  `significant` when that band excludes 0, `within noise` when it holds 0. Each side needs at least
  `MIN_REPEATS_TO_CALL` repeats to be called at all: with 2 repeats a resampled median takes only three
  values, and two runs of pure noise come out "significant" about one time in three. Below that the
  call is `too few repeats` (one side with 2) or `no repeats` (a side with 1).
  With 3 repeats a side the test calls a difference when the two sets of repeats do not overlap:
  about 1 in 10 pairs of pure-noise runs (exchangeable repeats) are called significant; from 4 a side,
  1 in 15 or fewer (tests/test_compare.py measures it). More repeats make the call both more sensitive
  and better calibrated.

Plain data in and out: values are any sequence of numbers (NaN and None are left out); the results
are frozen dataclasses with `as_dict()`, and `band_frame` / `differ_frame` work on DataFrames.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import pandas as pd

CONFIDENCE = 0.95
N_BOOT = 4000
SEED = 0
MIN_REPEATS_TO_CALL = 3
METHOD = f"percentile bootstrap of the median, {100 * CONFIDENCE:.0f}%, {N_BOOT} resamples, seed {SEED}"

SIGNIFICANT = "significant"
WITHIN_NOISE = "within noise"
TOO_FEW = "too few repeats"
NO_REPEATS = "no repeats"
CALLS = (SIGNIFICANT, WITHIN_NOISE, TOO_FEW, NO_REPEATS)


@dataclass(frozen=True)
class Band:
    """A figure measured n times: its median and 95% band (None for both ends when n < 2)."""

    n: int
    median: Optional[float]
    low: Optional[float]
    high: Optional[float]
    method: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Difference:
    """b against a: the difference of medians (b - a), its band, and the call."""

    n_a: int
    n_b: int
    median_a: Optional[float]
    median_b: Optional[float]
    delta: Optional[float]          # median_b - median_a
    delta_pct: Optional[float]      # 100 * delta / median_a (None when median_a is 0 or missing)
    low: Optional[float]            # band of delta; None without repeats
    high: Optional[float]
    call: str                       # one of CALLS
    method: str

    def as_dict(self) -> dict:
        return asdict(self)


def clean(values: Iterable) -> np.ndarray:
    """The finite numbers of `values`, as floats (None, NaN and inf left out)."""
    if values is None:
        return np.empty(0)
    arr = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(dtype=float)
    return arr[np.isfinite(arr)]


def _boot_medians(x: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    return np.median(x[idx], axis=1)


def _tails(confidence: float) -> tuple[float, float]:
    alpha = 100 * (1 - confidence) / 2
    return alpha, 100 - alpha


def band(values: Sequence, confidence: float = CONFIDENCE, n_boot: int = N_BOOT, seed: int = SEED) -> Band:
    """Median and the percentile-bootstrap band of the median of `values` (the repeats of one figure)."""
    x = clean(values)
    if len(x) == 0:
        return Band(0, None, None, None, NO_REPEATS)
    median = float(np.median(x))
    if len(x) == 1:
        return Band(1, median, None, None, NO_REPEATS)
    meds = _boot_medians(x, np.random.default_rng(seed), n_boot)
    lo, hi = np.percentile(meds, _tails(confidence))
    return Band(len(x), median, float(lo), float(hi), _method(confidence, n_boot, seed))


def differ(a: Sequence, b: Sequence, confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
           seed: int = SEED, min_repeats: int = MIN_REPEATS_TO_CALL) -> Difference:
    """Whether b's repeats differ from a's by more than the noise: the bootstrap band of
    median(b) - median(a) excludes 0 (`significant`) or holds it (`within noise`); `too few repeats`
    or `no repeats` when a side has fewer than `min_repeats` or fewer than 2 repeats."""
    xa, xb = clean(a), clean(b)
    med_a = float(np.median(xa)) if len(xa) else None
    med_b = float(np.median(xb)) if len(xb) else None
    delta = None if med_a is None or med_b is None else med_b - med_a
    pct = None if delta is None or not med_a else 100.0 * delta / med_a
    if min(len(xa), len(xb)) < 2:
        return Difference(len(xa), len(xb), med_a, med_b, delta, pct, None, None, NO_REPEATS, NO_REPEATS)
    rng = np.random.default_rng(seed)
    diffs = _boot_medians(xb, rng, n_boot) - _boot_medians(xa, rng, n_boot)
    lo, hi = (float(v) for v in np.percentile(diffs, _tails(confidence)))
    if min(len(xa), len(xb)) < min_repeats:
        call = TOO_FEW
    else:
        call = SIGNIFICANT if lo > 0 or hi < 0 else WITHIN_NOISE
    return Difference(len(xa), len(xb), med_a, med_b, delta, pct, lo, hi, call, _method(confidence, n_boot, seed))


def _method(confidence: float, n_boot: int, seed: int) -> str:
    return f"percentile bootstrap of the median, {100 * confidence:.0f}%, {n_boot} resamples, seed {seed}"


# ---- DataFrames ------------------------------------------------------------------------------------
BAND_COLUMNS = ["n", "median", "low", "high", "method"]
DIFFERENCE_COLUMNS = ["n_a", "n_b", "median_a", "median_b", "delta", "delta_pct", "low", "high", "call", "method"]


def band_frame(df: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    """One row per group of `keys`: the band of `value` over the group's rows (its repeats)."""
    rows = [{**dict(zip(keys, k if isinstance(k, tuple) else (k,))), **band(g[value]).as_dict()}
            for k, g in df.groupby(keys, sort=True)]
    return pd.DataFrame(rows, columns=[*keys, *BAND_COLUMNS])


def differ_frame(a: pd.DataFrame, b: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    """One row per group of `keys` found in either frame (a's groups in a's order, then b's others):
    b's repeats of `value` against a's. A group missing from one side has that side's median None and
    the call `no repeats`. Keys must not be NaN (a NaN key matches nothing)."""
    ga = {k if isinstance(k, tuple) else (k,): g[value] for k, g in a.groupby(keys, sort=False)} if len(a) else {}
    gb = {k if isinstance(k, tuple) else (k,): g[value] for k, g in b.groupby(keys, sort=False)} if len(b) else {}
    rows = [{**dict(zip(keys, k)), **differ(ga.get(k, []), gb.get(k, [])).as_dict()}
            for k in dict.fromkeys([*ga, *gb])]
    return pd.DataFrame(rows, columns=[*keys, *DIFFERENCE_COLUMNS])


def trimmed_mean(values: Sequence, trim: float) -> float:
    """The mean of `values` without the lowest and highest `trim` share of them (int(n x trim) each)."""
    v = np.sort(np.asarray(values, dtype=float))
    k = int(len(v) * trim)
    return float(v[k:len(v) - k].mean())
