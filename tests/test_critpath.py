"""The critical path of a step: hand-built traces whose path is known, and the real traces' paths
summing to their steps' wall times."""
from pathlib import Path

import numpy as np
import pytest

from decodescope.critpath.path import Pieces, segments, walk_all
from decodescope.critpath.whatif import bounds

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
KINDS = ("op", "transfer", "host", "launch", "idle")


def pieces(rows):
    """rows: (rank, lane, on_cpu, start, end, launch, group), given in (rank, lane, start) order."""
    a = np.array(rows, dtype=float).reshape(-1, 7)
    return Pieces(rank=a[:, 0].astype(int), lane=a[:, 1].astype(int), on_cpu=a[:, 2].astype(bool),
                  start=a[:, 3], end=a[:, 4], launch=a[:, 5].astype(int), group=a[:, 6].astype(int))


def path(p, w0, w1):
    """(piece or -1, kind, dur) of each segment of the one step [w0, w1], in time order."""
    _, walks = walk_all(p, np.array([float(w0)]), np.array([float(w1)]))
    seg = segments(p, walks)
    order = np.argsort(seg["start_us"], kind="stable")
    return [(int(seg["piece"][i]), KINDS[int(seg["kind"][i])], float(seg["end_us"][i] - seg["start_us"][i]))
            for i in order]


def test_a_late_rank_puts_its_work_and_then_the_transfer_on_the_path():
    # rank 0: a short op, then an all-reduce it waits in; rank 1 (late): a long op, then the all-reduce
    p = pieces([(0, 0, 1, 0, 10, -1, -1), (0, 0, 1, 10, 50, -1, 0),
                (1, 1, 1, 0, 40, -1, -1), (1, 1, 1, 40, 50, -1, 0)])
    got = path(p, 0, 50)
    assert got == [(2, "op", 40.0), (1, "transfer", 10.0)] or got == [(2, "op", 40.0), (3, "transfer", 10.0)]
    assert sum(d for _, _, d in got) == 50.0


def test_four_ranks_the_path_goes_through_the_last_rank_to_enter():
    rows = []
    for r, late in enumerate((5, 7, 30, 6)):  # rank 2 enters last, at 30
        rows += [(r, r, 1, 0, late, -1, -1), (r, r, 1, late, 34, -1, 0), (r, r, 1, 34, 40, -1, -1)]
    p = pieces(rows)
    got = path(p, 0, 40)
    assert sum(d for _, _, d in got) == 40.0
    assert (6, "op", 30.0) in got  # rank 2's op before its entry
    assert [k for _, k, _ in got].count("transfer") == 1 and ("transfer", 4.0) in [(k, d) for _, k, d in got]


def test_of_two_overlapping_streams_the_one_that_ends_the_step_is_the_path():
    # CPU thread (lane 0) launches three kernels; stream 1: k0 [0,10], k1 [10,30]; stream 2: k2 [5,25]
    p = pieces([(0, 0, 1, -6, -5, -1, -1), (0, 0, 1, -4, -3, -1, -1), (0, 0, 1, -2, -1, -1, -1),
                (0, 1, 0, 0, 10, 0, -1), (0, 1, 0, 10, 30, 1, -1), (0, 2, 0, 5, 25, 2, -1)])
    got = path(p, 0, 30)
    assert got == [(3, "op", 10.0), (4, "op", 20.0)]


def test_a_host_bound_gap_is_the_launch_and_the_host_before_it():
    # k0 [0,5] launched at -5; the host launches k1 only at 15 (call [15,18]); k1 runs [20,25]
    p = pieces([(0, 0, 1, -5, -3, -1, -1), (0, 0, 1, 15, 18, -1, -1),
                (0, 1, 0, 0, 5, 0, -1), (0, 1, 0, 20, 25, 1, -1)])
    got = path(p, 0, 25)
    assert got == [(1, "host", 15.0), (3, "launch", 5.0), (3, "op", 5.0)]


