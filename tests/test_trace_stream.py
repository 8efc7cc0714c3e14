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
from decodescope.trace import reader as trace_reader
from decodescope.trace.analyze import category_breakdown, op_table
from decodescope.trace.load import load_trace_dir
from decodescope.trace.breakdown import breakdown_dir
from decodescope.trace.breakdown_file import BreakdownFile, BreakdownFileError

from tests.test_trace_parse import _nested_ops

GPU_REPLAY = "tests/fixtures/traces/h200x2_step_replay_graph"


@pytest.fixture(params=["c_reduce", "c", "numpy"])
def reader(request, monkeypatch):
    """Each streamed test three times: files reduced in C (creduce.py; the library is built here: the
    machine has a compiler), chunks read by the C scanner and reduced with numpy (creduce turned off),
    and by the numpy reader alone (as where no compiler is found)."""
    from decodescope.trace import creduce, cscan

    if request.param == "numpy":
        monkeypatch.setattr(cscan, "_lib", None)
    else:
        assert cscan.available(), "the C library did not build"
    if request.param == "c":
        monkeypatch.setattr(creduce, "available", lambda: False)
    return request.param


def _assert_same_as_table(trace_dir, reader=None):
    """Every (rank, category): time and calls as category_breakdown gives them; every (rank, name): the
    summed duration of op_table's rows; the device; events seen and kept per rank; every chunk read by
    `reader`."""
    s = breakdown_dir(trace_dir)
    if reader:
        assert set(k for k, v in s.chunks_by_reader.items() if v) == {reader}, s.chunks_by_reader
    loaded = load_trace_dir(trace_dir)
    assert ({m.rank: (m.events_seen, m.events_kept) for m in s.metas}
            == {m.rank: (m.events_seen, m.events_kept) for m in loaded.metas})
    ops = op_table(loaded.events)
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
def test_gpu_replay_breakdown_equals_the_tables(repo, monkeypatch, chunk, reader):
    if chunk:
        monkeypatch.setattr(trace_reader, "CHUNK_BYTES", chunk)
    s = _assert_same_as_table(repo / GPU_REPLAY, reader)
    assert s.device == "gpu" and s.ranks == [0, 1] and not s.warnings


@pytest.mark.parametrize("chunk", [None, 4096, 4099])
def test_cpu_capture_breakdown_equals_the_tables(cpu_traces, monkeypatch, chunk, reader):
    """Real torchrun gloo traces: self times and calls counted once, ops carried across chunk cuts."""
    if chunk:
        monkeypatch.setattr(trace_reader, "CHUNK_BYTES", chunk)
    s = _assert_same_as_table(cpu_traces, reader)
    assert s.device == "cpu" and not [w for w in s.warnings if "out of start order" in w]


NAMES = ["c10d::allreduce_", "gloo:all_reduce", "aten::mm", "aten::add", "aten::copy_", "vllm::fused_moe"]


def _write_cpu_trace(path, ops, rank: int, seed: int, world_size: int = 2, names=None):
    """ops (tid, ts_us, dur_us) as a Kineto CPU trace, events in the given order, names drawn so that
    all-reduces nest inside all-reduces (calls counted once) and in other ops."""
    rng = np.random.default_rng(seed)
    names = names or NAMES
    bodies = []
    for i, r in enumerate(ops.itertuples()):
        name = names[int(rng.integers(len(names)))]
        bodies.append(f'  {{\n    "ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 7, "tid": {r.tid},\n'
                      f'    "ts": {r.ts_us}, "dur": {r.dur_us},\n    "args": {{"External id": {i}}}\n  }}')
    text = ('{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "gloo", "rank": %d, "world_size": %d},\n'
            '  "traceEvents": [\n' % (rank, world_size) + ",\n".join(bodies) + '\n  ],\n  "traceName": "t.json"\n}')
    path.write_bytes(gzip.compress(text.encode()))


@pytest.mark.parametrize("seed", [0, 1])
def test_nested_ops_in_start_order_stream_as_the_table(tmp_path, monkeypatch, seed, reader):
    """Deep nesting, twins, children outlasting their parent, three threads interleaved, and ties on a
    start time cut by chunks of 2 KB: each chunk holds a dozen events, so most ops are carried. Ten top-level
    ops a thread (~14,500 events a seed; thirty made it 39,000 and 55 s of the suite's CPU over its six cases)."""
    ops = _nested_ops(seed, n_top=10)
    for rank in (0, 1):
        mine = ops[ops["rank"] == rank].sort_values("ts_us", kind="stable")
        _write_cpu_trace(tmp_path / f"t_rank{rank}.pt.trace.json.gz", mine, rank, seed)
    monkeypatch.setattr(trace_reader, "CHUNK_BYTES", 2048)
    s = _assert_same_as_table(tmp_path, reader)
    assert not s.warnings


