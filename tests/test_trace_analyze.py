import json

import pandas as pd
import pytest

from decodescope.trace import analyze as an
from decodescope.trace.load import load_trace_dir
from decodescope.trace.profile import analyze_traces, write_profile


def test_real_cpu_traces_steps_and_allreduces_per_step(cpu_traces):
    loaded = load_trace_dir(cpu_traces)
    result = analyze_traces(loaded)
    assert result.device == "cpu"
    assert (result.steps.groupby("rank").size() == 5).all()
    assert set(result.steps["kind"]) == {"decode"}
    ar = result.per_step[result.per_step["category"] == "allreduce"]
    # c10d::allreduce_ wraps gloo:all_reduce: one call each, not two
    assert ar["calls_per_step"].tolist() == [3.0, 3.0]
    gemm = result.per_step[result.per_step["category"] == "gemm"]
    assert (gemm["calls_per_step"] >= 3).all()


def test_self_time_subtracts_children():
    ops = pd.DataFrame({"rank": [0, 0, 0], "tid": [1, 1, 1], "ts_us": [0.0, 10.0, 50.0],
                        "dur_us": [100.0, 20.0, 30.0]})
    self_us, parent = an.self_times(ops)
    assert self_us.tolist() == [50.0, 20.0, 30.0]
    assert parent.tolist() == [-1, 0, 0]


def _gpu_events(rows):
    df = pd.DataFrame(rows)
    for c in ("correlation", "in_nelems", "out_nelems", "group_size", "external_id", "pid", "tid"):
        df[c] = df[c].fillna(-1).astype(int) if c in df else -1
    if "coll_dtype" not in df:
        df["coll_dtype"] = None
    df["coll_name"] = None
    df["pg_name"] = None
    return df


def _two_stream_trace():
    """One rank, one annotated step (GPU side), kernels on two streams that overlap."""
    rows = [
        {"rank": 0, "cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_1(1)", "ts_us": 0.0,
         "dur_us": 120.0, "stream": 7},
        {"rank": 0, "cat": "kernel", "name": "nvjet_tst_128x64_64x8_2x1_v_bz_TNN", "ts_us": 0.0, "dur_us": 50.0, "stream": 7},
        {"rank": 0, "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts_us": 20.0, "dur_us": 60.0,
         "stream": 9, "in_nelems": 7168, "coll_dtype": "BFloat16"},
        {"rank": 0, "cat": "kernel", "name": "fused_moe_kernel", "ts_us": 90.0, "dur_us": 20.0, "stream": 7},
    ]
    return _gpu_events(rows)


def test_summed_kernel_time_exceeds_busy_when_streams_overlap():
    events = _two_stream_trace()
    ops = an.op_table(events)
    steps = an.find_steps(events, ops)
    ops = an.assign_steps(ops, steps, events)
    busy = an.busy_vs_sum(ops, steps)
    row = busy.iloc[0]
    assert row["summed_us"] == 130.0          # 50 + 60 + 20
    assert row["busy_us"] == 100.0            # [0, 80] U [90, 110]
    assert row["wall_us"] == 120.0
    assert row["idle_us"] == 20.0
    assert ops["msg_bytes"].dropna().tolist() == [14336.0]


