"""Each collective instance split into arrival skew and transfer, worked by hand on small traces written
as torch.profiler writes them (a late rank; gloo's async all-reduce and its wait; a GPU symmetric-memory
barrier), and the fixes' bounds that free each part."""
import json
from pathlib import Path

import numpy as np
import pytest

from decodescope.trace.analyze import find_steps, op_table
from decodescope.critpath.split import collective_split, instance_class, split_summary
from decodescope.critpath.summary import fix_bounds
from decodescope.critpath.table import critical_paths
from decodescope.trace.load import load_trace_dir

T0 = 1_000_000.0  # a trace's clock starts anywhere
STEP = "execute_context_0(0)_generation_1(1)"  # vLLM's name of a decode step's range


def write_cpu_traces(tmp_path: Path, ranks: dict) -> Path:
    """ranks: rank -> [(name, start_us, end_us)] on its main thread; each rank's step range spans them."""
    for r, ops in ranks.items():
        pid = tid = 100 + r
        end = max(e for _, _, e in ops)
        ev = [{"ph": "X", "cat": "user_annotation", "name": STEP, "pid": pid, "tid": tid, "ts": T0, "dur": end}]
        ev += [{"ph": "X", "cat": "cpu_op", "name": n, "pid": pid, "tid": tid, "ts": T0 + s, "dur": e - s, "args": {}}
               for n, s, e in ops]
        doc = {"distributedInfo": {"backend": "gloo", "rank": r, "world_size": len(ranks)}, "traceEvents": ev}
        (tmp_path / f"host_rank{r}.{r}.pt.trace.json").write_text(json.dumps(doc))
    return tmp_path


def paths_of(d: Path):
    loaded = load_trace_dir(d)
    ops = op_table(loaded.events)
    return critical_paths(loaded.events, ops, find_steps(loaded.events, ops))


def test_a_late_rank_is_arrival_skew_and_the_rest_of_the_collective_its_transfer(tmp_path):
    # rank 0 enters the all-reduce at 10; rank 1 computes until 50: 40 us of skew, then 10 us of transfer
    cp = paths_of(write_cpu_traces(tmp_path, {
        0: [("aten::mm", 0, 10), ("_C::shm_allreduce", 10, 60), ("aten::add", 60, 70)],
        1: [("aten::mm", 0, 50), ("_C::shm_allreduce", 50, 60), ("aten::add", 60, 70)]}))
    s = collective_split(cp, "decode")
    assert len(s) == 1
    row = s.iloc[0]
    assert (row.category, row.late_rank, row.late_work) == ("allreduce", 1, "gemm")
    assert (row.skew_us, row.transfer_us, row.waited_us) == (40.0, 10.0, 40.0)
    assert row.instance_class == "skew-bound"
    # the path: rank 1's GEMM, the transfer, the add; the skew lies on it (the late rank's work)
    assert (row.transfer_on_path_us, row.skew_on_path_us) == (10.0, 40.0)
    b = fix_bounds(cp, "decode").set_index("category")
    assert b.loc["allreduce transfer", "bound_wall_us_median"] == 60.0   # 70 - the 10 us transfer
    assert b.loc["arrival skew", "bound_wall_us_median"] == 70.0         # rank 1's GEMM stays: nothing moves
    assert b.loc["gemm", "bound_wall_us_median"] == 20.0  # no GEMM: both in at 0, 10 of transfer, 10 of add


def test_gloos_async_all_reduce_and_its_wait_are_one_instance_and_freeing_its_transfer_frees_the_wait(tmp_path):
    # rank 0 issues at 10, returns at 12, does other work, waits from 20; rank 1 issues at 40, waits from 42;
    # the data is there at 60 on both: skew 30, transfer 20
    cp = paths_of(write_cpu_traces(tmp_path, {
        0: [("aten::mm", 0, 10), ("_c10d_functional::all_reduce_", 10, 12), ("aten::add", 12, 20),
            ("_c10d_functional::wait_tensor", 20, 60), ("aten::add", 60, 70)],
        1: [("aten::mm", 0, 40), ("_c10d_functional::all_reduce_", 40, 42),
            ("_c10d_functional::wait_tensor", 42, 60), ("aten::add", 60, 70)]}))
    s = collective_split(cp, "decode")
    assert len(s) == 1   # the wait is no instance of its own
    row = s.iloc[0]
    assert (row.category, row.late_rank, row.skew_us, row.transfer_us) == ("allreduce", 1, 30.0, 20.0)
    assert row.waited_us == 20.0 and row.instance_class == "mixed"   # rank 0 blocked in its wait from 20 to 40
    # on the path the wait counts as the all-reduce it waits for
    seg = cp.segments
    assert set(seg.loc[seg["segment"] == "transfer", "category"]) == {"allreduce"}
    b = fix_bounds(cp, "decode").set_index("category")
    # free transfer: both waits end at the last entry (40), the adds run 40-50
    assert b.loc["allreduce transfer", "bound_wall_us_median"] == 50.0
    # no skew: rank 0 would go on at 20 + its 20 us of transfer; rank 1's GEMM stays, so the step does too
    assert b.loc["arrival skew", "bound_wall_us_median"] == 70.0
    assert "collective_wait" not in b.index   # the wait has no bound of its own: it is the all-reduce's


