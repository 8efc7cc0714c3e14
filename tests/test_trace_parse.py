import gzip
import json
import shutil
from collections import defaultdict

import pytest

from decodescope.trace.load import load_trace_dir
from decodescope.trace.parse import TraceError, parse_trace


def _independent_totals(path):
    """Per-name duration sums straight from json.load: the check on our streaming parser."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    totals, counts = defaultdict(float), defaultdict(int)
    for ev in doc["traceEvents"]:
        if ev.get("ph") == "X" and ev.get("cat") == "cpu_op":
            totals[ev["name"]] += float(ev.get("dur", 0))
            counts[ev["name"]] += 1
    return totals, counts, doc


def test_real_traces_parse_with_rank_from_distributed_info(cpu_traces):
    for path in sorted(cpu_traces.glob("*.gz")):
        df, meta = parse_trace(path)
        assert meta.rank_source == "distributedInfo"
        assert meta.world_size == 2 and meta.backend == "gloo"
        assert f"rank{meta.rank}" in path.name
        # with_stack traces are mostly python_function events: seen, never kept
        assert meta.events_seen > 2 * len(df)
        assert "python_function" not in set(df["cat"].astype(str))
        totals, counts, _ = _independent_totals(path)
        ours = df[df["cat"].astype(str) == "cpu_op"].groupby(df["name"].astype(str))["dur_us"].agg(["sum", "size"])
        assert set(ours.index) == set(totals)
        for name, row in ours.iterrows():
            assert row["sum"] == pytest.approx(totals[name], rel=1e-9, abs=1e-6)
            assert row["size"] == counts[name]


def test_compact_json_from_other_tools_parses_too(cpu_traces, tmp_path):
    src = sorted(cpu_traces.glob("*.gz"))[0]
    _, _, doc = _independent_totals(src)
    compact = tmp_path / "other_tool_rank0.json"
    compact.write_text(json.dumps(doc, separators=(",", ":")))
    df_a, _ = parse_trace(src)
    df_b, meta_b = parse_trace(compact)
    assert len(df_a) == len(df_b) and meta_b.rank == 0
    assert df_a["dur_us"].sum() == pytest.approx(df_b["dur_us"].sum())


def test_rank_falls_back_to_file_name(tmp_path):
    p = tmp_path / "dp0_pp0_tp3_dcp0_ep3_rank3.123.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2,
                                              "pid": 0, "tid": 7, "args": {"stream": 7, "correlation": 1}}]}))
    df, meta = parse_trace(p)
    assert meta.rank == 3 and meta.rank_source == "file name" and meta.is_gpu
    assert df["stream"].tolist() == [7]


def test_truncated_gzip_names_the_file(cpu_traces, tmp_path):
    src = sorted(cpu_traces.glob("*.gz"))[0]
    bad = tmp_path / "rank0.trunc.pt.trace.json.gz"
    data = src.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="rank0.trunc"):
        parse_trace(bad)


def test_json_that_is_not_a_trace_is_rejected(tmp_path):
    p = tmp_path / "rank0.notatrace.json"
    p.write_text(json.dumps({"hello": [1, 2, 3]}))
    with pytest.raises(TraceError, match="rank0.notatrace.json.*traceEvents"):
        parse_trace(p)


def test_damaged_rank_is_reported_and_others_still_analysed(cpu_traces, tmp_path):
    d = tmp_path / "traces"
    shutil.copytree(cpu_traces, d)
    victim = sorted(d.glob("*rank1*.gz"))[0]
    victim.write_bytes(victim.read_bytes()[:5000])
    loaded = load_trace_dir(d)
    assert loaded.ranks == [0]
    assert any(victim.name in w for w in loaded.warnings)
    assert any("rank(s) [1]" in w for w in loaded.warnings)


def test_missing_rank_is_warned(cpu_traces, tmp_path):
    d = tmp_path / "traces"
    shutil.copytree(cpu_traces, d)
    for p in d.glob("*rank1*"):
        p.unlink()
    loaded = load_trace_dir(d)
    assert loaded.ranks == [0]
    assert any("world size 2" in w and "[1]" in w for w in loaded.warnings)


def test_two_runs_mixed_in_one_directory_are_detected(cpu_traces, tmp_path):
    d = tmp_path / "traces"
    shutil.copytree(cpu_traces, d)
    for p in list(d.glob("*.gz")):
        shutil.copy(p, p.with_name(p.name.replace("testhost", "olderrun")))
    loaded = load_trace_dir(d)
    assert loaded.ranks == [0, 1]
    assert sum("mixed" in w for w in loaded.warnings) == 2
    assert len(loaded.skipped) == 2


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="no \\*.json"):
        load_trace_dir(tmp_path)


def _kineto_text(events) -> str:
    """Events laid out as torch's Kineto writer lays them out ("  {" ... "  }", ph/cat/name first)."""
    bodies = [f'  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": 7, "tid": 7,\n'
              f'    "ts": {ts}, "dur": {dur},\n    "args": {{"External id": {i}}}\n  }}'
              for i, (cat, name, ts, dur) in enumerate(events)]
    return ('{\n  "schemaVersion": 1,\n  "traceEvents": [\n' + ",\n".join(bodies)
            + '\n  ],\n  "traceName": "single.json"\n}')


SINGLE_RANK_EVENTS = [("user_annotation", "execute_context_0(0)_generation_1(1)", 100, 50),
                      ("cpu_op", "aten::mm", 110, 20), ("cpu_op", "aten::add", 135, 5),
                      ("user_annotation", "execute_context_0(0)_generation_1(1)", 300, 50),
                      ("cpu_op", "aten::mm", 310, 20)]


def test_a_lone_trace_without_rank_is_read_as_rank0_with_a_warning(tmp_path):
    (tmp_path / "trace.json").write_text(_kineto_text(SINGLE_RANK_EVENTS))
    loaded = load_trace_dir(tmp_path)
    assert loaded.ranks == [0]
    assert loaded.metas[0].rank_source == "single trace"
    assert (loaded.events["cat"].astype(str) == "cpu_op").sum() == 3
    assert any("trace.json" in w and "rank 0" in w for w in loaded.warnings)

    from decodescope.trace.profile import analyze_traces

    result = analyze_traces(loaded)
    assert set(result.breakdown["rank"]) == {0} and len(result.steps) == 2


def test_two_traces_without_rank_are_not_guessed(tmp_path):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(_kineto_text(SINGLE_RANK_EVENTS))
    loaded = load_trace_dir(tmp_path)
    assert loaded.ranks == []
    assert sum("no rank in distributedInfo" in w and "not analysed" in w for w in loaded.warnings) == 2
