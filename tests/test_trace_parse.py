import gzip
import json
import shutil
from pathlib import Path
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


# ---- the one-pass reader: layout reading, chunks, memory, processes -------------------------------------
GPU_REPLAY = "tests/fixtures/traces/h200x2_step_replay_graph"


def _same_table(a, b):
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for c in a.columns:
        assert a[c].dtype == b[c].dtype, c
        assert a[c].astype(object).equals(b[c].astype(object)), c
    for c in ("name", "cat", "coll_name", "coll_dtype", "pg_name"):
        assert list(a[c].cat.categories) == list(b[c].cat.categories), c


def _decoded_only(monkeypatch):
    """Every chunk through orjson, none through the layout reader: the reference the fast path must equal."""
    from decodescope.trace import parse

    def refuse(*a, **k):
        raise parse._NotLayout
    monkeypatch.setattr(parse, "_layout_chunk", refuse)


@pytest.mark.parametrize("source", ["cpu", "gpu"])
def test_layout_reader_gives_the_decoders_table(source, cpu_traces, repo, monkeypatch):
    paths = sorted(cpu_traces.glob("*.gz")) if source == "cpu" else sorted((repo / GPU_REPLAY).glob("*.gz"))
    fast = [parse_trace(p) for p in paths]
    _decoded_only(monkeypatch)
    for p, (df, meta) in zip(paths, fast):
        ref, ref_meta = parse_trace(p)
        _same_table(df, ref)
        assert (meta.events_seen, meta.events_kept, meta.rank) == (ref_meta.events_seen, ref_meta.events_kept, ref_meta.rank)


def test_events_straddling_chunk_boundaries_are_read_whole(cpu_traces, monkeypatch):
    from decodescope.trace import reader

    src = sorted(cpu_traces.glob("*.gz"))[0]
    whole, _ = parse_trace(src)
    for chunk in (4096, 4099, 65536 + 17):  # every event cut somewhere at one of these sizes
        monkeypatch.setattr(reader, "CHUNK_BYTES", chunk)
        df, meta = parse_trace(src)
        _same_table(df, whole)
        assert meta.bytes_json == len(gzip.decompress(src.read_bytes()))
    totals, counts, _ = _independent_totals(src)
    ours = df[df["cat"].astype(str) == "cpu_op"].groupby(df["name"].astype(str))["dur_us"].sum()
    assert ours.to_dict() == pytest.approx(dict(totals), rel=1e-9, abs=1e-6)


def test_chunks_read_in_worker_processes_give_the_same_table(repo, monkeypatch):
    from decodescope.trace import reader

    src = sorted((repo / GPU_REPLAY).glob("*.gz"))[0]
    monkeypatch.setattr(reader, "CHUNK_BYTES", 256 << 10)  # a dozen chunks
    one, _ = parse_trace(src, workers=1)
    two, meta = parse_trace(src, workers=2)
    _same_table(one, two)
    assert meta.events_kept == len(one)


def test_gzip_of_several_members_and_plain_json_read_alike(repo, tmp_path):
    src = sorted((repo / GPU_REPLAY).glob("*.gz"))[0]
    text = gzip.decompress(src.read_bytes())
    plain = tmp_path / "rank0.plain.pt.trace.json"
    plain.write_bytes(text)
    members = tmp_path / "rank0.members.pt.trace.json.gz"
    third = len(text) // 3
    members.write_bytes(b"".join(gzip.compress(text[i:i + third]) for i in range(0, len(text), third)))
    ref, _ = parse_trace(src)
    for p in (plain, members):
        df, meta = parse_trace(p)
        _same_table(df, ref)
        assert meta.bytes_json == len(text)


