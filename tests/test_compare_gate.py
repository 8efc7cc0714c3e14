"""`decodescope compare --gate`: the exit status and message on a regression beyond the gate and the noise,
none within the noise or under the gate, the gate alone where a side has no repeats, per-metric gates,
compare.json beside the page, named baselines, and runs that differ in what makes them comparable refused
or flagged by name. The runs are written as the phases write them (tests/test_compare.py make_run); the
same gate on real vLLM runs is tests/test_compare_gate_vllm.py."""
import json
from pathlib import Path

import pytest

from decodescope.cli.main import main
from decodescope.report import compare
from decodescope.report.compare_gate import parse_gates
from decodescope.schema.records_compare import CompareResult
from decodescope.schema.records_host import EngineAllReduce
from tests.test_compare import CATS_A, make_run

# TPOT per repeat (us) at levels 1 and 2: B 20% slower at level 1 in every repeat; level 2 the same spread
A_TPOTS = {1: [4000, 4100, 3950, 4050], 2: [5000, 5300, 4900, 5100]}
B_SLOWER = {1: [4800, 4900, 4850, 4950], 2: [5050, 4950, 5250, 5000]}


def _host(run: Path, communicator: str, hostname: str = "box") -> None:
    ar = EngineAllReduce(vllm="0.32.0", platform="cpu", cpu_extension="_C" if communicator == "vllm_shm" else "_C_AVX2",
                         path="shm" if communicator == "vllm_shm" else "gloo", communicator=communicator)
    (run / "data" / "host.json").write_text(json.dumps({"has_gpu": False, "cpu": {"hostname": hostname},
                                                        "engine_allreduce": ar.model_dump()}))


def _pair(tmp_path, b_tpots=B_SLOWER, repeats=True, b_comm="vllm_shm", **b_kw):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-nightly", tpots=A_TPOTS, repeats=repeats)
    b = make_run(out, "20260102T000000Z-candidate", tpots=b_tpots, repeats=repeats, **b_kw)
    _host(a, "vllm_shm")
    _host(b, b_comm)
    return a, b


def _json_of(page_line: str) -> CompareResult:
    return CompareResult.model_validate_json(compare.compare_json_path(Path(page_line)).read_text())


def test_a_regression_beyond_the_gate_and_the_noise_exits_1_naming_metric_level_and_amount(tmp_path, capsys):
    a, b = _pair(tmp_path)
    assert main(["compare", str(a), str(b), "--gate", "10"]) == 1
    cap = capsys.readouterr()
    err = cap.err
    # TPOT p50 at level 1: 4025 -> 4875 us (median of repeats), +21.1%
    assert "REGRESSION: B against A: TPOT p50 at concurrency 1: 4.025 ms -> 4.875 ms (+21.1% worse; 95% band" in err
    assert "gate 10%" in err and "(exit status 1)" in err
    assert "concurrency 2" not in err.split("gate:")[0].split("REGRESSION")[-1]  # level 2 is not named
    result = _json_of(cap.out.strip())
    tpot1 = next(m for m in result.metrics if m.metric == "tpot_p50_us" and m.level == 1)
    assert (tpot1.value_a, tpot1.value_b, tpot1.verdict, tpot1.call) == (4025.0, 4875.0, "regression", "significant")
    assert tpot1.band_low > 0 and tpot1.delta == pytest.approx(850.0) and tpot1.worse_pct == pytest.approx(21.118, 1e-3)
    tpot2 = next(m for m in result.metrics if m.metric == "tpot_p50_us" and m.level == 2)
    assert tpot2.verdict == "ok" and result.exit_status == 1 and result.regressions >= 1


def test_the_same_runs_under_a_wider_gate_pass(tmp_path, capsys):
    a, b = _pair(tmp_path)
    assert main(["compare", str(a), str(b), "--gate", "25"]) == 0
    assert "gate: 0 regressions" in capsys.readouterr().err


def test_worse_beyond_the_gate_but_within_the_noise_is_not_a_regression(tmp_path, capsys):
    # level 1: B's median 12% higher but its repeats overlap A's widely
    a, b = _pair(tmp_path, b_tpots={1: [3900, 4600, 5000, 4400], 2: A_TPOTS[2]})
    assert main(["compare", str(a), str(b), "--gate", "5"]) == 0
    err = capsys.readouterr().err
    assert "within noise: B against A: TPOT p50 at concurrency 1" in err and "REGRESSION" not in err