def test_ops_sharing_a_start_reduce_as_the_table_whatever_their_file_order(tmp_path, monkeypatch, reader):
    """Ops of a thread that start together, written shortest first (a child before the op enclosing it),
    zero-length ops among them and at their parent's end: each is nested by length, not file order."""
    import pandas as pd

    rows = []
    for tid in (5, 6):
        for i in range(60):
            t0 = i * 100.0 + tid
            rows += [(0, tid, t0, 50.0), (0, tid, t0, 25.0), (0, tid, t0, 12.5), (0, tid, t0, 0.0),
                     (0, tid, t0 + 30.0, 10.0), (0, tid, t0 + 30.0, 10.0), (0, tid, t0 + 50.0, 0.0)]
    ops = pd.DataFrame(rows, columns=["rank", "tid", "ts_us", "dur_us"])
    ops = ops.sort_values(["ts_us", "dur_us"], kind="stable")  # shortest first among equal starts
    _write_cpu_trace(tmp_path / "t_rank0.pt.trace.json.gz", ops, 0, 5, world_size=1)
    monkeypatch.setattr(trace_reader, "CHUNK_BYTES", 2048)
    s = _assert_same_as_table(tmp_path, reader)
    assert not s.warnings


def test_more_rank_files_than_threads(tmp_path, reader):
    """Eight rank files reduced by two threads (or processes): every rank, as the table has it."""
    ops = _nested_ops(4, n_top=15)
    for rank in range(8):
        mine = ops[ops["rank"] == rank % 2].sort_values("ts_us", kind="stable")
        _write_cpu_trace(tmp_path / f"t_rank{rank}.pt.trace.json.gz", mine, rank, rank, world_size=8)
    s = breakdown_dir(tmp_path, workers=2)
    assert s.ranks == list(range(8)) and not s.warnings
    _assert_same_as_table(tmp_path, reader)


