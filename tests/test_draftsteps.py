"""The drafter of a speculative step read from a profiled level's ops: hand-built lanes whose drafter is
known, and slices of real traces (tests/fixtures/spec_drafter): vLLM CPU, the embedded default with the model
as its own draft, k = 3 at concurrency 1 and k = 1 at concurrency 4, five steps of one rank; and the real vLLM
GPU engine on an H100 (Qwen3-30B-A3B-shaped, 16 layers, the model as its own draft, k = 3, concurrency 8): the
marks read from the rank file beside the runtime calls, five steps of the host's annotations."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from decodescope.trace.draftsteps import DRAFTER_END_GAP_US, FORWARD, LOGITS, drafter_steps

SLICES = Path(__file__).resolve().parent / "fixtures" / "spec_drafter"
CALL = "## Call CompiledFxGraph abc"   # vLLM CPU's compiled call, after Dynamo's prologue (FORWARD)


def _ops(rank: int, rows: list[tuple[str, float, float]], lane: int = 7) -> list[dict]:
    return [{"rank": rank, "name": n, "ts_us": ts, "dur_us": d, "lane": lane} for n, ts, d in rows]


def _steps(rank: int, spans: list[tuple[float, float]]) -> list[dict]:
    return [{"rank": rank, "start_us": a, "end_us": b, "wall_us": b - a, "kind": "decode"} for a, b in spans]


def _forward(t: float, dur: float) -> list[tuple[str, float, float]]:
    """One forward as vLLM CPU records it: Dynamo's prologue, then the compiled call."""
    return [(FORWARD, t, 10), (CALL, t + 10, dur - 10)]


def _two_pass_lane(rank: int, t0: float, last_us: float = 300.0) -> list[tuple[str, float, float]]:
    """A verify step [t0, t0 + 1000), the rejection sampler, two draft passes, the engine's idle gap."""
    return [("execute_context_0(0)_generation_1(3)", t0, 1000), *_forward(t0 + 100, 800),   # the verify pass
            ("aten::exponential_", t0 + 1100, 50),                                          # rejection
            *_forward(t0 + 1300, 400), ("aten::mm", t0 + 1350, 100),                        # nested in the pass
            (LOGITS, t0 + 1720, 20),
            *_forward(t0 + 1800, last_us), (LOGITS, t0 + 1850 + last_us, 10)]               # last pass, tail


def test_a_two_pass_drafter_splits_into_lead_passes_and_the_gap_before_the_next_step():
    ops = pd.DataFrame(_ops(0, _two_pass_lane(0, 0) + _two_pass_lane(0, 3000)))
    steps = pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000), (6000, 7000)]))
    d = drafter_steps(ops, steps, concurrency=1)
    assert d is not None and d.steps == 2 and d.passes == 2 and d.concurrency == 1
    assert d.lead_us == pytest.approx(300)          # the verify's end (1000) to the first draft forward (1300)
    assert d.first_pass_us == pytest.approx(500)    # 1300 -> 1800
    assert d.next_pass_us == pytest.approx(360)     # 1800 -> the tail's end, 2160
    assert d.drafter_us == pytest.approx(1160) and d.between_us == pytest.approx(840)
    # the median of the draft forwards, each from its prologue to its logits' argmax (420, 350)
    assert d.forward_us == pytest.approx(385)


def test_an_idle_gap_longer_than_the_threshold_ends_the_drafter():
    late = DRAFTER_END_GAP_US + 50
    rows = _two_pass_lane(0, 0) + [("aten::slice", 2160 + late, 5)]
    d = drafter_steps(pd.DataFrame(_ops(0, rows)), pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000)])))
    assert d is not None and d.drafter_us == pytest.approx(1160)   # the late op is the engine's, not the drafter's


def test_a_forward_without_its_argmax_ends_where_the_next_begins():
    rows = [("execute_context_0(0)_generation_1(3)", 0, 1000), *_forward(1300, 400),   # no argmax after it
            *_forward(1800, 300), (LOGITS, 2150, 10)]
    d = drafter_steps(pd.DataFrame(_ops(0, rows)), pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000)])))
    assert d is not None and d.passes == 2 and d.forward_us == pytest.approx((500 + 350) / 2)
    assert d.drafter_us == pytest.approx(1160)


def test_steps_with_no_forward_outside_them_have_no_drafter():
    # the baseline: the step's forward is inside its annotation, the host's work between steps is no forward
    rows = [("execute_context_0(0)_generation_1(1)", 0, 1000), *_forward(100, 800), (LOGITS, 1100, 20),
            ("execute_context_0(0)_generation_1(1)", 2000, 1000), *_forward(2100, 800)]
    assert drafter_steps(pd.DataFrame(_ops(0, rows)), pd.DataFrame(_steps(0, [(0, 1000), (2000, 3000)]))) is None
    assert drafter_steps(pd.DataFrame(columns=["rank", "name", "ts_us", "dur_us", "lane"]),
                         pd.DataFrame(_steps(0, [(0, 1000)]))) is None


def test_the_rank_whose_drafter_takes_longest_is_the_one_reported():
    ops = pd.DataFrame(_ops(0, _two_pass_lane(0, 0)) + _ops(1, _two_pass_lane(1, 0, last_us=380)))
    steps = pd.DataFrame(_steps(0, [(0, 1000), (3000, 4000)]) + _steps(1, [(0, 1000), (3000, 4000)]))
    d = drafter_steps(ops, steps)
    assert d is not None and d.rank == 1 and d.drafter_us == pytest.approx(1240)   # its last pass is 80 us longer


