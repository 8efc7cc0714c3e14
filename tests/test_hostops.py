"""trace.hostops: the host's cost of the custom ops a CUDA graph hides, from the un-graphed capture's trace."""
import gzip
import json
from pathlib import Path

import pytest

from decodescope.schema.records import HostOps, read_record, write_record
from decodescope.engines.vllm_log import EngineModes
from decodescope.trace.hostops import host_op_costs, host_ops_wanted, outer_custom_ops, read_host_events

FIXTURE = Path(__file__).parent / "fixtures" / "traces" / "vllm_gpu_h200_kimi_int4_c64"


def _x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace(tmp_path: Path) -> Path:
    """A prefill step of 1,024 tokens running two MoE layers' custom ops on the host, then three decode steps."""
    ev = [_x("user_annotation", "execute_context_1(1024)_generation_0(0)", 0, 3000)]
    for layer, t0 in enumerate((100, 1500)):
        # the MoE op holds an inner custom op (not outermost), a launch and a synchronizing copy that waits 200 us
        ev += [_x("cpu_op", "vllm::moe_forward_shared", t0, 1000),
               _x("cpu_op", "vllm::inner_helper", t0 + 10, 50),
               _x("cpu_op", "aten::empty", t0 + 70, 5),
               _x("cuda_runtime", "cudaLaunchKernel", t0 + 100, 5),
               _x("cuda_runtime", "cudaMemcpyAsync", t0 + 300, 200),
               _x("cpu_op", "vllm::unified_mla_attention_with_output", t0 + 1100, 300),
               _x("cuda_runtime", "cudaLaunchKernel", t0 + 1200, 5)]
    # the same op on another thread is a call of its own
    ev.append(_x("cpu_op", "vllm::moe_forward_shared", 2000, 100, tid=2))
    for i in range(3):
        t0 = 4000 + 1000 * i
        ev += [_x("user_annotation", "execute_context_0(0)_generation_1(1)", t0, 500),
               _x("cuda_runtime", "cudaGraphLaunch", t0 + 10, 20), _x("cpu_op", "aten::copy_", t0 + 40, 5)]
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev + [{"ph": "i", "name": "instant", "ts": 1}]}, f)
    return path


def test_outer_custom_ops_take_off_waits_and_count_what_is_inside(tmp_path):
    calls = outer_custom_ops(read_host_events(_trace(tmp_path)))
    moe = calls[(calls["name"] == "vllm::moe_forward_shared") & (calls["tid"] == "1")]
    assert len(moe) == 2 and "vllm::inner_helper" not in set(calls["name"])
    assert moe["wait_us"].tolist() == [200.0, 200.0]
    # inside: the inner op, aten::empty, the launch and the copy
    assert moe["events"].tolist() == [4, 4] and moe["launches"].tolist() == [1, 1]
    assert len(calls[calls["tid"] == "2"]) == 1


def test_host_op_costs_price_the_longest_prefill_step(tmp_path):
    costs = host_op_costs(read_host_events(_trace(tmp_path)), prompt_tokens=1024)
    by = {r.name: r for r in costs.ops}
    assert costs.step_tokens == 1024 and costs.prefill_steps == 1 and costs.decode_steps == 3
    # the other thread's call falls in the step as well: three calls, median wall 1000 less median wait 200
    assert by["vllm::moe_forward_shared"].calls_per_step == 3
    assert by["vllm::moe_forward_shared"].host_us_per_call == pytest.approx(800.0)
    assert by["vllm::unified_mla_attention_with_output"].calls_per_step == 2
    assert by["vllm::unified_mla_attention_with_output"].host_us_per_call == pytest.approx(300.0)
    assert by["vllm::unified_mla_attention_with_output"].launches_per_call == 1
    # two events (graph launch and copy) from one decode step's start to the next
    assert costs.decode_events_per_step == 2.0
    write_record(tmp_path / "host_ops.json", costs)
    assert read_record(tmp_path / "host_ops.json", HostOps) == costs


def test_a_real_gpu_trace_prices_the_attention_its_piecewise_prefill_ran_on_the_host():
    """The Kimi-shaped 4-layer H200 trace at concurrency 64: its one prefill step (16 tokens) ran piecewise
    CUDA graphs, so the MLA attention and KV-cache ops ran on the host there, four layers of each."""
    costs = host_op_costs(read_host_events(next(FIXTURE.glob("*rank0*.pt.trace.json.gz"))))
    by = {r.name: r for r in costs.ops}
    assert set(by) == {"vllm::unified_mla_attention_with_output", "vllm::unified_mla_kv_cache_update"}
    assert all(r.calls_per_step == 4 for r in costs.ops)
    assert 100 < by["vllm::unified_mla_attention_with_output"].host_us_per_call < 2000
    assert by["vllm::unified_mla_attention_with_output"].launches_per_call >= 1
    assert costs.decode_steps > 10 and costs.decode_events_per_step > 50


def test_the_capture_is_taken_where_graphs_hide_ops_or_where_it_is_asked_for():
    def modes(cudagraph_mode):
        return EngineModes(vllm_version="0.26.0", cudagraph_mode=cudagraph_mode, compilation_mode=None,
                           enforce_eager=None)

    assert host_ops_wanted(False, modes("FULL_AND_PIECEWISE")) == (True, "")
    assert host_ops_wanted(False, None)[0]                   # an attached server: no log, modes unknown
    skip, why = host_ops_wanted(False, modes("NONE"))        # vLLM CPU, or --enforce-eager
    assert not skip and "no CUDA graphs" in why and "host_ops_tokens" in why
    assert not host_ops_wanted(False, modes(None))[0]        # vLLM CPU's log names no graph mode
    assert host_ops_wanted(True, modes("NONE"))[0]