def _synthetic_trace(path, n_events: int, kept_every: int = 50):
    """A with_stack-like trace: python_function events, one kept cpu_op in kept_every."""
    with gzip.open(path, "wt", compresslevel=1) as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "traceEvents": [\n')
        for i in range(n_events):
            cat, name = ("cpu_op", f"aten::op{i % 7}") if i % kept_every == 0 else ("python_function", f"f.py({i}): g")
            f.write(('' if i == 0 else ',\n') + f'  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": 1, "tid": 1,\n'
                    f'    "ts": {1000 + i}.500, "dur": 0.250,\n    "args": {{\n      "External id": {i}\n    }}\n  }}')
        f.write('\n  ],\n  "traceName": "x"\n}')


def test_parse_memory_is_bounded_by_the_chunks_not_the_file(tmp_path):
    """Peak Python/numpy allocations while parsing, less the kept columns, stay the same for a file
    five times bigger: the text is never held whole."""
    import tracemalloc

    from decodescope.trace.parse import parse_columns

    peaks = {}
    for n in (40_000, 200_000):  # ~8 MB and ~40 MB of JSON
        p = tmp_path / f"rank0.n{n}.pt.trace.json.gz"
        _synthetic_trace(p, n)
        tracemalloc.start()
        cols, meta = parse_columns(p)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        kept = sum(a.nbytes for parts in cols.parts.values() for a in parts)
        peaks[n] = (peak - kept, meta.bytes_json)
        assert meta.events_kept == n // 50
    from decodescope.trace.parse import CHUNK_BYTES

    (small, small_json), (big, big_json) = peaks[40_000], peaks[200_000]
    assert big_json > 4 * small_json
    # the chunks in flight and one chunk's index arrays (~20 bytes a byte on this key-dense text),
    # whatever the file's size
    assert big < 32 * CHUNK_BYTES < big_json, peaks
    assert abs(big - small) < 4 << 20, peaks


def test_numbers_are_read_as_json_reads_them():
    import numpy as np

    from decodescope.trace.layout import _parse_numbers, _POW10, _TWO53
    from decodescope.trace.reader import PAD

    tokens = ["0", "-0.0", "5129162565171.905", "0.570", "-12", "123456789012345678", "1234567890123456789",
              "1e-05", '"Spans"', "null", ".5", "1.", "9007199254740993.5", "18446744073709551615", "42"]
    text = b"".join(t.encode() + b",\n" for t in tokens) + PAD
    starts = np.cumsum([0] + [len(t) + 2 for t in tokens[:-1]])
    num, frac, neg, ok = _parse_numbers(np.frombuffer(text, np.uint8), starts)
    for i, t in enumerate(tokens):
        try:
            ref = json.loads(t)
        except ValueError:
            ref = None
        as_float = ok[i] and num[i] <= _TWO53 and frac[i] > 0
        if as_float:
            v = num[i] / _POW10[frac[i]]
            v = -v if neg[i] else v
            assert isinstance(ref, (int, float)) and v == float(ref) and np.signbit(v) == np.signbit(float(ref)), t
        elif ok[i] and frac[i] == 0:
            assert isinstance(ref, int) and (-num[i] if neg[i] else num[i]) == ref, t
        else:  # left to the one-at-a-time reader: never a plain decimal it could have taken exactly
            assert t in ("1e-05", '"Spans"', "null", ".5", "1.", "1234567890123456789", "9007199254740993.5",
                         "18446744073709551615"), t


def test_escaped_quotes_and_odd_values_read_as_json_reads_them(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": 'aten::foo("x")', "pid": "Spans", "tid": 2, "ts": 1.5, "dur": 2},
              {"ph": "X", "cat": "cpu_op", "name": "caf\u00e9\\n", "pid": 1, "tid": 2, "ts": 1e-3, "dur": None},
              {"ph": "X", "cat": "user_annotation", "name": "step", "pid": 1, "tid": 2, "ts": 0, "dur": 10,
               "args": {"External id": 12345678901234567890}}]
    bodies = ",".join("\n  {\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in ev.items()) + "\n  }"
                      for ev in events)
    p = tmp_path / "rank0.odd.pt.trace.json"
    p.write_text('{\n  "traceEvents": [' + bodies + "\n  ]\n}")
    df, meta = parse_trace(p)
    assert df["name"].astype(str).tolist() == ['aten::foo("x")', "caf\u00e9\\n", "step"]
    assert df["pid"].tolist() == [-1, 1, 1] and df["ts_us"].tolist() == [1.5, 1e-3, 0.0]
    assert df["dur_us"].tolist() == [2.0, 0.0, 10.0] and df["external_id"].tolist() == [-1, -1, -1]