def test_a_graph_launch_path_is_the_graphs_kernels_and_gaps():
    # one cudaGraphLaunch [0,3]; its kernels [4,10], [11,20] on one stream; the step is the GPU's span
    p = pieces([(0, 0, 1, 0, 3, -1, -1), (0, 1, 0, 4, 10, 0, -1), (0, 1, 0, 11, 20, 0, -1)])
    got = path(p, 4, 20)
    assert got == [(1, "op", 6.0), (2, "idle", 1.0), (2, "op", 9.0)]


def test_a_free_all_reduce_buys_at_most_the_late_ranks_transfer():
    p = pieces([(0, 0, 1, 0, 10, -1, -1), (0, 0, 1, 10, 50, -1, 0),
                (1, 1, 1, 0, 40, -1, -1), (1, 1, 1, 40, 50, -1, 0)])
    cat = np.array(["x", "allreduce", "y", "allreduce"], dtype=object)
    from decodescope.critpath.path import link

    got = bounds(p, link(p), np.array([0.0]), np.array([50.0]), cat, ["allreduce", "y", "x"])
    assert got["allreduce"][0] == 40.0  # rank 1's op still bounds the step
    assert got["y"][0] == 20.0  # the late op free: rank 0's op, then the transfer
    assert got["x"][0] == 50.0  # the early rank's op is off the path: nothing to gain


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph", "vllm_gpu_h200_c16",
                                   "vllm_gpu_h200_kimi_int4_c64", "vllm_gpu_h200_kimi_int4_10l_host_ops"])
def test_every_steps_path_sums_to_its_wall_time_on_the_real_traces(trace):
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.table import critical_paths
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    assert len(cp.windows) > 0
    total = cp.segments.groupby("step")["dur_us"].sum().reindex(cp.windows["step"]).fillna(0.0).to_numpy()
    np.testing.assert_allclose(total, cp.windows["wall_us"].to_numpy(), rtol=1e-9, atol=1e-6)


def test_on_one_gpu_with_cuda_graphs_a_decode_steps_path_is_kernels_and_gaps():
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.table import critical_paths
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / "vllm_gpu_h200_c16")
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    seg = cp.segments[cp.segments["step_kind"] == "decode"]
    ops_on = seg[seg["segment"].isin(["op", "transfer"])]
    # on the host side only the launches (and the time between them) are on the path
    assert set(ops_on.loc[ops_on["on_cpu"], "category"].astype(str)) <= {"launch", "host"}
    assert set(seg["segment"].astype(str)) <= {"op", "idle", "launch", "host"}
    kernels = ops_on.loc[~ops_on["on_cpu"], "dur_us"].sum()
    assert kernels > 0.8 * seg["dur_us"].sum()


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph", "vllm_gpu_h200_c16",
                                   "vllm_gpu_h200_kimi_int4_c64", "vllm_gpu_h200_kimi_int4_10l_host_ops"])
def test_a_replay_with_nothing_changed_takes_each_steps_wall_time(trace):
    # in Python and in C (bounds at a speed-up of 1); on the GPU traces a kernel still running at a step's
    # end once made two steps of the eager capture replay 12.4-12.6 us longer than they took
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.table import critical_paths
    from decodescope.critpath.whatif import replay_step
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    p = cp.labelled.pieces
    w = cp.windows.head(12)
    got = [replay_step(p, cp.links, a, b, np.ones(len(p))) for a, b in zip(w["start_us"], w["end_us"])]
    np.testing.assert_allclose(got, w["wall_us"].to_numpy(), rtol=1e-12, atol=1e-6)
    in_c = bounds(p, cp.links, w["start_us"].to_numpy(float), w["end_us"].to_numpy(float),
                  cp.labelled.category, ["x"], speedup=1.0)["x"]
    np.testing.assert_allclose(in_c, w["wall_us"].to_numpy(), rtol=1e-12, atol=1e-6)


