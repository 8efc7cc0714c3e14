"""docs/step_model.md's worked examples are the code's: each example names its fixture run, params and batch
(an HTML comment the page does not show); its table of parts and its line of totals are recomputed here
through the public entries (verdict.fixes.model_inputs for the parts, verdict.verdict.verdict for what the
report compares the model with) and must read as the page prints them. A change to the step model that moves
a number fails here until the page says it."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from tests.fixture_verdicts import run_params

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "step_model.md"
MARK = re.compile(r"<!-- worked example: run=(\S+) params=(\S+) batch=(\d+) -->")
TOTALS = re.compile(r"period \*\*(-?[\d,]+) us\*\* · band \*\*(-?[\d,]+) to (-?[\d,]+) us\*\* · lanes' overlap "
                    r"\*\*([\d.]+)\*\* · measured \*\*([\d,]+) us\*\* \(([^)]*)\) · model error \*\*([+-][\d.]+)%\*\*")
KIND = {"WORK": "work", "HOST_IN_STEP": "host in step", "HOST_BETWEEN": "host between", "DEDUCTED": "deducted"}


def examples() -> list[tuple[str, str, int, str]]:
    """(run, params, batch, the page's text up to the next example or heading) per worked example."""
    text = PAGE.read_text()
    marks = list(MARK.finditer(text))
    out = []
    for m in marks:
        end = text.find("\n## ", m.end())
        out.append((m.group(1), m.group(2), int(m.group(3)), text[m.end(): end if end > 0 else len(text)]))
    return out


def us(x: float) -> str:
    return f"{x:,.0f}"


def computed(run: str, params_path: str, batch: int) -> tuple[list[list[str]], dict[str, str]]:
    """The example's table rows and totals, as the page prints them, from the code."""
    from decodescope.schema.params import load_params
    from decodescope.verdict import fixes
    from decodescope.verdict.verdict import verdict

    run_dir = REPO / run
    own = contextlib.nullcontext(load_params(REPO / params_path)) if params_path != "run" else run_params(run_dir)
    with own as params:
        inputs = fixes.model_inputs(run_dir, params, fixes.profile_summaries(run_dir, params),
                                    fixes.profile_captures(run_dir))
        pred = inputs.predict(batch)
        level = next(r for r in verdict(run_dir, params).levels if r.level == batch)
    rows = [[c.name, KIND[c.kind.name], us(c.us), us(c.low_us), us(c.high_us)] for c in pred.components]
    low, high = pred.band_us
    assert level.model_us == pytest.approx(pred.period_us)   # the report's model is this prediction
    totals = {"period": us(pred.period_us), "low": us(low), "high": us(high), "overlap": f"{pred.overlap:.3f}",
              "measured": us(level.reference_tpot_us), "reference": level.reference,
              "error": f"{level.model_error * 100:+.1f}"}
    return rows, totals


def printed(block: str) -> tuple[list[list[str]], dict[str, str]]:
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            for line in block.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    m = TOTALS.search(block)
    assert m, f"no line of totals (period ** us** · band ..) after the example in {PAGE}"
    keys = ("period", "low", "high", "overlap", "measured", "reference", "error")
    return rows, dict(zip(keys, m.groups()))


def test_the_page_has_its_two_worked_examples():
    assert [(r, b) for r, _, b, _ in examples()] == [("tests/fixtures/runs/vllm_gpu_h200_qwen3moe", 1),
                                                     ("tests/fixtures/runs/vllm_cpu_spec_selfdraft", 1)]


@pytest.mark.parametrize("run,params_path,batch,block", examples(), ids=lambda x: str(x).split("/")[-1][:40])
def test_a_worked_example_reads_as_the_code_computes_it(run, params_path, batch, block):
    rows, totals = computed(run, params_path, batch)
    page_rows, page_totals = printed(block)
    assert page_rows == rows, f"{PAGE.name}: the parts of {run} at batch {batch} are now\n" + "\n".join(
        "| " + " | ".join(r) + " |" for r in rows)
    assert page_totals == totals, f"{PAGE.name}: the totals of {run} at batch {batch} are now {totals}"