def test_rank_files_go_to_processes_only_past_the_measured_crossover():
    from decodescope.trace.load import FILES_IN_PROCESSES_MIN_BYTES, plan_processes

    small = FILES_IN_PROCESSES_MIN_BYTES // 4
    assert plan_processes([small, small], workers=2) == [0, 0]  # a fork costs more than it saves
    big = FILES_IN_PROCESSES_MIN_BYTES
    assert plan_processes([big, big], workers=2) == [0, 1]  # one rank here, one in a worker
    assert plan_processes([big] * 4, workers=2) == [0, 1, 0, 1]
    assert plan_processes([big, 3 * big, big, big], workers=2) == [1, 0, 1, 1]  # largest first, least loaded
    assert plan_processes([big, big], workers=1) == [0, 0]


def test_one_file_is_read_in_chunk_workers_only_when_big(tmp_path, monkeypatch):
    from decodescope.trace import load

    p = tmp_path / "rank0.x.pt.trace.json.gz"
    _synthetic_trace(p, 20_000)
    assert load.workers_for(p, 2) == 1
    monkeypatch.setattr(load, "FILE_POOL_MIN_BYTES", 1 << 20)
    assert load.workers_for(p, 2) == 2 and load.workers_for(p, 1) == 1


def test_gzip_size_record_gives_the_json_size(repo):
    from decodescope.trace.parse import json_size

    src = sorted((repo / GPU_REPLAY).glob("*.gz"))[0]
    assert json_size(src) == len(gzip.decompress(src.read_bytes()))


def test_the_trace_command_imports_no_pandas_or_pydantic_before_parsing(repo):
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import decodescope.cli.analyze_trace, decodescope.trace.load; "
            "print(sorted(m for m in ('pandas', 'pydantic', 'plotly', 'papermill', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(repo / "lib")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- self times without a Python loop (trace/analyze.py), as the stack of open ops gives them -----------
def _stack_self_times(ops):
    """The reference: one op at a time, a stack of the ops still open (the loop self_times replaced)."""
    import numpy as np

    out = ops["dur_us"].to_numpy(dtype=float).copy()
    parent = np.full(len(ops), -1)
    order = np.lexsort((-ops["dur_us"].to_numpy(), ops["ts_us"].to_numpy(), ops["tid"].to_numpy(),
                        ops["rank"].to_numpy()))
    ts = ops["ts_us"].to_numpy()
    end = ts + ops["dur_us"].to_numpy()
    tid, rank = ops["tid"].to_numpy(), ops["rank"].to_numpy()
    stack, key = [], None
    for i in order:
        if (rank[i], tid[i]) != key:
            stack, key = [], (rank[i], tid[i])
        while stack and end[stack[-1]] <= ts[i] + 1e-9:
            stack.pop()
        if stack:
            out[stack[-1]] -= min(end[i], end[stack[-1]]) - ts[i]
            parent[i] = stack[-1]
        stack.append(i)
    return np.maximum(out, 0.0), parent


