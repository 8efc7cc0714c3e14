import json

from decodescope.arch import (collective_schedule, expected_all_reduces_per_step, layer_all_reduces_per_step,
                              normalize_config)


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
    assert sum(c.count for c in layer) == 122 == layer_all_reduces_per_step(a, 8)
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
