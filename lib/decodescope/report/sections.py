"""Notebook sections that choose what to show from what a phase produced, so a notebook cell stays a
single call (the branching lives here, with the data)."""
from __future__ import annotations

from typing import cast

import pandas as pd
from pydantic import BaseModel  # for the casts to frame's list[BaseModel]: list is invariant, frame only reads it

from decodescope.exec.hardware import pairs_frame
from decodescope.report.micro_view import measured_dtypes
from decodescope.schema.records import (AttributionRow, CurveRow, FINDING_TOPICS, LevelReconcileRow, ProjectionRow,
                                        ReconcileRow, ReplayRow, VariantRow, Verdict, frame)
from decodescope.schema.records_host import HostInventory
from decodescope.schema.records_verdict import SpecKRow
from decodescope.report import plots
from decodescope.show.display import show, show_note, show_table
from decodescope.verdict.verdict import LEVEL_TOLERANCE, NO_STEP_MODEL


def host_interconnect(inv: HostInventory, tables: dict, source: str) -> None:
    if "gpus" not in tables:
        show_note("**No NVIDIA GPU on this host** (`nvidia-smi` absent or found none): the embedded default "
                  "runs on the CPU.")
        return
    show_table(tables["gpus"], caption="GPUs from nvidia-smi - " + source)
    if inv.topology_pairs:
        show(plots.topology_heatmap(pairs_frame(inv)))
        show_table(tables["link_classes"], caption="GPU pairs per link class - " + source)


def host_peaks(tables: dict, source: str) -> None:
    if "peaks" in tables:
        show_table(tables["peaks"], caption="peaks used for rooflines - " + source)
    if "cpu_matmul" in tables:
        show(plots.cpu_matmul_bars(tables["cpu_matmul"]))
        show_table(tables["cpu_matmul"], caption="measured CPU matmul - " + source)


def gemm_per_dtype(gemm: pd.DataFrame) -> None:
    for dtype in measured_dtypes(gemm):
        show(plots.gemm_time_vs_batch(gemm, dtype))


def verdict_attribution(v: Verdict) -> None:
    if v.attribution:
        show(plots.attribution_bars(frame(cast("list[BaseModel]", v.attribution), AttributionRow)))


def verdict_reconcile(v: Verdict) -> None:
    show_table(frame(cast("list[BaseModel]", v.reconcile), ReconcileRow) if v.reconcile else pd.DataFrame(),
               caption="per decode step - verdict.json")


def verdict_levels(v: Verdict) -> None:
    """Client TPOT at every serving level against the profiled step and the step model."""
    if not v.levels:
        show_note("*No serving sweep in this run: nothing to set the step against.*")
        return

    df = frame(cast("list[BaseModel]", v.levels), LevelReconcileRow)
    off = df[df["within_tolerance"] == False]  # noqa: E712 (None = no profile to compare with)
    show_note(f"Client TPOT p50 against the profiled decode step ({len(df) - len(off)} of {len(df)} levels within "
              f"{100 * LEVEL_TOLERANCE:.0f}%)." + (" Outside: " + "; ".join(f"concurrency {r.level}: {r.attributed_to or 'no cause measured'}"
                                                             for r in off.itertuples()) + "." if len(off) else ""))
    missed = df[df["model_miss"].fillna("") != ""] if "model_miss" in df else df.iloc[:0]
    if len(missed):
        show_note("The step model's misses beyond 10%: " + "; ".join(
            f"concurrency {r.level} ({100 * r.model_error:+.0f}%): {r.model_miss}" for r in missed.itertuples()) + ".")
    show_table(df, caption="serving levels against the step - verdict.json (01, 02, 03, 04)")


def verdict_projections(v: Verdict) -> None:
    """The fixes priced from measured inputs, ranked, each with its bound on the critical path; then the fixes
    with an assumed input, as the condition under which each would pay off (never ranked as a gain)."""
    if not v.projections:
        show_note(f"*No projection in this run: {v.sources.get('projections') or NO_STEP_MODEL}.*")
        return
    proj = frame(cast("list[BaseModel]", v.projections), ProjectionRow)
    ranked = proj[proj["status"] != "break-even"]
    if len(ranked):
        show(plots.projection_bars(ranked, v.wall_us))
        best, worst = ranked.iloc[0], ranked.iloc[-1]
        show_note(f"Best projected fix, every input measured: **{best['fix']}**, TPOT {best['gain_pct']:+.0f}% "
                  f"({best['tpot_low_us'] / 1e3:.2f}-{best['tpot_high_us'] / 1e3:.2f} ms). "
                  f"Least useful: {worst['fix']} ({worst['gain_pct']:+.0f}%). Sources: {v.sources.get('projections', '')}.")
        show_table(ranked[["rank", "fix", "status", "tpot_us", "tpot_low_us", "tpot_high_us", "gain_pct", "bound",
                           "bound_gain_pct", "beyond_bound", "tokens_per_step", "assumptions"]],
                   caption="fixes priced on the measured step, ranked, each beside its bound on the critical path "
                           "- verdict.json")
    assumed = proj[proj["status"] == "break-even"]
    for condition, rows in assumed.groupby(assumed["condition"].where(assumed["condition"] != "", assumed["assumptions"]),
                                           sort=False):
        show_note(f"Not ranked, an input assumed: **{'; '.join(rows['fix'])}**. {condition}.")


