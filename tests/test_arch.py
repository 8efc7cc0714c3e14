import json

import numpy as np
import pandas as pd
import pytest

from decodescope.model.arch import collective_schedule, expected_all_reduces_per_step, normalize_config


def _cfg(repo, name):
    return json.loads((repo / "params/models" / name).read_text())


def test_kimi_k25_reads_text_config(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    assert (a.hidden_size, a.num_layers, a.num_experts, a.top_k) == (7168, 61, 384, 8)
    assert a.uses_mla and a.first_dense_layers == 1 and a.moe_layers == 60


def test_kimi_k25_tp8_batch1_has_122_layer_allreduces_of_14336_bytes(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    calls = collective_schedule(a, tp=8, batch=1, dtype="bf16")
    layer = [c for c in calls if c.op == "all_reduce" and c.where != "embedding"]
    assert sum(c.count for c in layer) == 122 == 2 * a.num_layers   # the mission's '61 layers x 2 = 122'
    assert {c.msg_bytes for c in layer} == {14336}
    # attention out on all 61 layers, dense MLP on layer 0, MoE on the other 60
    assert {c.where: c.count for c in layer} == {"attention_out": 61, "mlp_out": 1, "moe_out": 60}
    emb = [c for c in calls if c.where == "embedding"]
    assert len(emb) == 1 and emb[0].count == 1 and emb[0].msg_bytes == 14336
    logits = [c for c in calls if c.where == "logits"]
    assert logits[0].op == "all_gather" and logits[0].msg_bytes == 163840 // 8 * 2
    assert expected_all_reduces_per_step(a, 8) == 123


def test_schedule_scales_with_batch(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    calls = collective_schedule(a, tp=8, batch=32)
    assert {c.msg_bytes for c in calls if c.op == "all_reduce"} == {32 * 14336}


def test_tiny_qwen3_moe_at_tp2_expects_9_allreduces(repo):
    a = normalize_config(_cfg(repo, "tiny-qwen3-moe.json"))
    assert a.num_experts == 16 and a.top_k == 4 and a.head_dim == 64
    assert expected_all_reduces_per_step(a, 2) == 1 + 2 * 4


def test_no_collectives_without_tensor_parallelism(repo):
    a = normalize_config(_cfg(repo, "tiny-qwen3-moe.json"))
    assert collective_schedule(a, tp=1) == []


def test_llama_style_dense_config():
    llama70b = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}
    a = normalize_config(llama70b)
    calls = collective_schedule(a, tp=4, batch=1)
    assert {c.where: c.count for c in calls if c.op == "all_reduce"} == {"embedding": 1, "attention_out": 80,
                                                                         "mlp_out": 80}
    assert {c.msg_bytes for c in calls if c.op == "all_reduce"} == {16384}


# ---- GEMM shapes, bytes, FLOPs (issue: micro-benchmarks) -------------------------------------------
from decodescope.model.arch import (active_experts, all_to_all_bytes, gemm_shapes,  # noqa: E402
                                    kv_cache_bytes_per_step, weight_bytes_per_step)

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}


def _by_op(shapes):
    return {s.op: (s.m, s.n, s.k, s.count * s.groups) for s in shapes}


def test_kimi_tp8_gemm_shapes_by_hand(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    ops = _by_op(gemm_shapes(a, tp=8, batch=1))
    assert ops["fused_qkv_a_proj"] == (1, 1536 + 512 + 64, 7168, 61)   # replicated
    assert ops["q_b_proj"] == (1, 8 * (128 + 64), 1536, 61)
    assert ops["o_proj"] == (1, 7168, 8 * 128, 61)
    assert ops["gate_up_proj"] == (1, 2 * 18432 // 8, 7168, 1)          # first_k_dense_replace = 1
    assert ops["down_proj"] == (1, 7168, 18432 // 8, 1)
    assert ops["moe_w13"] == (1, 2 * 2048 // 8, 7168, 8 * 60)           # 8 experts hit at batch 1
    assert ops["moe_w2"] == (1, 7168, 2048 // 8, 8 * 60)
    assert ops["shared_gate_up"] == (1, 512, 7168, 60)
    assert ops["router"] == (1, 384, 7168, 60)
    assert ops["lm_head"] == (1, 163840 // 8, 7168, 1)


def test_kimi_int4_expert_weight_bytes_by_hand(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    wb = weight_bytes_per_step(gemm_shapes(a, 8, 1), "int4", group_size=32)
    per_expert_elems = 512 * 7168 + 7168 * 256
    assert wb["int4"] == pytest.approx(per_expert_elems * 480 * (0.5 + 2 / 32))


def test_llama70b_tp4_shapes_flops_and_kv_bytes_by_hand():
    a = normalize_config(LLAMA_70B)
    shapes = gemm_shapes(a, tp=4, batch=1)
    ops = _by_op(shapes)
    assert ops["qkv_proj"] == (1, (16 + 2 * 2) * 128, 8192, 80)
    assert ops["o_proj"] == (1, 8192, 2048, 80)
    assert ops["gate_up_proj"] == (1, 14336, 8192, 80)
    assert ops["down_proj"] == (1, 8192, 7168, 80)
    assert ops["lm_head"] == (1, 32064, 8192, 1)
    expected = 2 * 80 * (2560 * 8192 + 8192 * 2048 + 14336 * 8192 + 8192 * 7168) + 2 * 32064 * 8192
    assert sum(s.flops for s in shapes) == expected
    assert kv_cache_bytes_per_step(a, tp=4, batch=1, context=1024) == 2 * 2 * 128 * 2 * 80 * 1024
    assert weight_bytes_per_step(shapes, "bf16")["total"] == expected / 2 * 2  # bf16: 2 bytes per FLOP pair


def test_active_experts_and_skew():
    assert active_experts(1, 8, 384) == pytest.approx(8, rel=0.01)
    assert active_experts(256, 8, 384) > 370
    assert active_experts(256, 8, 384, skew=1.0) == 8




def test_all_to_all_volumes():
    a = normalize_config({"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 10,
                          "num_attention_heads": 32, "num_experts": 64, "num_experts_per_tok": 8,
                          "vocab_size": 1000, "intermediate_size": 1000, "moe_intermediate_size": 512})
    v = all_to_all_bytes(a, ep=8, tokens_per_gpu=16)
    assert v["dispatch_bytes"] == 16 * 8 * 4096 * 2 * 7 / 8
    assert all_to_all_bytes(a, ep=1, tokens_per_gpu=16)["dispatch_bytes"] == 0


# ---- one dtype table (decodescope.core.dtypes) ------------------------------------------------------------
def test_dtype_bytes_one_table_for_params_torch_and_trace_names():
    from decodescope.core import dtypes

    for name in ("bf16", "bfloat16", "BFloat16", "torch.bfloat16", "fp16", "Half", "float16"):
        assert dtypes.element_bytes(name) == 2 == dtypes.bytes_per_element(name), name
    for name, size in (("fp32", 4), ("Float", 4), ("float", 4), ("fp8", 1), ("Float8_e4m3fn", 1), ("Long", 8),
                       ("Int", 4), ("Byte", 1), ("Char", 1), ("Double", 8)):
        assert dtypes.element_bytes(name) == size, name
    # unknown or missing names (a trace may record anything) are NaN, not an error
    assert np.isnan(dtypes.element_bytes("ComplexFloat")) and np.isnan(dtypes.element_bytes(None))
    with pytest.raises(KeyError, match="unknown dtype"):
        dtypes.bytes_per_element("fp5")


def test_int4_bytes_count_the_packed_weight_and_one_16bit_scale_per_group():
    from decodescope.core import dtypes

    assert dtypes.bytes_per_element("int4") == 0.5 + 2 / 32          # default group: Kimi-K2.5 INT4
    assert dtypes.bytes_per_element("int4", group_size=128) == 0.5 + 2 / 128
    assert np.isnan(dtypes.element_bytes("int4"))                   # its size depends on the grouping
    from decodescope.model.arch import activation_bytes

    with pytest.raises(KeyError, match="not an activation dtype"):
        activation_bytes("int4")


def test_trace_message_bytes_use_the_dtype_table():
    from decodescope.trace.analyze import _msg_bytes

    ops = pd.DataFrame({"in_nelems": [1024, 1024, -1, 8], "coll_dtype": ["BFloat16", "Float", "Half", "Mystery"]})
    assert _msg_bytes(ops).tolist()[:2] == [2048.0, 4096.0]
    assert np.isnan(_msg_bytes(ops).tolist()[2:]).all()


def test_expert_parallel_routes_every_token_on_every_rank(repo):
    a = normalize_config(_cfg(repo, "kimi-k2.5.json"))
    moe = {s.op: s for s in gemm_shapes(a, tp=8, batch=16, ep=8)}
    one = {s.op: s for s in gemm_shapes(a, tp=8, batch=16, ep=1)}
    assert moe["moe_w13"].m == one["moe_w13"].m                      # tokens per expert as without EP
    assert moe["moe_w13"].n == 2 * 2048 and one["moe_w13"].n == 2 * 2048 // 8  # experts not TP-sharded under EP


def test_the_late_rank_reads_what_a_step_reads_between_two_all_reduces(repo):
    """03's late_rank timing reads, before each call, the weight bytes one rank reads between two of a
    batch-1 step's all-reduces (issue 25: a fixed 2 MiB write, this host's whole L2, made the figure jump
    between ~2 and ~8 us per size while the profiled engine paid 2.3 us per call)."""
    from decodescope.model import arch as archmod
    from decodescope.micro import bench as mb
    from decodescope.schema.params import load_params
    from decodescope.probes import collectives

    params = load_params(repo / "params/default.yaml")
    plan = mb.collectives_plan(params)
    arch = normalize_config(params.model_config_dict())
    weights = archmod.weight_bytes_per_step(archmod.gemm_shapes(arch, 2, 1))["total"]
    assert archmod.expected_all_reduces_per_step(arch, 2) == 9          # 1 + 2 x 4 layers
    assert plan["between_calls_bytes"] == int(weights / 9) == 294_912  # 2,654,208 B per step on each rank
    collectives._SCRATCH.clear()
    collectives._read_between_calls(0)                                   # nothing to read: no buffer made
    assert collectives._SCRATCH == []
    collectives._read_between_calls(4096)
    assert len(collectives._SCRATCH[0]) == 4096 and set(collectives._SCRATCH[0]) == {1}