@pytest.mark.parametrize("name, passes, steps", [("spec-self-k3_c1", 3, 4), ("spec-self-k1_c4", 1, 4),
                                                 ("gpu-self-k3_c8", 3, 5)])
def test_real_speculative_steps_have_k_passes_and_their_parts_add_up_to_the_drafter(name, passes, steps):
    ops = pd.read_parquet(SLICES / f"{name}_ops.parquet")
    steps_df = pd.read_parquet(SLICES / f"{name}_steps.parquet")
    d = drafter_steps(ops, steps_df)
    assert d is not None and d.passes == passes and d.steps == steps
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
    if name.startswith("gpu"):
        # the drafter runs until the engine's short gap, not to the first pause between a forward's launches
        # (its eager attention ops hold the host ~250 us each, and the column readers keep none of them)
        assert d.between_us < 0.1 * d.drafter_us
        assert d.next_pass_us == pytest.approx(d.first_pass_us, rel=0.25)   # one forward at one batch a pass


def _gpu_kineto(steps: int, step: str = "execute_context_0(0)_generation_1(3)") -> str:
    """A one-rank GPU trace as torch's Kineto writer lays it out: each step's host annotation [t, t + 1000), its
    GPU span later and longer, then a drafter of two passes on the host: prologue, launches, logits' argmax.
    The default step verifies two drafts of one request (3 tokens)."""
    ev = []
    for i in range(steps):
        t = 10_000 * i
        ev += [("user_annotation", step, t, 1000, 7), ("gpu_user_annotation", step, t + 200, 3000, 0),
               ("kernel", "verify_kernel", t + 200, 2900, 0)]
        for p, start in enumerate((t + 1400, t + 2400)):
            ev += [("cpu_op", FORWARD, start, 20, 7), ("cuda_runtime", "cudaLaunchKernel", start + 300, 10, 7),
                   ("cuda_runtime", "cudaLaunchKernel", start + 600, 10, 7), ("cpu_op", LOGITS, start + 900, 30, 7),
                   ("kernel", f"draft_kernel_{p}", start + 320, 200, 0)]
    bodies = [f'  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": 7, "tid": {tid},\n'
              f'    "ts": {ts}, "dur": {dur},\n    "args": {{"External id": {i}}}\n  }}'
              for i, (cat, name, ts, dur, tid) in enumerate(ev)]
    return ('{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "test GPU"}],\n'
            '  "traceEvents": [\n' + ",\n".join(bodies) + '\n  ],\n  "traceName": "rank0.json"\n}')


def test_a_gpu_traces_drafter_is_read_from_its_host_marks_and_the_hosts_annotations(tmp_path):
    """04's wiring on a GPU trace: the marks the column readers leave out there come from the rank file, and
    the steps are the host's annotations (the GPU span here ends 2,200 us later, inside the first pass)."""
    from decodescope.trace.load import load_trace_dir
    from decodescope.trace.profile import analyze_traces, level_drafter

    (tmp_path / "dp0_pp0_tp0_rank0.pt.trace.json").write_text(_gpu_kineto(4))
    loaded = load_trace_dir(tmp_path)
    result = analyze_traces(loaded, None, 1, batch=1)
    assert result.device == "gpu"
    d = level_drafter(loaded, result, 1)
    assert d is not None and d.steps == 3 and d.passes == 2 and d.concurrency == 1
    assert d.verify_us == pytest.approx(1000)                      # the host's annotation, not the GPU span
    assert d.lead_us == pytest.approx(400) and d.first_pass_us == pytest.approx(1000)
    assert d.next_pass_us == pytest.approx(930)                    # to the last argmax's end
    assert d.forward_us == pytest.approx(900) and d.drafter_us == pytest.approx(2330)


def test_a_gpu_trace_whose_steps_verify_no_drafts_is_not_read_again(tmp_path, monkeypatch):
    """One token a request a step: no verify, so 04 reads no drafter and opens no rank file a second time."""
    from decodescope.trace import draftsteps
    from decodescope.trace.load import load_trace_dir
    from decodescope.trace.profile import analyze_traces, level_drafter

    (tmp_path / "dp0_pp0_tp0_rank0.pt.trace.json").write_text(_gpu_kineto(4, "execute_context_0(0)_generation_1(1)"))
    loaded = load_trace_dir(tmp_path)
    result = analyze_traces(loaded, None, 1, batch=1)

    def no_second_pass(*args):
        raise AssertionError("a rank file read for the drafter's marks")

    monkeypatch.setattr(draftsteps, "named_cpu_ops", no_second_pass)
    assert result.device == "gpu" and level_drafter(loaded, result, 1) is None


def test_analyze_trace_writes_the_drafter_beside_the_breakdown(tmp_path, capsys):
    from decodescope.cli.main import main

    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "dp0_pp0_tp0_rank0.pt.trace.json").write_text(_gpu_kineto(4))
    assert main(["analyze-trace", str(traces), "--out", str(tmp_path / "out")]) == 0
    from decodescope.schema.records import read_record
    from decodescope.schema.records_spec import DrafterSteps

    d = read_record(tmp_path / "out" / "drafter_steps.json", DrafterSteps)
    assert d.passes == 2 and d.lead_us == pytest.approx(400)
    assert "Drafter after each verify step (median of 3): 2 passes" in capsys.readouterr().out