def test_collective_skew_takes_min_as_transfer_and_excess_as_wait():
    rows = []
    for rank, durs in ((0, [10.0, 50.0]), (1, [40.0, 12.0])):
        for i, d in enumerate(durs):
            rows.append({"rank": rank, "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                         "ts_us": 100.0 * i, "dur_us": d, "stream": 1})
    ops = an.op_table(_gpu_events(rows))
    ops["step"] = 0
    skew = an.collective_skew(ops)
    by = skew.set_index(["rank", "instance"])
    assert by.loc[(0, 0), "wait_us"] == 0.0 and by.loc[(1, 0), "wait_us"] == 30.0
    assert by.loc[(0, 1), "wait_us"] == 38.0 and by.loc[(1, 1), "transfer_us"] == 12.0
    summary = an.skew_summary(skew).set_index("rank")
    assert summary.loc[0, "wait_us"] == 38.0 and summary.loc[1, "wait_us"] == 30.0


def test_a_call_whose_wait_is_an_op_of_its_own_costs_its_op_plus_the_waits_that_follow_it():
    """gloo through the functional collectives: each call is an all_reduce_ op, then wait_tensor. By hand,
    two ranks, two steps of two calls each, (op, wait) in us:
      rank 0: (20, 200) (30, 2500)  |  (25, 180) (20, 210)
      rank 1: (40, 300) (25, 2600)  |  (20, 5)   (30, 190)
    The calls: rank 0 220 2530 205 230, rank 1 340 2625 25 220; least over the ranks 220 2530 25 220 (the
    second call stalled on both ranks, the third's rank 1 arrived last). A wait op is the call's before
    the next call starts; other ops between them are not. Then per step: median 220, mean 748.75, 2 calls."""
    from decodescope.trace.profile import calls_with_wait_stats

    calls = {0: [(20, 200), (30, 2500), (25, 180), (20, 210)], 1: [(40, 300), (25, 2600), (20, 5), (30, 190)]}
    rows = []
    for rank, pairs in calls.items():
        ts = 0.0
        for i, (op_us, wait_us) in enumerate(pairs):
            step = i // 2
            rows.append({"rank": rank, "step": step, "category": "allreduce", "counted": True, "ts_us": ts,
                         "dur_us": float(op_us)})
            rows.append({"rank": rank, "step": step, "category": "attention", "counted": True, "ts_us": ts + op_us,
                         "dur_us": 1.0})
            rows.append({"rank": rank, "step": step, "category": "collective_wait", "counted": True,
                         "ts_us": ts + op_us + 1, "dur_us": float(wait_us)})
            # nested under the wait: not counted, not added
            rows.append({"rank": rank, "step": step, "category": "collective_wait", "counted": False,
                         "ts_us": ts + op_us + 2, "dur_us": 1.0})
            ts += 10_000.0
    got = an.calls_with_wait(pd.DataFrame(rows))
    by = got.set_index(["rank", "instance"])
    assert by["call_us"].tolist() == [220.0, 2530.0, 205.0, 230.0, 340.0, 2625.0, 25.0, 220.0]
    assert by.loc[0, "least_us"].tolist() == [220.0, 2530.0, 25.0, 220.0]
    steps = pd.DataFrame({"rank": [0, 0, 1, 1], "step": [0, 1, 0, 1], "kind": ["decode"] * 4})
    stats = calls_with_wait_stats(got, steps, "decode")
    assert (stats.median_us, stats.mean_us, stats.calls_per_step, stats.calls) == (220.0, 748.75, 2.0, 4)
    # no wait ops (the shm path, NCCL): nothing
    assert an.calls_with_wait(pd.DataFrame([r for r in rows if r["category"] != "collective_wait"])).empty
    assert calls_with_wait_stats(an.calls_with_wait(pd.DataFrame(rows[:0], columns=list(rows[0]))), steps,
                                 "decode") is None


def test_gpu_kernels_are_placed_by_launch_time_without_gpu_annotations():
    rows = [
        {"rank": 0, "cat": "user_annotation", "name": "execute_context_0(0)_generation_2(2)", "ts_us": 0.0,
         "dur_us": 30.0, "stream": -1},
        {"rank": 0, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts_us": 5.0, "dur_us": 2.0, "stream": -1,
         "correlation": 11},
        # runs on the GPU after the CPU range has ended
        {"rank": 0, "cat": "kernel", "name": "fused_moe_kernel", "ts_us": 45.0, "dur_us": 5.0, "stream": 7,
         "correlation": 11},
    ]
    events = _gpu_events(rows)
    ops = an.op_table(events)
    steps = an.find_steps(events, ops)
    ops = an.assign_steps(ops, steps, events)
    assert ops["step"].tolist() == [0]


def test_steps_from_gaps_without_annotations():
    rows = [{"rank": 0, "cat": "kernel", "name": "k", "ts_us": t, "dur_us": 5.0, "stream": 7}
            for t in (0, 10, 20, 1000, 1010, 1020, 3000, 3010)]
    ops = an.op_table(_gpu_events(rows))
    steps = an.steps_from_gaps(ops)
    assert len(steps) == 3 and set(steps["source"]) == {"gaps"}


def test_write_profile_files(cpu_traces, tmp_path, repo):
    result = analyze_traces(load_trace_dir(cpu_traces))
    summary = write_profile(result, tmp_path)
    assert (tmp_path / "kernels.parquet").is_file()
    on_disk = json.loads((tmp_path / "profile_summary.json").read_text())
    assert on_disk["ranks"] == [0, 1] == summary.ranks
    # keyed by rank: an int in the record, a string in the file
    assert on_disk["allreduce_calls_per_step"] == {"0": 3.0, "1": 3.0}
    assert summary.allreduce_calls_per_step == {0: 3.0, 1: 3.0}
    kernels = pd.read_parquet(tmp_path / "kernels.parquet")
    assert set(kernels["rank"]) == {0, 1}


def test_a_failed_stop_profile_quotes_the_server_log(tmp_path):
    from types import SimpleNamespace

    from decodescope.profiling.window import stop_profile_error

    log = tmp_path / "server.log"
    log.write_text("INFO ok\nERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -9)\n")
    err = str(stop_profile_error(SimpleNamespace(base_url="http://h:1", log_path=log), 500, 163.4))
    assert "/stop_profile answered HTTP 500 after 163 s" in err
    assert "exit code: -9" in err and str(log) in err and "profile.with_stack" in err
    err = str(stop_profile_error(SimpleNamespace(base_url="http://h:1", log_path=None), 500, 1.0))
    assert "see the server's own log" in err


def test_timeline_step_is_a_typical_step_of_the_analysed_kind_or_says_why_none():
    from types import SimpleNamespace

    from decodescope.report.profile_view import timeline_step

    def result(rows, kind="decode"):
        return SimpleNamespace(step_kind=kind, busy=pd.DataFrame(
            rows, columns=["rank", "step", "kind", "wall_us", "busy_us"]))

    # steps 0-1 prefill (long), 2-5 decode; step 4 is prefill on rank 1 (ranks disagree): never picked
    rows = [(r, s, k, w, w / 2) for r in (0, 1) for s, k, w in
            ((0, "prefill", 9000.0), (1, "prefill", 9000.0), (2, "decode", 1000.0), (3, "decode", 1200.0),
             (4, "decode" if r == 0 else "prefill", 1100.0), (5, "decode", 5000.0))]
    step, why = timeline_step(result(rows))
    assert step == 3 and "Step 3" in why and "decode step" in why
    step, why = timeline_step(result([]))
    assert step is None and "No step timeline" in why
    step, why = timeline_step(result([r for r in rows if r[2] == "prefill"]))
    assert step is None and "decode" in why and "prefill" in why
    step, why = timeline_step(result([(0, 0, "unknown", 10.0, 5.0)], kind="unknown"))
    assert step == 0 and "pauses in the work" in why


def test_timeline_step_of_real_traces_is_a_decode_step(cpu_traces):
    from decodescope.report.profile_view import timeline_figure, timeline_step

    result = analyze_traces(load_trace_dir(cpu_traces))
    step, why = timeline_step(result)
    assert set(result.steps.loc[result.steps["step"] == step, "kind"]) == {"decode"}, why
    why, fig = timeline_figure(result)
    assert fig is not None and fig.layout.title.text.startswith(f"Step {step}:")


def test_the_all_reduces_own_time_per_step_is_the_median_call_at_its_least_time_over_ranks():
    from decodescope.trace.profile import allreduce_transfer_per_step

    # two decode steps of 3 all-reduces and a prefill; per call the least time over the two ranks is
    # 2, 2, 3 | 2, 40 (a preempted rank: both waited), 2 | prefill 9, 9, 9
    least = [2.0, 2.0, 3.0, 2.0, 40.0, 2.0, 9.0, 9.0, 9.0]
    rows = []
    for rank in (0, 1):
        for i, t in enumerate(least):
            rows.append({"category": "allreduce", "instance": i, "rank": rank, "step": i // 3,
                         "dur_us": t + (50.0 if rank == 0 else 0.0), "transfer_us": t})
    skew = pd.DataFrame(rows)
    steps = pd.DataFrame([{"rank": r, "step": s, "kind": "prefill" if s == 2 else "decode"}
                          for r in (0, 1) for s in range(3)])
    # median of 2, 2, 3, 2, 40, 2 = 2, x 3 calls per step; the preempted call is the host's, not the op's
    assert allreduce_transfer_per_step(skew, steps, "decode") == pytest.approx(6.0)
    assert allreduce_transfer_per_step(skew, steps, "prefill") == pytest.approx(27.0)
    assert allreduce_transfer_per_step(skew.iloc[0:0], steps, "decode") is None
