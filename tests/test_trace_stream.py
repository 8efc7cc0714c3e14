"""The streamed breakdown (trace/stream.py) against the table path (load_trace_dir + op_table +
category_breakdown): the same figures on real traces and on synthetic ones built to stress the carry of
open CPU ops from chunk to chunk; and its memory bounded by the chunks, not the file."""
import gzip
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from decodescope.trace import parse
from decodescope.trace.analyze import category_breakdown, op_table
from decodescope.trace.load import load_trace_dir
from decodescope.trace.stream import breakdown_dir

from tests.test_trace_parse import _nested_ops

GPU_REPLAY = "tests/fixtures/traces/h200x2_step_replay_graph"


def _assert_same_as_table(trace_dir):
    """Every (rank, category): time and calls as category_breakdown gives them; every (rank, name): the
    summed duration of op_table's rows; the device."""
    s = breakdown_dir(trace_dir)
    ops = op_table(load_trace_dir(trace_dir).events)
    bd = category_breakdown(ops)
    assert s.device == ops.attrs["device"]
    ours = {(r["rank"], r["category"]): r for r in s.categories}
    assert set(ours) == {(int(r.rank), str(r.category)) for r in bd.itertuples()}
    for r in bd.itertuples():
        o = ours[(int(r.rank), str(r.category))]
        assert o["calls"] == r.calls, (r.rank, r.category)
        assert math.isclose(o["time_us"], r.time_us, rel_tol=1e-9, abs_tol=1e-6), (r.rank, r.category)
        assert math.isclose(o["share"], r.share, rel_tol=1e-9, abs_tol=1e-12)
    dur = ops.groupby(["rank", "name"], observed=True)["dur_us"].agg(["sum", "size"])
    assert sum(len(v) for v in s.names.values()) == len(dur)
    for (rank, name), row in dur.iterrows():
        mine = s.names[int(rank)][str(name)]
        assert mine["rows"] == row["size"]
        assert math.isclose(mine["dur_us"], row["sum"], rel_tol=1e-9, abs_tol=1e-6)
    return s


@pytest.mark.parametrize("chunk", [None, 4096, 65536 + 17])
def test_gpu_replay_breakdown_equals_the_tables(repo, monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(parse, "CHUNK_BYTES", chunk)
    s = _assert_same_as_table(repo / GPU_REPLAY)
    assert s.device == "gpu" and s.ranks == [0, 1] and not s.warnings


@pytest.mark.parametrize("chunk", [None, 4096, 4099])
def test_cpu_capture_breakdown_equals_the_tables(cpu_traces, monkeypatch, chunk):
    """Real torchrun gloo traces: self times and calls counted once, ops carried across chunk cuts."""
    if chunk:
        monkeypatch.setattr(parse, "CHUNK_BYTES", chunk)
    s = _assert_same_as_table(cpu_traces)
    assert s.device == "cpu" and not [w for w in s.warnings if "out of start order" in w]


NAMES = ["c10d::allreduce_", "gloo:all_reduce", "aten::mm", "aten::add", "aten::copy_", "vllm::fused_moe"]


def _write_cpu_trace(path, ops, rank: int, seed: int):
    """ops (tid, ts_us, dur_us) as a Kineto CPU trace, events in the given order, names drawn so that
    all-reduces nest inside all-reduces (calls counted once) and in other ops."""
    rng = np.random.default_rng(seed)
    bodies = []
    for i, r in enumerate(ops.itertuples()):
        name = NAMES[int(rng.integers(len(NAMES)))]
        bodies.append(f'  {{\n    "ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 7, "tid": {r.tid},\n'
                      f'    "ts": {r.ts_us}, "dur": {r.dur_us},\n    "args": {{"External id": {i}}}\n  }}')
    text = ('{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "gloo", "rank": %d, "world_size": 2},\n'
            '  "traceEvents": [\n' % rank + ",\n".join(bodies) + '\n  ],\n  "traceName": "t.json"\n}')
    path.write_bytes(gzip.compress(text.encode()))


@pytest.mark.parametrize("seed", [0, 1])
def test_nested_ops_in_start_order_stream_as_the_table(tmp_path, monkeypatch, seed):
    """Deep nesting, twins, children outlasting their parent, three threads interleaved, and ties on a
    start time cut by chunks of 2 KB: each chunk holds a dozen events, so most ops are carried."""
    ops = _nested_ops(seed, n_top=60)
    for rank in (0, 1):
        mine = ops[ops["rank"] == rank].sort_values("ts_us", kind="stable")
        _write_cpu_trace(tmp_path / f"t_rank{rank}.pt.trace.json.gz", mine, rank, seed)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 2048)
    s = _assert_same_as_table(tmp_path)
    assert not s.warnings


def test_ops_out_of_start_order_are_read_whole_with_a_warning(tmp_path, monkeypatch):
    ops = _nested_ops(3, n_top=40)
    for rank in (0, 1):
        mine = ops[ops["rank"] == rank].sample(frac=1, random_state=rank)  # any order
        _write_cpu_trace(tmp_path / f"t_rank{rank}.pt.trace.json.gz", mine, rank, 3)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 2048)
    s = _assert_same_as_table(tmp_path)
    assert sum("out of start order" in w for w in s.warnings) == 2


def test_breakdown_command_writes_its_file_and_imports_no_pandas(repo, tmp_path):
    """`decodescope analyze-trace --breakdown` end to end in a fresh interpreter: its file, and neither
    pandas nor pydantic loaded at its exit (its start-up budget)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from decodescope.cli import main; "
            "rc = main(['analyze-trace', sys.argv[2], '--breakdown', '--out', sys.argv[3]]); "
            "print(sorted(m for m in ('pandas', 'pydantic', 'plotly', 'papermill', 'pyarrow') if m in sys.modules)); "
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(repo / "lib"), str(repo / GPU_REPLAY), str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    got = json.loads((tmp_path / "breakdown.json").read_text())
    assert got["device"] == "gpu" and got["ranks"] == [0, 1]
    assert {r["category"] for r in got["categories"]} >= {"allreduce_nccl", "gemm_dense"}
    assert "allreduce_nccl" in out.stdout


def test_breakdown_command_names_a_missing_directory(repo, tmp_path):
    out = subprocess.run([sys.executable, "-m", "decodescope.cli", "analyze-trace", str(tmp_path / "nope"),
                          "--breakdown"], capture_output=True, text=True, env={"PYTHONPATH": str(repo / "lib")})
    assert out.returncode == 2
    assert str(tmp_path / "nope") in out.stderr and "not a directory" in out.stderr


def test_streamed_memory_is_bounded_by_the_chunks_not_the_file(tmp_path):
    """Peak Python/numpy allocations of the reduction for a file of every-row-kept CPU ops and the same
    five times longer: the table would hold every row (~100 bytes each, 20 MB more); the reduction holds
    the chunks in flight and the ops still open."""
    import tracemalloc

    from tests.test_trace_parse import _synthetic_trace

    peaks = {}
    for n in (40_000, 200_000):
        d = tmp_path / str(n)
        d.mkdir()
        _synthetic_trace(d / "t_rank0.pt.trace.json.gz", n, kept_every=1)
        tracemalloc.start()
        b = breakdown_dir(d, workers=1)
        _, peaks[n] = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert sum(v["rows"] for v in b.names[0].values()) == n
    assert peaks[200_000] < 32 * parse.CHUNK_BYTES, peaks
    assert abs(peaks[200_000] - peaks[40_000]) < 2 << 20, peaks