def _nested_ops(seed: int, n_top: int = 150):
    """CPU ops on two ranks and three threads: nested calls, siblings, identical twins, and children that
    outlast their parent by a rounding step (the stack keeps them open)."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []

    def calls(rank, tid, start, end, depth):
        t = start
        while depth < 7 and t < end and rng.random() < 0.8:
            s = round(t + rng.uniform(0, (end - t) / 3), 3)
            d = round(rng.uniform(0, end - s), 3)
            if rng.random() < 0.05:
                d = round(d + 0.002, 3)  # outlasts its parent
            rows.append((rank, tid, s, d))
            if rng.random() < 0.05:
                rows.append((rank, tid, s, d))  # a twin
            calls(rank, tid, s, s + d, depth + 1)
            t = s + d
    for rank in (0, 1):
        for tid in (11, 12, 4000000000):
            t = 0.0
            for _ in range(n_top):
                s, d = round(t + rng.uniform(0, 5), 3), round(rng.uniform(0, 50), 3)
                rows.append((rank, tid, s, d))
                calls(rank, tid, s, s + d, 1)
                t = s + d
    return pd.DataFrame(rows, columns=["rank", "tid", "ts_us", "dur_us"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_self_times_equal_the_stack_of_open_ops(seed):
    import numpy as np

    from decodescope.trace.analyze import self_times

    ops = _nested_ops(seed)
    for frame in (ops.sample(frac=1, random_state=seed).reset_index(drop=True),  # any order
                  ops.sort_values(["rank", "ts_us"], kind="stable").reset_index(drop=True)):  # op_table's
        ref_self, ref_parent = _stack_self_times(frame)
        ours, parent = self_times(frame)
        assert np.array_equal(ours, ref_self) and np.array_equal(parent, ref_parent)


def test_op_table_rows_are_the_kept_kernels_by_rank_and_start(repo):
    from decodescope.trace.analyze import op_table

    events = load_trace_dir(repo / GPU_REPLAY).events
    ops = op_table(events)
    ref = events[events["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"])].sort_values(["rank", "ts_us"])
    assert ops["name"].astype(str).tolist() == ref["name"].astype(str).tolist()
    assert list(ops.index) == list(range(len(ops)))


# (chunk bytes, whether the file is cut to its first HEAD_EVENTS events): a 97-byte chunk cuts every event at
# several places, and over a whole 22 MB GPU trace it took 11 s a reader. The GPU trace's head holds every
# CPU-side event these tests count (Kineto writes them first: the last is event 14,890 of 67,168); a trace of
# fewer than twice HEAD_EVENTS events (the CPU fixture's 17,700) is read whole.
CHUNKS = ((97, True), (4099, False), (1 << 20, False))
HEAD_EVENTS = 16_000


def _kineto_head(src: Path, out: Path, n_events: int) -> Path:
    """src's first n_events events as a Kineto trace of the same layout (its text cut at an event boundary and
    closed as Kineto closes a file), gzipped at out; src itself where it has fewer than twice n_events."""
    import re

    text = gzip.decompress(src.read_bytes()).decode()
    start = text.index('"traceEvents": [')
    cuts = [m.start() for m in re.finditer(r"\n  \},\n  \{", text[start:])]
    if len(cuts) < 2 * n_events:
        return src
    head = text[:start + cuts[n_events - 1]] + '\n  }\n  ],\n  "traceName": "head"\n}'
    out.write_bytes(gzip.compress(head.encode()))
    return out


def _chunked_files(src: Path, tmp: Path) -> list[tuple[int, Path, list[dict]]]:
    """(chunk bytes, the file read at it, that file's events as json.load reads them), for each of CHUNKS."""
    head = _kineto_head(src, tmp / src.name, HEAD_EVENTS)
    events = {p: json.loads(gzip.decompress(p.read_bytes()))["traceEvents"] for p in (head, src)}
    return [(chunk, head if cut else src, events[head if cut else src]) for chunk, cut in CHUNKS]


@pytest.mark.parametrize("fixture", ["vllm_cpu_tp2_c4", "vllm_gpu_h200_c16"])
def test_the_steps_a_trace_annotates_are_counted_in_one_pass_whatever_the_chunks(fixture, monkeypatch, tmp_path):
    """The attach guard's count: each CPU-side step annotation once (a GPU trace's gpu_user_annotation copy
    not), against json.load, with chunk sizes that cut annotations at every place."""
    from decodescope.trace import reader
    from decodescope.trace.analyze import STEP_NAME

    src = sorted((Path(__file__).parent / "fixtures/traces" / fixture).glob("*rank0*.pt.trace.json.gz"))[0]
    for chunk, path, events in _chunked_files(src, tmp_path):
        want = sum(1 for e in events if e.get("cat") == "user_annotation" and STEP_NAME.fullmatch(str(e.get("name"))))
        assert want > 10
        monkeypatch.setattr(reader, "CHUNK_BYTES", chunk)
        assert reader.annotated_steps(path) == want


def test_named_cpu_ops_are_read_in_one_pass_whatever_the_chunks(monkeypatch, tmp_path):
    """The drafter's marks on a GPU trace (which the column readers leave out there), against json.load, with
    chunk sizes that cut the events' heads at every place."""
    from decodescope.trace import reader

    src = sorted((Path(__file__).parent / "fixtures/traces/vllm_gpu_h200_c16").glob("*rank0*.pt.trace.json.gz"))[0]
    names = ("aten::argmax", "Pregraph bytecode")
    wants = []
    for chunk, path, events in _chunked_files(src, tmp_path):
        want = sorted((e["name"], float(e["ts"]), float(e["dur"]), int(e["tid"])) for e in events
                      if e.get("cat") == "cpu_op" and e.get("name") in names)
        assert {w[0] for w in want} == set(names) and len(want) > 50
        monkeypatch.setattr(reader, "CHUNK_BYTES", chunk)
        assert sorted(reader.named_cpu_ops(path, names)) == want
        wants.append(want)
    assert wants[0] == wants[-1]  # the head holds every one of the whole file's