def test_a_symmetric_memory_barrier_kernel_is_an_instance_every_rank_enters(tmp_path):
    for r, (gemm_end, launch) in enumerate(((10.0, 1), (45.0, 2))):
        pid, stream = 100 + r, 7
        ev = [{"ph": "X", "cat": "user_annotation", "name": STEP, "pid": pid, "tid": pid, "ts": T0 - 6, "dur": 60},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid, "ts": T0 - 5,
               "dur": 1, "args": {"correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid, "ts": T0 - 3,
               "dur": 1, "args": {"correlation": 2}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "pid": 0, "tid": stream,
               "ts": T0, "dur": gemm_end, "args": {"correlation": 1, "stream": stream, "device": r}},
              {"ph": "X", "cat": "kernel", "name": "void c10d::symmetric_memory::barrier_kernel<1>(...)", "pid": 0,
               "tid": stream, "ts": T0 + gemm_end, "dur": 50 - gemm_end, "args": {"correlation": 2,
                                                                                    "stream": stream, "device": r}}]
        doc = {"distributedInfo": {"backend": "nccl", "rank": r, "world_size": 2}, "traceEvents": ev,
               "deviceProperties": [{"id": r, "name": "NVIDIA H100 80GB HBM3"}]}
        (tmp_path / f"host_rank{r}.{r}.pt.trace.json").write_text(json.dumps(doc))
    cp = paths_of(tmp_path)
    s = collective_split(cp, "all")
    assert len(s) == 1
    row = s.iloc[0]
    assert (row.category, row.late_rank, row.skew_us, row.transfer_us) == ("collective_wait", 1, 35.0, 5.0)
    assert row.instance_class == "skew-bound"


@pytest.mark.parametrize("skew,transfer,cls", [(40, 10, "skew-bound"), (10, 40, "transfer-bound"),
                                               (30, 20, "mixed"), (0.5, 1.0, "inconclusive"),
                                               (20, 10, "skew-bound"), (10, 20, "transfer-bound")])
def test_an_instances_class_follows_the_thresholds_written_in_methods(skew, transfer, cls):
    assert instance_class(np.array([skew]), np.array([transfer]))[0] == cls


def test_the_summary_counts_a_step_without_an_instance_as_zero():
    import pandas as pd
    split = pd.DataFrame({"step": [0, 0, 1], "category": ["allreduce"] * 3, "group": [0, 1, 2],
                          "skew_us": [10.0, 20.0, 5.0], "transfer_us": [1.0, 1.0, 1.0], "waited_us": [1.0] * 3,
                          "skew_on_path_us": [10.0, 0.0, 5.0], "transfer_on_path_us": [1.0, 0.0, 1.0],
                          "instance_class": ["skew-bound"] * 3})
    got = split_summary(split, steps=4).iloc[0]   # steps 2 and 3 had none
    assert got.instances_per_step == 0.5 and got.skew_us_per_step == 2.5 and got.share_skew_bound == 1.0


def test_on_two_h200s_every_nccl_all_reduce_of_the_step_is_an_instance_and_freeing_its_transfer_moves_the_path():
    """The committed 2x H200 step replay (NCCL, CUDA graph): the step's 123 all-reduces (Kimi-shaped at TP=8's
    schedule, one rank pair) each an instance; the transfer on the path is what the transfer bound frees."""
    cp = paths_of(Path(__file__).parent / "fixtures" / "traces" / "h200x2_step_replay_graph")
    s = collective_split(cp, "decode")
    steps = s["step"].nunique()
    per_step = s[s["category"] == "allreduce_nccl"].groupby("step").size()
    assert steps == len(cp.windows) and (per_step == 123).all()
    summary = split_summary(s, steps).set_index("category").loc["allreduce_nccl"]
    assert summary.share_transfer_bound > 0.9   # NVLink pair, graph-replayed: the ranks arrive together
    wall = float(cp.windows["wall_us"].median())
    b = fix_bounds(cp, "decode").set_index("category")
    gain = b.loc["allreduce_nccl transfer", "gain_share_median"]
    on_path = summary.transfer_on_path_us_per_step / wall
    assert 0.5 * on_path <= gain <= on_path + 0.01   # frees about what the path holds of it, never more