def test_hundreds_of_names_and_threads_reduce_as_the_table(tmp_path, reader):
    """More names, threads and (op, parent) pairs than the C reduction's tables start with (64 each):
    every one still summed on its own."""
    ops = _nested_ops(6, n_top=40)
    ops["tid"] = ops["tid"].map({11: 0, 12: 1, 4000000000: 2}) * 1000 + (ops["ts_us"] // 7).astype(int) % 200
    ops = ops[ops["rank"] == 0].sort_values("ts_us", kind="stable")
    names = [f"aten::op_{k}" for k in range(400)] + NAMES
    _write_cpu_trace(tmp_path / "t_rank0.pt.trace.json.gz", ops, 0, 6, world_size=1, names=names)
    s = _assert_same_as_table(tmp_path, reader)
    assert len(s.names[0]) > 200 and ops["tid"].nunique() > 100 and not s.warnings


def test_ops_out_of_start_order_are_read_whole_with_a_warning(tmp_path, monkeypatch):
    ops = _nested_ops(3, n_top=8)
    for rank in (0, 1):
        mine = ops[ops["rank"] == rank].sample(frac=1, random_state=rank)  # any order
        _write_cpu_trace(tmp_path / f"t_rank{rank}.pt.trace.json.gz", mine, rank, 3)
    monkeypatch.setattr(trace_reader, "CHUNK_BYTES", 2048)
    s = _assert_same_as_table(tmp_path)
    assert sum("out of start order" in w for w in s.warnings) == 2


@pytest.mark.parametrize("damage", ["truncated", "not_a_trace"])
def test_a_damaged_rank_is_named_and_the_others_reduced(cpu_traces, tmp_path, reader, damage):
    import shutil

    d = tmp_path / "traces"
    shutil.copytree(cpu_traces, d)
    victim = sorted(d.glob("*rank1*.gz"))[0]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:len(victim.read_bytes()) // 2])
    else:
        victim.write_bytes(gzip.compress(json.dumps({"hello": [1, 2, 3]}).encode()))
    s = breakdown_dir(d)
    assert s.ranks == [0] and s.device == "cpu"
    assert any(victim.name in w and ("truncated" in w or "traceEvents" in w) for w in s.warnings), s.warnings
    assert any("rank(s) [1]" in w for w in s.warnings)
    assert set(k for k, v in s.chunks_by_reader.items() if v) == {reader}


def test_breakdown_command_writes_its_file_and_imports_no_pandas(repo, tmp_path):
    """`decodescope analyze-trace --breakdown` end to end in a fresh interpreter: its file, and neither
    numpy, pandas nor pydantic loaded at its exit (its start-up budget: the files are reduced in C)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from decodescope.cli.main import main; "
            "rc = main(['analyze-trace', sys.argv[2], '--breakdown', '--out', sys.argv[3]]); "
            "print(sorted(m for m in ('numpy', 'pandas', 'pydantic', 'plotly', 'papermill', 'pyarrow') "
            "if m in sys.modules)); "
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(repo / "lib"), str(repo / GPU_REPLAY), str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    got = BreakdownFile.read(tmp_path / "breakdown.json")
    assert got.device == "gpu" and got.ranks == [0, 1] and set(got.chunks_by_reader) == {"c_reduce"}
    assert {r["category"] for r in got.categories} >= {"allreduce_nccl", "gemm_dense"}
    assert got.schema_version == 1 and got.events_seen > 0 and got.json_bytes > 0
    assert "allreduce_nccl" in out.stdout


def test_a_breakdown_file_that_lacks_a_field_or_has_the_wrong_type_is_named_on_read(tmp_path):
    good = {"device": "gpu", "ranks": [0], "categories": [], "names": {"0": {}}, "warnings": [], "skipped": [],
            "chunks_by_reader": {}, "json_bytes": 10, "events_seen": 2}
    path = tmp_path / "breakdown.json"
    path.write_text(json.dumps(good))  # written before schema_version: read as version 1
    assert BreakdownFile.read(path).schema_version == 1
    for broken, says in ((dict(good, ranks="0"), "field 'ranks' is str, expected list"),
                         ({k: v for k, v in good.items() if k != "names"}, "field 'names' is missing"),
                         (dict(good, schema_version=2), "schema_version 2 is newer"),
                         ([1, 2], "a JSON object was expected, not list")):
        path.write_text(json.dumps(broken))
        with pytest.raises(BreakdownFileError) as e:
            BreakdownFile.read(path)
        assert str(e.value).startswith(f"{path}: ") and says in str(e.value)
    path.write_text("{not json")
    with pytest.raises(BreakdownFileError, match="not a readable JSON file"):
        BreakdownFile.read(path)


def test_breakdown_command_names_a_missing_directory(repo, tmp_path):
    out = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "analyze-trace", str(tmp_path / "nope"),
                          "--breakdown"], capture_output=True, text=True, env={"PYTHONPATH": str(repo / "lib")})
    assert out.returncode == 2
    assert str(tmp_path / "nope") in out.stderr and "not a directory" in out.stderr
    out = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "analyze-trace", str(repo / GPU_REPLAY),
                          "--breakdown", "--workers", "0"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(repo / "lib")})
    assert out.returncode == 2 and "--workers 0" in out.stderr and "1 or more" in out.stderr


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
    assert peaks[200_000] < 32 * trace_reader.CHUNK_BYTES, peaks
    assert abs(peaks[200_000] - peaks[40_000]) < 2 << 20, peaks


def test_c_reduction_memory_is_flat_in_the_file_size(tmp_path, repo):
    """The C reduction's memory is outside tracemalloc's sight: peak RSS of a fresh interpreter reducing
    a file of every-row-kept CPU ops, and one five times longer, grows by less than 8 MB (the table
    would hold 20 MB more rows)."""
    from tests.test_trace_parse import _synthetic_trace

    code = ("import sys, resource; sys.path.insert(0, sys.argv[1]); from decodescope.trace import breakdown, cscan; "
            "from decodescope.trace.categorize import default_rules; default_rules(); cscan.library(); "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "b = breakdown.breakdown_dir(sys.argv[2], workers=1); "
            "assert b.chunks_by_reader == {'c_reduce': b.chunks_by_reader['c_reduce']}, b.chunks_by_reader; "
            "print(sum(v['rows'] for v in b.names[0].values()), before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    peaks = {}
    for n in (40_000, 200_000):
        d = tmp_path / str(n)
        d.mkdir()
        _synthetic_trace(d / "t_rank0.pt.trace.json.gz", n, kept_every=1)
        out = subprocess.run([sys.executable, "-c", code, str(repo / "lib"), str(d)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        rows, before_kb, after_kb = map(int, out.stdout.split())
        assert rows == n
        peaks[n] = after_kb
    assert peaks[200_000] - peaks[40_000] < 8 << 10, peaks


# ---- the C scanner (cscan.py, _kscan.c) against the numpy reader, run by run ------------------------------
def _run(events: list[str]) -> tuple[bytes, int, int]:
    text = ("\n" + ",\n".join(events) + "\n").encode()
    return text + parse.PAD, 0, len(text)


def _both_readers(buf, lo, hi, is_gpu):
    from decodescope.trace import cscan

    assert cscan.available()
    c, ref = parse._Columns(), parse._Columns()
    seen_c = cscan.scan_chunk(buf, lo, hi, is_gpu, c, cscan.NameIndex())
    seen_ref = parse._read_chunk(buf, lo, hi, is_gpu, ref, {})
    return (seen_c, c), (seen_ref, ref)


def _event(ph="X", cat="cpu_op", name="aten::mm", tid="7", ts="1.5", dur="2.25", args='{"External id": 1}'):
    return (f'  {{\n    "ph": "{ph}", "cat": "{cat}", "name": {name if name.startswith(chr(34)) else chr(34) + name + chr(34)}, '
            f'"pid": 3, "tid": {tid},\n    "ts": {ts}, "dur": {dur},\n    "args": {args}\n  }}')


@pytest.mark.parametrize("is_gpu", [False, True])
def test_c_scanner_reads_what_the_numpy_reader_reads(is_gpu):
    """Numbers of every shape JSON allows, UTF-8 names, keys and braces inside args and inside strings,
    events not kept (other phases, categories; string tids there), and the name rules of a GPU trace
    (CPU ops kept only when they communicate, runtime calls only when they launch)."""
    numbers = ["0", "-0.0", "5129162565171.905", "0.570", "-12", "123456789012345678", "1234567890123456789",
               "1e-05", "9007199254740993.5", "18446744073709551615", "42", "2.5E+3"]
    events = [_event(ts=n, dur=numbers[-1 - i], tid=str(i - 3)) for i, n in enumerate(numbers)]
    events += [_event(name="caf\u00e9 \u2192 gloo:all_reduce", tid="4000000000"),
               _event(cat="cuda_runtime", name="cudaLaunchKernel"), _event(cat="cuda_runtime", name="cudaGetDevice"),
               _event(cat="kernel", name="void gemm<128, 64>(float*)", args='{"ts": 99, "name": "x}{", "a": [1, {"b": 2}]}'),
               _event(cat="gpu_memcpy", name="Memcpy HtoD"), _event(cat="user_annotation", name="execute_context_0(0)"),
               _event(ph="M", cat="cpu_op", tid='"PyTorch Profiler"'), _event(cat="Trace", tid='"Spans"', ts='"x"'),
               _event(cat="python_function", name="f.py(1): g"), _event(cat="cpu_op", name="c10d::allreduce_")]
    buf, lo, hi = _run(events)
    (seen_c, c), (seen_ref, ref) = _both_readers(buf, lo, hi, is_gpu)
    assert seen_c == seen_ref == len(events)
    got, want = c.drain(), ref.drain()
    assert len(want["ts"]) == (6 if is_gpu else len(numbers) + 6)  # cudaGetDevice launches nothing: never kept
    for col in ("ts", "dur", "tid"):
        assert got[col].tolist() == want[col].tolist(), col
    assert np.signbit(got["ts"]).tolist() == np.signbit(want["ts"]).tolist()
    names = lambda cols, a: [list(cols.dicts["name"])[i] for i in a["name"]]  # noqa: E731
    cats = lambda cols, a: [list(cols.dicts["cat"])[i] for i in a["cat"]]  # noqa: E731
    assert names(c, got) == names(ref, want) and cats(c, got) == cats(ref, want)


# (category, name, kept on a CPU trace, kept on a GPU trace): reader.name_rule, worked by hand
RULED = [("kernel", "void k()", True, True), ("user_annotation", "execute_context_0(0)", True, True),
         ("cpu_op", "aten::mm", True, False), ("cpu_op", "c10d::allreduce_", True, True),
         ("cuda_runtime", "cudaLaunchKernel", True, True), ("cuda_runtime", "cudaGetDevice", False, False),
         ("cuda_driver", "cuLaunchKernel", True, True), ("cuda_driver", "cuCtxGetCurrent", False, False),
         ("python_function", "f.py(1): g", False, False)]
NAMELESS = ['  {\n    "ph": "X", "cat": "cpu_op", "pid": 3, "tid": 7,\n    "ts": 500, "dur": 1,\n    "args": {}\n  }',
            '  {\n    "ph": "X", "cat": "cuda_runtime", "pid": 3, "tid": 7,\n    "ts": 510, "dur": 1,\n    "args": {}\n  }']


@pytest.mark.parametrize("is_gpu", [False, True])
def test_every_reader_keeps_the_events_the_name_rule_keeps(tmp_path, monkeypatch, reader, is_gpu):
    """One rule for which events a trace keeps, whoever reads it: the table's layout reader, its decoder,
    and the breakdown (C reduction, C scanner, numpy). Runtime calls that launch nothing are dropped on a
    CPU trace too; a CPU trace keeps every CPU op, a nameless one included."""
    from tests.test_trace_parse import _decoded_only

    events = [_event(cat=c, name=n, ts=str(10 * i)) for i, (c, n, _, _) in enumerate(RULED)] + NAMELESS
    want = sum(gpu if is_gpu else cpu for _, _, cpu, gpu in RULED) + (0 if is_gpu else 1)
    head = '{\n  "schemaVersion": 1,\n' + ('  "deviceProperties": [{"id": 0}],\n' if is_gpu else "")
    (tmp_path / "t_rank0.json").write_text(head + '  "traceEvents": [\n' + ",\n".join(events)
                                           + '\n  ],\n  "traceName": "t"\n}')
    s = breakdown_dir(tmp_path)
    assert [(m.events_seen, m.events_kept) for m in s.metas] == [(len(events), want)]
    assert set(k for k, v in s.chunks_by_reader.items() if v) == {reader}
    _, meta = parse.parse_trace(tmp_path / "t_rank0.json")
    assert meta.events_kept == want
    _decoded_only(monkeypatch)
    df, meta = parse.parse_trace(tmp_path / "t_rank0.json")
    assert meta.events_kept == len(df) == want


@pytest.mark.parametrize("event", [_event(name='"aten::foo(\\"x\\")"'), _event(tid='"7"'), _event(dur="null"),
                                   _event(tid="7.5")])
def test_c_scanner_leaves_what_it_does_not_read_exactly_to_the_numpy_reader(event):
    """An escaped name, a string or fractional tid, a null duration in a kept event: the scanner gives
    the run back (None), and the numpy reader reads it as json.loads would."""
    from decodescope.trace import cscan

    buf, lo, hi = _run([_event(), event])
    assert cscan.scan_chunk(buf, lo, hi, False, parse._Columns(), cscan.NameIndex()) is None


def test_compact_json_from_other_tools_streams_as_the_table(cpu_traces, tmp_path, monkeypatch):
    """Traces not in Kineto's layout (one line of compact JSON) go through the streaming decoder, batch by
    batch: the same breakdown as the table, neither layout reader used."""
    for src in sorted(cpu_traces.glob("*.gz")):
        doc = json.loads(gzip.decompress(src.read_bytes()))
        (tmp_path / src.name.replace(".json.gz", ".json")).write_text(json.dumps(doc, separators=(",", ":")))
    monkeypatch.setattr(trace_reader, "CHUNK_BYTES", 65536)
    s = _assert_same_as_table(tmp_path)
    assert s.device == "cpu" and len(s.ranks) == 2 and not any(s.chunks_by_reader.values())


def test_scanner_builds_into_an_empty_cache_and_a_failed_build_falls_back(tmp_path, monkeypatch, repo):
    """A fresh cache gets the library (and no leftover temporary file); a compiler that fails leaves the
    numpy reader to do the work, with nothing half-written in the cache."""
    from decodescope.trace import cscan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cscan, "_lib", cscan._UNSET)
    assert cscan.library() is not None
    assert [p.suffix for p in (tmp_path / "cache" / "decodescope").iterdir()] == [".so"]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))
    monkeypatch.setenv("CC", "false")  # a compiler that exits 1
    monkeypatch.setattr(cscan, "_lib", cscan._UNSET)
    assert cscan.library() is None
    assert not list((tmp_path / "cache2" / "decodescope").iterdir())
    s = breakdown_dir(repo / GPU_REPLAY)
    assert s.chunks_by_reader["c"] == 0 and s.chunks_by_reader["numpy"] > 0