def verdict_curves(v: Verdict) -> None:
    """TPOT vs tokens/s per GPU for the sweep, the step model and each fix; the model's components."""
    if not v.curves:
        show_note("*No step model in this run: it needs 02 (GEMMs) and, above one GPU, 03 (collectives).*")
        return

    show(plots.tpot_vs_throughput(frame(cast("list[BaseModel]", v.curves), CurveRow)))
    if v.step_model:
        comps = pd.DataFrame(v.step_model)
        wide = comps.pivot_table(index="component", columns="batch", values="us", aggfunc="first")
        show_table(wide.reset_index(), caption="the step model's components, us per step at each batch - verdict.json "
                                               "(sources: " + "; ".join(sorted(set(comps["source"]))) + ")")


def verdict_findings(v: Verdict) -> None:
    """The verdict page: each sentence with a link to its figure and its files."""
    if not v.findings:
        return

    lines = []
    for topic, title in FINDING_TOPICS.items():
        mine = [f for f in v.findings if f.topic == topic]
        if not mine:
            continue
        lines.append(f"**{title}**\n")
        for f in mine:
            links = ([f"[figure](#{f.figure})"] if f.figure else []) + [f"[{p}]({p})" for p in f.files]
            lines.append(f"- {f.text} ({', '.join(links)})")
        lines.append("")
    show_note("\n".join(lines))


def verdict_replay(v: Verdict) -> None:
    """The step replay (03) against the step model's GEMMs + collectives."""
    if not v.replay:
        show_note("*No step replay in this run (03 runs it), or no GEMMs (02) to price it.*")
        return

    df = frame(cast("list[BaseModel]", v.replay), ReplayRow)
    show(plots.replay_vs_model(df))
    show_table(df, caption="step replay vs step model - verdict.json (step_replay.parquet, gemm.parquet, collectives.parquet)")


def verdict_variants(v: Verdict) -> None:
    """Each variant measured against the baseline and against its projection."""
    if not v.variants:
        show_note("*No variants in this run (params `experiments:`).*")
        return

    df = frame(cast("list[BaseModel]", v.variants), VariantRow)
    show(plots.variant_bars(df))
    show_table(df, caption="variants: measured (their 01) vs baseline and vs projection - verdict.json, "
                           "variants/<name>/data/serving_levels.parquet")


def verdict_spec_k(v: Verdict) -> None:
    """Speculative decoding at k = 1..5 for each drafter and sampling the variants measured (greedy included):
    projected from the unprofiled variants (speccurve.unprofiled_k_rows) and measured."""
    if not v.spec_k:
        show_note("*No speculative variant measured with the server's spec-decode metrics, or the step model did "
                  "not run: add a variant with a `speculative-config` to `experiments` (no profile needed).*")
        return
    df = frame(cast("list[BaseModel]", v.spec_k), SpecKRow)
    show(plots.spec_k_curves(df))
    best = df[df["best_projected"]]
    show_note("Best k projected: " + "; ".join(f"{r.drafter} drafter at c={r.level}: k={r.k} "
                                               f"({r.projected_tpot_us / 1e3:.2f} ms)" for r in best.itertuples()) + ".")
    show_table(df, caption="speculative decoding across k, priced from the unprofiled variants - verdict.json "
                           "(variants/<name>/data/serving_levels.parquet)")


def verdict_serving(v: Verdict) -> None:
    s = v.serving
    if s:
        show_note(f"Serving: TPOT p50 {s.tpot_p50_us / 1e3:.2f} ms at concurrency {s.lowest_level}, "
                  f"peak {s.max_output_tok_s:,.0f} output tok/s ({s.source}).")


def verdict_headline(v: Verdict) -> None:
    show_note("**Verdict:** " + (v.verdict or "no profile in this run: run 04_profile for an attribution."))
