"""verdict.graphless: the host time a step pays for the ops its CUDA graphs no longer cover, priced from the
baseline's un-graphed capture (04), the profiler's cost per recorded event taken off."""
import pytest

from decodescope.engines.vllm_log import engine_modes
from decodescope.schema.records import HostOpRow, HostOps, ProfileCapture
from decodescope.verdict import graphless, stepmodel as sm
from decodescope.verdict.stepparts import eager_walk

ATTN, KV, MOE = ("vllm::unified_mla_attention_with_output", "vllm::unified_mla_kv_cache_update",
                 "vllm::moe_forward_shared")


def _ops(events_per_step=250.0) -> HostOps:
    return HostOps(prompt_tokens=1024, step_tokens=1024, prefill_steps=1, decode_steps=7,
                   decode_events_per_step=events_per_step, ops=[
                       HostOpRow(name=ATTN, calls_per_step=10, host_us_per_call=330.0, wait_us_per_call=0.0,
                                 events_per_call=45.0, launches_per_call=4.0),
                       HostOpRow(name=KV, calls_per_step=10, host_us_per_call=60.0, wait_us_per_call=0.0,
                                 events_per_call=6.0, launches_per_call=1.0),
                       HostOpRow(name=MOE, calls_per_step=9, host_us_per_call=1000.0, wait_us_per_call=40.0,
                                 events_per_call=100.0, launches_per_call=20.0)])


def test_the_profilers_cost_per_event_is_level_ones_step_cost_over_its_events():
    caps = {1: ProfileCapture(profiler_step_cost_us=750.0, profiler_event_cost_us=1.2)}
    per_event, how = graphless.profiler_us_per_event(_ops(250.0), caps)
    assert per_event == pytest.approx(3.0) and "250 events" in how
    # no level-1 cost (or a negative one, noise): the bare op's cost, a floor
    caps = {1: ProfileCapture(profiler_step_cost_us=-40.0, profiler_event_cost_us=1.2)}
    assert graphless.profiler_us_per_event(_ops(), caps)[0] == pytest.approx(1.2)
    assert graphless.profiler_us_per_event(None, {})[0] is None


def test_a_piecewise_step_walks_pieces_and_splitting_ops_layer_by_layer():
    items, notes = graphless.piecewise_items(_ops(), 3.0, (ATTN, KV, "vllm::unified_attention_with_output"),
                                             call_us=20.0, gpu_us=2200.0, attention_gpu_us=200.0)
    # ten layers of (piece, attention, KV update) and a last piece; the MoE op stays inside the pieces
    assert len(items) == 10 * 3 + 1
    assert sum(h for h, _ in items) == pytest.approx(11 * 20 + 10 * (330 - 45 * 3) + 10 * (60 - 6 * 3))
    assert sum(g for _, g in items) == pytest.approx(2200.0)
    assert items[1] == (pytest.approx(330 - 135), pytest.approx(20.0))   # an attention op, its GPU share
    comp = graphless.piecewise_component(items, notes, 2200.0, 1024, "given", 3.0)
    end = eager_walk(items)[0]
    assert comp.name == sm.OUTSIDE_GRAPH and comp.us == pytest.approx(end - 2200.0) and comp.us > 0
    # a log without a config line: vLLM's attention ops; no splitting op in the capture: nothing to walk
    assert graphless.piecewise_items(_ops(), 3.0, (), 20.0, 2200.0, 200.0)[0] == items
    assert graphless.piecewise_items(_ops(), 3.0, ("vllm::mamba_mixer2",), 20.0, 2200.0, 200.0) == ([], [])


def test_a_gpu_bound_piecewise_step_hides_the_hosts_ops_but_the_first_launch():
    items, notes = graphless.piecewise_items(_ops(), 3.0, (ATTN, KV), 20.0, 50_000.0, 200.0)
    assert graphless.piecewise_component(items, notes, 50_000.0, 1024, "given", 3.0).us == pytest.approx(20.0)


def test_the_host_op_component_lands_inside_the_step_and_its_period():
    items, notes = graphless.piecewise_items(_ops(), 0.0, (ATTN,), 0.0, 0.0, 0.0)
    comp = graphless.piecewise_component(items, notes, 0.0, 1024, "given", 0.0)
    base = sm.StepPrediction(1.0, [sm.Component("gemm", 1000.0, 1000.0, 1000.0, "02")], 1.0)
    pred = sm.StepPrediction(1.0, base.components + [comp], 1.0)
    assert comp.us == pytest.approx(3300.0)
    assert pred.wall_us == pytest.approx(4300.0) and pred.period_us == pytest.approx(4300.0)
    # synchronous scheduling: the host's 700 us between steps less the 200 us the GPU already sat idle a step
    lost = graphless.lost_async_component(700.0, 200.0, "04")
    assert (lost.us, lost.low_us, lost.high_us) == (500.0, 500.0, 700.0)
    assert sm.StepPrediction(1.0, pred.components + [lost], 1.0).period_us == pytest.approx(4800.0)
    assert graphless.lost_async_component(700.0, 900.0, "04").us == 0.0   # the base step was the host's already
    assert graphless.lost_async_component(None, 0.0, "04") is None


def test_an_eager_step_issues_the_custom_ops_then_the_other_kernels_at_a_bare_call():
    items, notes = graphless.eager_items(_ops(), 3.0, kernels_per_step=299, call_us=8.0, gpu_us=2200.0)
    inside = 10 * 4 + 10 * 1 + 9 * 20
    assert len(items) == 10 + 10 + 9 + (299 - inside)
    host = sum(h for h, _ in items)
    assert host == pytest.approx(10 * 195 + 10 * 42 + 9 * 700 + (299 - inside) * 8.0)
    assert sum(g for _, g in items) == pytest.approx(2200.0)
    end, issued = eager_walk(items)
    assert end >= issued == pytest.approx(host)
    assert any("more kernels" in n for n in notes)


def test_the_engine_log_names_the_splitting_ops():
    line = ("(EngineCore pid=1) INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: model='m', "
            "enforce_eager=False, compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'splitting_ops': "
            f"['{ATTN}', '{KV}'], 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}}")
    assert engine_modes(line)[0].splitting_ops == (ATTN, KV)
    assert engine_modes(line.replace("'splitting_ops'", "'other'"))[0].splitting_ops == ()
