"""The verdict's reading of critical_path.json: the wall share beside the summed share, and each fix's
bound on the path beside the step model's projection."""
from decodescope.schema.records import ProfileCaptures, ProjectionRow, write_record
from decodescope.schema.records_critpath import CriticalPathSummary
from decodescope.verdict.pathanswer import (critical_path_findings, critical_path_records, disagreement, fix_rows,
                                               headline, path_bottleneck)


def record(conc=4):
    return CriticalPathSummary.model_validate({
        "concurrency": conc, "device": "cpu", "ranks": [0, 1], "step_kind": "decode", "steps": 40,
        "wall_us_median": 2500.0,
        "shares": [{"category": "host", "path_share_median": 0.5, "path_share_p10": 0.4, "path_share_p90": 0.6,
                    "path_us_median": 1250.0, "summed_share_median": 0.0},
                   {"category": "allreduce", "path_share_median": 0.01, "path_share_p10": 0.0,
                    "path_share_p90": 0.02, "path_us_median": 25.0, "summed_share_median": 0.25}],
        "fix_bounds": [{"category": "allreduce transfer", "kind": "transfer", "wall_us_median": 2500.0,
                        "bound_wall_us_median": 2475.0, "gain_share_median": 0.01, "steps": 32,
                        "speedup": float("inf")}],
        "collective_split": [{"category": "allreduce", "instances_per_step": 9, "skew_us_per_step": 700.0,
                              "transfer_us_per_step": 20.0, "waited_us_per_step": 700.0,
                              "skew_on_path_us_per_step": 750.0, "transfer_on_path_us_per_step": 25.0,
                              "share_skew_bound": 0.6, "share_transfer_bound": 0.1, "share_mixed": 0.3,
                              "share_inconclusive": 0.0}]})


def projection(fix, gain_pct, batch):
    return ProjectionRow(fix=fix, step_us=1.0, low_us=1.0, high_us=1.0, tokens_per_step=1.0, tpot_us=1.0,
                         tpot_low_us=1.0, tpot_high_us=1.0, gain_pct=gain_pct, assumptions="", batch=batch)


def test_a_projection_saving_more_than_the_path_allows_is_flagged():
    rows = fix_rows({4: record()}, [projection("all-reduce through torch_gloo", -30.0, 4.0),
                                    projection("all-reduce through torch_gloo", -50.0, 64.0),
                                    projection("GEMMs 2x faster", -20.0, 4.0)])
    assert len(rows) == 1
    r = rows[0]
    assert (r.bound, r.fix, r.projection_batch, r.exceeds_bound) == ("allreduce transfer free", "all-reduce through "
                                                                     "torch_gloo", 4.0, True)
    assert abs(r.bound_gain_pct - 1.0) < 1e-9 and r.projected_gain_pct == 30.0


def test_the_findings_give_wall_share_beside_summed_and_the_exceeded_bound():
    recs = {4: record()}
    got = critical_path_findings(recs, fix_rows(recs, [projection("all-reduce through torch_gloo", -30.0, 4.0)]))
    assert "host holds 50% of the wall time" in got[0]["text"]
    assert "allreduce 1% of the wall step against 25% of summed op time" in got[0]["text"]
    assert "more than the critical path allows" in got[1]["text"]


def test_runs_without_records_get_no_rows_and_no_findings(tmp_path):
    assert critical_path_records(tmp_path) == {}
    assert critical_path_findings({}, fix_rows({}, [projection("GEMMs 2x faster", -20.0, 4.0)])) == []


def test_the_records_are_read_per_level_04_profiled(tmp_path):
    (tmp_path / "data" / "profile" / "c4").mkdir(parents=True)
    (tmp_path / "data" / "profile" / "c8").mkdir(parents=True)
    write_record(tmp_path / "data" / "profile" / "c4" / "critical_path.json", record())
    write_record(tmp_path / "data" / "profile" / "c8" / "critical_path.json", record())
    assert critical_path_records(tmp_path) == {}   # no record of the levels 04 profiled: none read
    write_record(tmp_path / "data" / "profile_capture.json", ProfileCaptures(levels=[4]))
    assert list(critical_path_records(tmp_path)) == [4]   # c8's file is not of a level 04 profiled


def test_the_headline_names_what_holds_the_path_with_its_spread_and_the_summed_share_beside_it():
    recs = {4: record(4), 1: record(1)}
    b = path_bottleneck(recs, summed_cls="communication", summed_share=0.28)
    assert (b.basis, b.category, b.cls, b.level) == ("critical path", "host", "host", 1)
    text = headline(recs, b)
    assert text.startswith("host holds the critical path of a decode step: 50% (p10-p90 40%-60%) of the 2.50 ms "
                           "wall step at concurrency 1; 50% (p10-p90 40%-60%)")
    assert "0% of summed op time" in text
    # the collectives' split on the path: 25 us of transfer and 750 us of skew in a 2,500 us step
    assert "allreduce: transfer 1% and arrival skew 30% of the wall step on the path (60% of instances skew-bound)" in text


def test_when_the_two_views_name_different_classes_one_sentence_says_the_path_holds_and_why():
    b = path_bottleneck({4: record()}, summed_cls="communication", summed_share=0.28)
    said = disagreement(b, summed_us=21_700.0, wall_us=12_100.0)
    assert "summed op time puts communication first (28%" in said and "the path holds" in said
    assert "21.70 ms per step) exceeds the wall step (12.10 ms) because streams and ranks overlap" in said
    agree = path_bottleneck({4: record()}, summed_cls="host", summed_share=0.5)
    assert disagreement(agree, 1.0, 2.0) is None


def test_a_gemm_projection_is_held_to_the_gemm_class_freed_whole():
    rec = record()
    rec.fix_bounds.append(rec.fix_bounds[0].model_copy(update={"category": "gemm (all)", "kind": "class",
                                                               "gain_share_median": 0.10}))
    rec.fix_bounds.append(rec.fix_bounds[0].model_copy(update={"category": "moe_experts", "kind": "category",
                                                               "gain_share_median": 0.06}))
    rows = fix_rows({4: rec}, [projection("GEMMs 2x faster", -20.0, 4.0)])
    held = [r for r in rows if r.fix]
    assert [(r.bound, r.exceeds_bound) for r in held] == [("gemm (all) free", True)]


def test_03s_all_reduces_are_set_beside_the_profiles_transfer_alone_with_the_skew_set_apart():
    from decodescope.schema.records import ReconcileRow
    from decodescope.verdict.pathanswer import transfer_reconcile_row
    micro = ReconcileRow(piece="all-reduces per step (vllm_shm)", micro_benchmark_us=20.0,
                         micro_source="collectives.parquet sweep, vllm_shm back_to_back", profile_us=30.0,
                         profile_source="profile_summary.json")
    row = transfer_reconcile_row([micro], {4: record()}, 4)
    assert (row.micro_benchmark_us, row.profile_us, row.profile_over_micro) == (20.0, 20.0, 1.0)
    assert "c4/critical_path.json collective_split" in row.profile_source and "700 us per step" in row.note
    assert transfer_reconcile_row([], {4: record()}, 4) is None
