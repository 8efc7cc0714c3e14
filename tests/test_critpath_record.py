"""critical_path.json: one profiled level's critical paths as a typed record, written from the traces 04
has loaded, read back by the verdict."""
from pathlib import Path

from decodescope.schema.records import read_record
from decodescope.schema.records_critpath import CRITICAL_PATH_RECORD, CriticalPathSummary
from decodescope.trace.load import load_trace_dir
from decodescope.trace.profile import analyze_traces

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def test_the_cpu_traces_critical_path_record_round_trips_with_shares_waits_and_bounds(tmp_path):
    from decodescope.critpath.record import write_critical_path

    loaded = load_trace_dir(FIXTURES / "vllm_cpu_tp2_c4")
    result = analyze_traces(loaded)
    cp = write_critical_path(loaded.events, result.ops, result.steps, tmp_path, 4)
    rec = read_record(tmp_path / CRITICAL_PATH_RECORD, CriticalPathSummary)
    assert rec.concurrency == 4 and rec.ranks == [0, 1] and rec.step_kind == "decode"
    assert rec.steps == int((cp.windows["kind"] == "decode").sum()) > 0
    cats = {r.category for r in rec.shares}
    assert {"allreduce", "host"} <= cats
    # the path's shares of a step sum to (about) one: the segments sum to the wall step
    assert 0.9 < sum(r.path_share_median for r in rec.shares) < 1.1
    ar = next(r for r in rec.fix_bounds if r.category == "allreduce transfer")
    assert ar.kind == "transfer"
    assert 0.0 <= ar.gain_share_median <= 1.0 and ar.bound_wall_us_median <= ar.wall_us_median
    kinds = {r.kind for r in rec.fix_bounds}
    assert {"category", "transfer", "host", "skew"} <= kinds
    # every collective category on the path is split per instance into skew and transfer
    split = {r.category: r for r in rec.collective_split}
    assert "allreduce" in split and split["allreduce"].instances_per_step == 9
    s = split["allreduce"]
    shares = s.share_skew_bound + s.share_transfer_bound + s.share_mixed + s.share_inconclusive
    assert abs(shares - 1.0) < 1e-9 and s.skew_us_per_step >= 0 and s.transfer_us_per_step > 0


def test_04s_view_draws_the_median_steps_path_and_sets_wall_shares_beside_summed(tmp_path):
    from decodescope.report.critpath_view import critical_path_view
    from decodescope.critpath.record import write_critical_path

    loaded = load_trace_dir(FIXTURES / "vllm_cpu_tp2_c4")
    result = analyze_traces(loaded)
    cp = write_critical_path(loaded.events, result.ops, result.steps, tmp_path, 4)
    why, fig, table = critical_path_view(cp, read_record(tmp_path / CRITICAL_PATH_RECORD, CriticalPathSummary))
    assert "nearest the median" in why and fig is not None
    assert any(t.name == "path: allreduce" for t in fig.data) and fig.data[0].name == "off the path"
    assert list(table.columns[[1, 4]]) == ["wall share on the path %", "summed share of op time %"]