def test_a_kernel_still_running_at_the_steps_end_counts_to_its_point_there():
    # a call [0,1] launches k0 [2,12]; the step ends at 8, inside k0
    p = pieces([(0, 0, 1, 0, 1, -1, -1), (0, 1, 0, 2, 12, 0, -1)])
    from decodescope.critpath.path import link
    from decodescope.critpath.whatif import replay_step

    ln = link(p)
    assert replay_step(p, ln, 0.0, 8.0, np.ones(2)) == 8.0
    assert replay_step(p, ln, 0.0, 8.0, np.array([1.0, 0.5])) == 5.0  # k0's 6 us inside the step at half
    got = bounds(p, ln, np.array([0.0]), np.array([8.0]), np.array(["launch", "k"], dtype=object), ["k", "launch"])
    # k0 free: the step ends where k0 starts; the launch free: k0 still starts 2 us after the call's start
    assert got["k"][0] == 2.0 and got["launch"][0] == 8.0


def sync_pieces(wait: bool):
    """A host thread (lane 0): a launch [0,1] of k0 [2,20] on stream 1, a cudaEventSynchronize piece that
    waited for k0 (from 3; its piece starts at k0's end, 20, and returns at 22), then host work [22,25]."""
    p = pieces([(0, 0, 1, 0, 1, -1, -1), (0, 0, 1, 20, 22, -1, -1), (0, 0, 1, 22, 25, -1, -1),
                (0, 1, 0, 2, 20, 0, -1)])
    p.wait = np.array([-1, 3, -1, -1]) if wait else None
    return p


def test_a_host_call_that_waited_for_the_gpu_puts_the_gpu_work_on_the_path():
    from decodescope.critpath.path import SYNC, link

    got = path(sync_pieces(wait=True), 0, 25)
    # k0's launch gap runs from its call's start, as for any launch; then k0, the call's return, the host
    assert got == [(3, "launch", 2.0), (3, "op", 18.0), (1, "op", 2.0), (2, "op", 3.0)]
    assert link(sync_pieces(wait=True)).kind[1] == SYNC
    # without the edge the wait is a host gap: the path never reaches the kernel
    assert (3, "op", 18.0) not in path(sync_pieces(wait=False), 0, 25)


def test_a_free_kernel_the_host_waited_for_shortens_the_host_too():
    from decodescope.critpath.path import link

    cat = np.array(["launch", "launch", "host", "k"], dtype=object)
    p = sync_pieces(wait=True)
    got = bounds(p, link(p), np.array([0.0]), np.array([25.0]), cat, ["k"])
    assert got["k"][0] == 7.0  # k0 free at 2: the sync [2,4], the host work [4,7]
    p = sync_pieces(wait=False)
    assert bounds(p, link(p), np.array([0.0]), np.array([25.0]), cat, ["k"])["k"][0] == 25.0  # understated


def test_on_the_eager_gpu_capture_the_syncs_bind_the_host_to_the_gpu_and_raise_the_bounds():
    # vLLM's eager step waits in cudaEventSynchronize (16% of its time in this capture); without the edge
    # a free GEMM bought 0.4% of the step, as if the host had waited for nothing
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.path import SYNC, link
    from decodescope.critpath.table import critical_paths
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / "vllm_gpu_h200_kimi_int4_10l_host_ops")
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    lab, ln = cp.labelled, cp.links
    p = lab.pieces
    synced = np.flatnonzero(ln.kind == SYNC)
    assert len(synced) >= 8 and set(lab.name[synced]) <= {"cudaEventSynchronize", "cudaDeviceSynchronize"}
    assert (p.start[synced] == p.end[ln.pred[synced]]).all() and (~p.on_cpu[ln.pred[synced]]).all()
    w = cp.windows[cp.windows["kind"] == "decode"]
    w0, w1 = w["start_us"].to_numpy(float), w["end_us"].to_numpy(float)
    gain = 1 - bounds(p, ln, w0, w1, lab.category, ["gemm_dense"])["gemm_dense"] / (w1 - w0)
    p.wait = None
    gain_unbound = 1 - bounds(p, link(p), w0, w1, lab.category, ["gemm_dense"])["gemm_dense"] / (w1 - w0)
    assert np.median(gain) > 0.05 and np.median(gain) > 5 * np.median(gain_unbound), (gain, gain_unbound)
    assert (gain >= gain_unbound - 1e-9).all()


