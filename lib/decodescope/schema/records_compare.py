"""compare.json: a comparison of runs as data, beside its page (report.compare_gate writes it, a CI job reads
it): what makes the runs comparable, each gated figure with both values, the difference, its band and call,
and the gate's verdict."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from decodescope.schema.recordbase import Record, _Model

COMPARE_RECORD = "compare.json"  # the name's stem is the page's: <A>-vs-<B>.html beside <A>-vs-<B>.json


class CompareSource(_Model):
    letter: str = Field(description="A is the base; B, C, ... are each set against it")
    label: str = Field(description="run directory name, with :VARIANT for a variant")
    run_dir: str
    variant: Optional[str] = None


class ComparabilityCheck(_Model):
    """One property that makes two runs comparable, as each source recorded it."""

    key: str = Field(description="model, tensor_parallel, engine_version, all_reduce or host")
    base: str = Field(description="the base's letter")
    run: str = Field(description="the other source's letter")
    value_a: Optional[str] = Field(None, description="the base's value; None: not recorded")
    value_b: Optional[str] = None
    status: Literal["same", "differs", "unknown", "allowed"] = Field(
        description="unknown: a side did not record it; allowed: differs, and --allow-mismatch named it")
    source: str = Field(description="where the value is read: the file and field")


class GatedMetric(_Model):
    """One figure of the other source against the base's, with the gate it was held to."""

    family: str = Field(description="throughput, tpot, ttft, e2e, server_tpot (serving, per level), step (the step's own "
                                    "figures), category (time per decode step by category)")
    metric: str = Field(description="the column or figure compared, unit-suffixed: e.g. tpot_p50_us, wall_us_median")
    level: Optional[int] = Field(None, description="serving concurrency, or the profiled concurrency of 04")
    label: str = Field(description="as the gate's message names it")
    unit: str
    better: Literal["lower", "higher"]
    base: str
    run: str
    value_a: Optional[float] = None
    value_b: Optional[float] = None
    delta: Optional[float] = Field(None, description="value_b - value_a")
    delta_pct: Optional[float] = None
    band_low: Optional[float] = Field(None, description="95% band of the difference (bootstrap over repeats)")
    band_high: Optional[float] = None
    n_a: int = 0
    n_b: int = 0
    call: str = Field(description="significant, within noise, too few repeats, no repeats (decodescope.core.stats)")
    worse_pct: Optional[float] = Field(None, description="how much worse, in % of the base (negative: better)")
    gate_pct: Optional[float] = Field(None, description="the gate it was held to; None: not gated")
    verdict: Literal["ok", "regression", "regression, noise unknown", "worse within noise", "not gated",
                     "not in both", "not gated: burst delivery"] = Field(
        description="regression: worse beyond the gate and the band excludes 0; regression, noise unknown: worse "
                    "beyond the gate, a side measured fewer than 3 repeats; worse within noise: beyond the gate, "
                    "the band holds 0; not gated: burst delivery: TPOT or TTFT of a level whose stream came in bursts "
                    "(itl_coalesced_frac over serving.metrics.COALESCED_FRAC_LIMIT on a side): they describe the "
                    "delivery, not the decode (docs/methods.md)")


class CompareResult(Record):
    sources: list[CompareSource]
    page: str = Field(description="the HTML page this record sits beside")
    comparability: list[ComparabilityCheck] = Field(default_factory=list)
    refused: bool = Field(False, description="a gate was asked for and the runs differ in what makes them "
                                             "comparable: nothing was gated")
    gates: dict[str, Optional[float]] = Field(default_factory=dict,
                                              description="--gate and --gate-metric as given: name -> percent")
    metrics: list[GatedMetric] = Field(default_factory=list)
    regressions: int = 0
    exit_status: int = Field(0, description="0 no regression; 1 a regression; 2 a gate that held no figure both runs "
                                             "measured; 4 refused (README: compare's exit status)")
    method: str = Field(description="how the noise band is made")
