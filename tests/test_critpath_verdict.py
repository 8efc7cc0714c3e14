"""The verdict's reading of critical_path.json: the wall share beside the summed share, and each fix's
bound on the path beside the step model's projection."""
from decodescope.schema.records import ProfileCaptures, ProjectionRow, write_record
from decodescope.schema.records_critpath import CriticalPathSummary
from decodescope.verdict.critpath_view import critical_path_findings, critical_path_records, fix_rows


def record(conc=4):
    return CriticalPathSummary.model_validate({
        "concurrency": conc, "device": "cpu", "ranks": [0, 1], "step_kind": "decode", "steps": 40,
        "wall_us_median": 2500.0,
        "shares": [{"category": "host", "path_share_median": 0.5, "path_share_p10": 0.4, "path_share_p90": 0.6,
                    "path_us_median": 1250.0, "summed_share_median": 0.0},
                   {"category": "allreduce", "path_share_median": 0.01, "path_share_p10": 0.0,
                    "path_share_p90": 0.02, "path_us_median": 25.0, "summed_share_median": 0.25}],
        "fix_bounds": [{"category": "allreduce", "wall_us_median": 2500.0, "bound_wall_us_median": 2475.0,
                        "gain_share_median": 0.01, "steps": 32, "speedup": float("inf")}]})


def projection(fix, gain_pct, batch):
    return ProjectionRow(fix=fix, step_us=1.0, low_us=1.0, high_us=1.0, tokens_per_step=1.0, tpot_us=1.0,
                         tpot_low_us=1.0, tpot_high_us=1.0, gain_pct=gain_pct, assumptions="", batch=batch)


def test_a_projection_saving_more_than_the_path_allows_is_flagged():
    rows = fix_rows({4: record()}, [projection("all-reduce through torch_gloo", -30.0, 4.0),
                                    projection("all-reduce through torch_gloo", -50.0, 64.0),
                                    projection("GEMMs 2x faster", -20.0, 4.0)])
    assert len(rows) == 1
    r = rows[0]
    assert (r.bound, r.fix, r.projection_batch, r.exceeds_bound) == ("allreduce free", "all-reduce through "
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