def test_analyze_trace_critical_path_writes_the_segments_and_the_shares(tmp_path, capsys):
    from decodescope.cli.main import main

    assert main(["analyze-trace", str(FIXTURES / "vllm_cpu_tp2_c4"), "--critical-path", "--out", str(tmp_path)]) == 0
    import json

    import pandas as pd

    got = json.loads((tmp_path / "critical_path.json").read_text())
    seg = pd.read_parquet(tmp_path / "critical_path.parquet")
    assert got["step_kind"] == "decode" and got["ranks"] == [0, 1]
    assert {r["category"] for r in got["shares"]} >= {"allreduce", "host"}
    assert seg.groupby("step")["dur_us"].sum().gt(0).all()
    assert "on the critical path beside its summed share" in capsys.readouterr().out


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph"])
def test_the_shares_summed_a_few_steps_at_a_time_are_the_shares_summed_at_once(trace, monkeypatch):
    import pandas as pd

    from decodescope.critpath import summary as critpath_summary
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.table import critical_paths
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    monkeypatch.setattr(critpath_summary, "STEPS_AT_ONCE", 10**9)
    at_once = critpath_summary.attribution(cp, ops, "all")
    monkeypatch.setattr(critpath_summary, "STEPS_AT_ONCE", 3)
    pd.testing.assert_frame_equal(critpath_summary.attribution(cp, ops, "all"), at_once, check_exact=True)


def test_the_piece_that_ends_a_step_is_the_last_to_end_by_its_end_a_tie_to_the_later_piece():
    from decodescope.critpath.path import terminals

    def by_hand(p, a, b):
        n = len(p)
        ended = max((i for i in range(n) if p.end[i] <= b), key=lambda i: (p.end[i], i), default=-1)
        run = max((i for i in range(n) if p.start[i] < b), key=lambda i: (p.start[i], i), default=-1)
        if run >= 0 and p.end[run] > b and p.start[run] >= a:
            ended = run
        return ended if ended >= 0 and p.end[ended] > a else -1

    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        lane = np.sort(rng.integers(0, 4, n))
        start = np.round(rng.uniform(0, 30, n))
        start = start[np.lexsort((start, lane))]
        end = start + np.round(rng.exponential(3, n))  # pieces of a lane may overlap: their ends out of order
        p = Pieces(rank=lane // 2, lane=lane, on_cpu=np.ones(n, bool), start=start, end=end,
                   launch=np.full(n, -1), group=np.full(n, -1))
        w0 = np.round(rng.uniform(-5, 35, 8))
        w1 = w0 + np.round(rng.uniform(0, 12, 8))
        assert terminals(p, w0, w1).tolist() == [by_hand(p, a, b) for a, b in zip(w0, w1)]


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "vllm_gpu_h200_c16"])
def test_a_steps_pieces_found_lane_by_lane_are_those_a_pass_over_every_piece_finds(trace):
    from decodescope.trace.analyze import find_steps, op_table
    from decodescope.critpath.table import critical_paths
    from decodescope.critpath.whatif import ordered_lanes, step_rows
    from decodescope.trace.load import load_trace_dir

    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    p, lanes = cp.labelled.pieces, ordered_lanes(cp.labelled.pieces)
    for a, b in zip(cp.windows["start_us"], cp.windows["end_us"]):
        np.testing.assert_array_equal(step_rows(p, cp.links, a, b, lanes), step_rows(p, cp.links, a, b))
