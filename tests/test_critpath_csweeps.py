"""The critical path's sweeps in C (_kscan.c) give the numpy passes' results, in the same order, to the bit:
nested ops cut into self-time stretches (cp_cut), and the paths' segments in the table's order (cp_segments)."""
from pathlib import Path

import numpy as np
import pytest

from decodescope.critpath import path as critpath, pieces as critpath_pieces
from decodescope.trace.analyze import find_steps, op_table, thread_order
from decodescope.critpath.table import critical_paths
from decodescope.trace.cscan import library
from decodescope.trace.load import load_trace_dir

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def numpy_cut(rank, tid, ts, end, whole=None):
    order = thread_order(rank, tid, ts, end - ts)
    return critpath_pieces._cut_in_numpy(order, rank, tid, ts, end, whole)


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


@pytest.fixture
def c_cut():
    if library() is None:
        pytest.skip("no C compiler: the scanner is not built")
    return critpath_pieces.cut_nested


def test_the_c_cut_gives_the_numpy_cut_on_ops_that_tie_overlap_and_hold_whole_ones(c_cut):
    rng = np.random.default_rng(45)
    for trial in range(400):
        n = int(rng.integers(1, 120))
        rank, tid = rng.integers(0, 2, n), rng.integers(-2, 3, n)  # negative thread ids: no shortcut order
        grid = rng.choice([1.0, 0.25])  # on a grid: ops that start or end together
        ts = np.round(rng.uniform(0, 40, n) / grid) * grid
        end = ts + np.round(rng.exponential(4, n) / grid) * grid * (rng.random(n) > 0.1)  # some of no length
        whole = rng.random(n) < 0.15 if trial % 2 else None
        assert_same(c_cut(rank, tid, ts, end, whole), numpy_cut(rank, tid, ts, end, whole))


def test_the_c_cut_gives_the_numpy_cut_on_the_cpu_traces_ops(c_cut):
    ops = op_table(load_trace_dir(FIXTURES / "vllm_cpu_tp2_c4").events)
    rank, tid = ops["rank"].to_numpy(np.int64), ops["lane"].to_numpy(np.int64)
    ts = ops["ts_us"].to_numpy(float)
    end = ts + ops["dur_us"].to_numpy(float)
    whole = ops["category"].isin(critpath_pieces.collective_categories()).to_numpy()
    assert_same(c_cut(rank, tid, ts, end, whole), numpy_cut(rank, tid, ts, end, whole))


def test_no_ops_cut_into_no_stretches(c_cut):
    got = c_cut(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    assert [len(a) for a in got] == [0, 0, 0]


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph", "vllm_gpu_h200_c16"])
def test_the_c_segments_are_the_numpy_segments_in_the_tables_order(trace, monkeypatch):
    if library() is None:
        pytest.skip("no C compiler: the scanner is not built")
    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    got = critpath.ordered_segments(cp.labelled.pieces, cp.walks)
    monkeypatch.setattr(critpath, "library", lambda: None)
    want = critpath.ordered_segments(cp.labelled.pieces, cp.walks)
    assert list(got) == list(want)
    assert_same(list(got.values()), list(want.values()))