def test_without_repeats_the_gate_alone_decides_and_says_the_noise_is_unknown(tmp_path, capsys):
    a2 = make_run(tmp_path / "o2", "20260101T000000Z-a", tpots={1: [4000], 2: [5000]})
    b2 = make_run(tmp_path / "o2", "20260102T000000Z-b", tpots={1: [4500], 2: [5000]})
    assert main(["compare", str(a2), str(b2), "--gate", "10"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION (noise unknown): B against A: TPOT p50 at concurrency 1" in err and "no repeats" in err
    assert main(["compare", str(a2), str(b2), "--gate", "15"]) == 0


def test_per_metric_gates_the_most_specific_wins_and_off_lifts_one(tmp_path, capsys):
    a, b = _pair(tmp_path)
    assert main(["compare", str(a), str(b), "--gate", "10", "--gate-metric", "tpot@1=off",
                 "--gate-metric", "e2e=off"]) == 0
    assert main(["compare", str(a), str(b), "--gate-metric", "tpot=30", "--gate-metric", "tpot@1=20"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION: B against A: TPOT p50 at concurrency 1" in err and "gate 20%" in err
    g = parse_gates("5", ["step.busy@4=12", "category.gemm=3", "throughput=off"])
    assert g.gate_for("step", "busy", 4) == 12 and g.gate_for("step", "busy", 1) is None
    assert g.gate_for("step", "wall", 1) == 5 and g.gate_for("category", "attention", 1) is None
    assert g.gate_for("category", "gemm", 1) == 3 and g.gate_for("throughput", None, 2) is None
    assert g.gate_for("ttft", None, 2) == 5


@pytest.mark.parametrize("args, named", [
    (["--gate", "fast"], "--gate 'fast': give a percentage >= 0"),
    (["--gate", "-3"], "--gate '-3'"),
    (["--gate-metric", "tpot"], "--gate-metric 'tpot': expected NAME=PCT; valid: a family (throughput, tpot"),
    (["--gate-metric", "latency=5"], "--gate-metric 'latency=5'"),
    (["--gate-metric", "step.nap=5"], "no step part 'nap'"),
    (["--gate-metric", "tpot.p99=5"], "tpot has no parts"),
    (["--allow-mismatch", "colour"], "--allow-mismatch 'colour': valid: model, tensor_parallel"),
])
def test_a_bad_gate_exits_2_naming_it_before_anything_is_written(tmp_path, capsys, args, named):
    a, b = _pair(tmp_path)
    assert main(["compare", str(a), str(b), *args]) == 2
    assert named in capsys.readouterr().err
    assert not (a.parent / "compare").exists()


def test_compare_json_is_written_atomically_beside_the_page_with_every_figure(tmp_path, capsys):
    a, b = _pair(tmp_path)
    target = tmp_path / "ci" / "nightly.html"
    assert main(["compare", str(a), str(b), "--gate", "10", "--out", str(target)]) == 1
    cap = capsys.readouterr()
    assert cap.out.strip() == str(target) and f"compare.json: {target.with_suffix('.json')}" in cap.err
    raw = json.loads(target.with_suffix(".json").read_text())
    assert raw["schema_version"] == 1 and raw["page"] == str(target) and raw["exit_status"] == 1
    assert [s["letter"] for s in raw["sources"]] == ["A", "B"] and raw["gates"] == {"*": 10.0}
    keys = {(m["metric"], m["level"]) for m in raw["metrics"]}
    assert keys == {(m, lv) for m in ("output_throughput_tok_s", "tpot_p50_us", "ttft_p50_us", "e2e_p50_us")
                    for lv in (1, 2)}
    one = raw["metrics"][0]
    assert set(one) >= {"value_a", "value_b", "delta", "delta_pct", "band_low", "band_high", "call", "gate_pct",
                        "verdict", "n_a", "n_b"}
    assert not list(target.parent.glob(".*.tmp"))  # no temporary left
    html = target.read_text()
    assert f"Gate: {raw['regressions']} regression(s)" in html and "figures held to a gate" in html


def test_the_step_and_its_categories_are_gated_when_named(tmp_path, capsys):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-a", tpots=A_TPOTS, repeats=True, categories=CATS_A, wall_us=1000)
    slower = {k: [None if v is None else (v[0] * (1.5 if k == "gemm" else 1.0), v[1]) for v in ranks]
              for k, ranks in CATS_A.items()}
    b = make_run(out, "20260102T000000Z-b", tpots=A_TPOTS, repeats=True, categories=slower, wall_us=1300)
    assert main(["compare", str(a), str(b), "--gate", "20"]) == 1  # the step's wall: +30%, no repeats
    err = capsys.readouterr().err
    assert "REGRESSION (noise unknown): B against A: decode step, wall-clock step" in err and "+30.0% worse" in err
    assert "gemm per decode step" not in err  # categories only where named
    assert main(["compare", str(a), str(b), "--gate-metric", "category.gemm=40"]) == 1
    assert "B against A: gemm per decode step" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--gate-metric", "category=60"]) == 0


def test_a_gate_refuses_runs_on_different_all_reduce_paths_naming_them(tmp_path, capsys):
    a, b = _pair(tmp_path, b_tpots=A_TPOTS, b_comm="torch_gloo")
    assert main(["compare", str(a), str(b), "--gate", "10"]) == 4
    cap = capsys.readouterr()
    assert ("refused: B against A: all_reduce differs: vllm_shm against torch_gloo "
            "(data/host.json: engine_allreduce.communicator)") in cap.err
    assert "--allow-mismatch all_reduce" in cap.err
    result = _json_of(cap.out.strip())
    assert result.refused and result.metrics == [] and result.exit_status == 4
    assert {c.key: c.status for c in result.comparability}["all_reduce"] == "differs"
    # named as allowed: gated, and flagged
    assert main(["compare", str(a), str(b), "--gate", "10", "--allow-mismatch", "all_reduce"]) == 0
    assert "warning: B against A: all_reduce differs: vllm_shm against torch_gloo" in capsys.readouterr().err


def test_without_a_gate_differences_are_flagged_not_refused(tmp_path, capsys):
    a, b = _pair(tmp_path, b_tpots=A_TPOTS, tp=4)
    assert main(["compare", str(a), str(b)]) == 0
    cap = capsys.readouterr()
    assert "warning: B against A: tensor_parallel differs: 2 against 4" in cap.err
    html = Path(cap.out.strip()).read_text()
    assert "The runs differ in what makes them comparable: B against A: tensor_parallel differs: 2 against 4" in html


def test_a_named_baseline_resolves_by_directory_run_id_or_params_name(tmp_path, capsys):
    out = tmp_path / "outputs"
    old = make_run(out, "20260101T000000Z-nightly", tpots=A_TPOTS, repeats=True)
    newer = make_run(out, "20260103T000000Z-nightly", tpots=A_TPOTS, repeats=True)
    cand = make_run(out, "20260104T000000Z-candidate", tpots=B_SLOWER, repeats=True)
    for r in (old, newer, cand):
        _host(r, "vllm_shm")
    assert main(["compare", "--baseline", "nightly", str(cand), "--gate", "10"]) == 1  # params name: the newest
    cap = capsys.readouterr()
    assert f"baseline nightly: {newer}" in cap.err
    assert _json_of(cap.out.strip()).sources[0].label == newer.name
    assert main(["compare", "--baseline", old.name, str(cand)]) == 0  # a directory name
    assert f"baseline {old.name}: {old}" in capsys.readouterr().err
    assert main(["compare", "--baseline", str(old), str(cand)]) == 0  # a path
    assert main(["compare", "--baseline", "weekly", str(cand)]) == 2
    err = capsys.readouterr().err
    assert "weekly: --baseline: no such path, and no run of that directory name, run_id or params name in" in err
    assert "20260104T000000Z-candidate" in err  # the runs there are listed


def test_tpot_and_ttft_of_a_level_delivered_in_bursts_are_named_not_gated(tmp_path, capsys):
    """Where a side's stream came in bursts (over 10% of the inter-token gaps coalesced: the report's
    stream-delivery warning) its TPOT and TTFT describe the delivery, not the decode (docs/methods.md)."""
    import pandas as pd

    from decodescope.core.io import write_parquet_atomic

    a, b = _pair(tmp_path)
    only_tpot = ["--gate", "10", "--gate-metric", "e2e=off", "--gate-metric", "throughput=off"]
    assert main(["compare", str(a), str(b), *only_tpot]) == 1
    capsys.readouterr()
    levels = pd.read_parquet(b / "data" / "serving_levels_repeats.parquet")
    write_parquet_atomic(b / "data" / "serving_levels_repeats.parquet",
                         levels.assign(itl_coalesced_frac=[0.95 if lv == 1 else 0.0 for lv in levels["level"]]))
    assert main(["compare", str(a), str(b), *only_tpot]) == 0
    cap = capsys.readouterr()
    assert ("not gated, the stream came in bursts (TPOT and TTFT describe its delivery, not the decode: "
            "docs/methods.md): B against A: TPOT p50 at concurrency 1 (B: stream in bursts)") in cap.err
    verdicts = {(m.family, m.level): m.verdict for m in _json_of(cap.out.strip()).metrics}
    assert verdicts[("tpot", 1)] == verdicts[("ttft", 1)] == "not gated: burst delivery"
    assert verdicts[("tpot", 2)] == "ok"


def test_a_gate_that_holds_no_figure_both_runs_measured_exits_2(tmp_path, capsys):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-a", tpots=A_TPOTS, repeats=True)
    b = make_run(out, "20260102T000000Z-b", tpots={4: [4000, 4100, 3950]}, repeats=True)  # no level in common
    assert main(["compare", str(a), str(b), "--gate", "10"]) == 2
    cap = capsys.readouterr()
    assert "error: the gate held no figure: no gated figure was measured by both runs" in cap.err
    assert _json_of(cap.out.strip()).exit_status == 2
    assert main(["compare", str(a), str(b)]) == 0  # without a gate: the page alone
