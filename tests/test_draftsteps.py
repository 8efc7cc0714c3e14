"""The drafter of a speculative step read from a profiled level's ops: hand-built lanes whose drafter is
known, and slices of real vLLM CPU traces (tests/fixtures/spec_drafter: the embedded default with the model
as its own draft, k = 3 at concurrency 1 and k = 1 at concurrency 4, five steps of one rank)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from decodescope.trace.draftsteps import DRAFTER_END_GAP_US, drafter_steps

SLICES = Path(__file__).resolve().parent / "fixtures" / "spec_drafter"
FWD = "## Call CompiledFxGraph abc"


def _ops(rank: int, rows: list[tuple[str, float, float]], lane: int = 7) -> list[dict]:
    return [{"rank": rank, "name": n, "ts_us": ts, "dur_us": d, "lane": lane} for n, ts, d in rows]


def _steps(rank: int, spans: list[tuple[float, float]]) -> list[dict]:
    return [{"rank": rank, "start_us": a, "end_us": b, "wall_us": b - a, "kind": "decode"} for a, b in spans]


def _two_pass_lane(rank: int, t0: float, last_us: float = 300.0) -> list[tuple[str, float, float]]:
    """A verify step [t0, t0 + 1000), the rejection sampler, two draft passes, the engine's idle gap."""
    return [("execute_context_0(0)_generation_1(3)", t0, 1000), (FWD, t0 + 100, 800),      # the verify pass
            ("aten::exponential_", t0 + 1100, 50),                                          # rejection
            (FWD, t0 + 1300, 400), ("aten::mm", t0 + 1350, 100),                            # nested in the pass
            ("aten::argmax", t0 + 1720, 20),
            (FWD, t0 + 1800, last_us), ("aten::argmax", t0 + 1850 + last_us, 10)]           # last pass, tail


def test_a_two_pass_drafter_splits_into_lead_passes_and_the_gap_before_the_next_step():
    ops = pd.DataFrame(_ops(0, _two_pass_lane(0, 0) + _two_pass_lane(0, 3000)))
    steps = pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000), (6000, 7000)]))
    d = drafter_steps(ops, steps, concurrency=1)
    assert d is not None and d.steps == 2 and d.passes == 2 and d.concurrency == 1
    assert d.lead_us == pytest.approx(300)          # the verify's end (1000) to the first draft forward (1300)
    assert d.first_pass_us == pytest.approx(500)    # 1300 -> 1800
    assert d.next_pass_us == pytest.approx(360)     # 1800 -> the tail's end, 2160
    assert d.drafter_us == pytest.approx(1160) and d.between_us == pytest.approx(840)
    assert d.forward_us == pytest.approx(350)       # the median of the draft forwards alone (400, 300)


def test_an_idle_gap_longer_than_the_threshold_ends_the_drafter():
    late = DRAFTER_END_GAP_US + 50
    rows = _two_pass_lane(0, 0) + [("aten::slice", 2160 + late, 5)]
    d = drafter_steps(pd.DataFrame(_ops(0, rows)), pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000)])))
    assert d is not None and d.drafter_us == pytest.approx(1160)   # the late op is the engine's, not the drafter's


def test_steps_with_no_forward_outside_them_have_no_drafter():
    # the baseline: the step's forward is inside its annotation, the host's work between steps is no forward
    rows = [("execute_context_0(0)_generation_1(1)", 0, 1000), (FWD, 100, 800), ("aten::argmax", 1100, 20),
            ("execute_context_0(0)_generation_1(1)", 2000, 1000), (FWD, 2100, 800)]
    assert drafter_steps(pd.DataFrame(_ops(0, rows)), pd.DataFrame(_steps(0, [(0, 1000), (2000, 3000)]))) is None
    assert drafter_steps(pd.DataFrame(columns=["rank", "name", "ts_us", "dur_us", "lane"]),
                         pd.DataFrame(_steps(0, [(0, 1000)]))) is None


def test_the_rank_whose_drafter_takes_longest_is_the_one_reported():
    ops = pd.DataFrame(_ops(0, _two_pass_lane(0, 0)) + _ops(1, _two_pass_lane(1, 0, last_us=380)))
    steps = pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000)]) + _steps(1, [(0, 1000), (3000, 4000)]))
    d = drafter_steps(ops, steps)
    assert d is not None and d.rank == 1 and d.drafter_us == pytest.approx(1240)   # its last pass is 80 us longer


@pytest.mark.parametrize("name, passes", [("spec-self-k3_c1", 3), ("spec-self-k1_c4", 1)])
def test_real_speculative_steps_have_k_passes_and_their_parts_add_up_to_the_drafter(name, passes):
    ops = pd.read_parquet(SLICES / f"{name}_ops.parquet")
    steps = pd.read_parquet(SLICES / f"{name}_steps.parquet")
    d = drafter_steps(ops, steps)
    assert d is not None and d.passes == passes and d.steps == 4
    # each pass is a forward and the host work around it; the lead (rejection sampler, first inputs) is no pass
    assert d.first_pass_us > d.forward_us > 0 and d.lead_us > 0
    if passes > 1:
        assert d.next_pass_us is not None and d.forward_us < d.next_pass_us < d.first_pass_us
        parts = d.lead_us + d.first_pass_us + (passes - 1) * d.next_pass_us
        assert parts == pytest.approx(d.drafter_us, rel=0.1)    # medians of parts against the median whole
    else:
        assert d.next_pass_us is None
        assert d.lead_us + d.first_pass_us == pytest.approx(d.drafter_us, rel=0.1)
    assert d.between_us > DRAFTER_END_GAP_US
