"""Model architecture -> what one decode step does at tensor-parallel t: its collective schedule.

Configs are HF config.json dicts (Llama, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, Kimi-K2/K2.5 with
its `text_config`). The schedule mirrors vLLM's model code:
- VocabParallelEmbedding all-reduces its output once per step (tp > 1);
- each decoder layer all-reduces twice: after the attention output projection (RowParallelLinear)
  and after the MLP / MoE block (down projection or the experts' combined output);
- the logits of ParallelLMHead are gathered across ranks (LogitsProcessor).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import pandas as pd

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0            # routed experts; 0 for dense models
    top_k: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0     # DeepSeek's first_k_dense_replace
    uses_mla: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    tie_word_embeddings: bool = False

    @property
    def moe_layers(self) -> int:
        return 0 if not self.num_experts else self.num_layers - self.first_dense_layers

    def to_dict(self) -> dict:
        return asdict(self)


def normalize_config(config: dict) -> ArchConfig:
    """One flat description from the several HF spellings. Multimodal wrappers (Kimi-K2.5) keep the
    language model under `text_config`."""
    cfg = dict(config.get("text_config") or config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "unknown")
    heads = int(cfg.get("num_attention_heads", 0))
    hidden = int(cfg.get("hidden_size", 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or (2 if experts and "mixtral" in model_type else 0))
    uses_mla = cfg.get("kv_lora_rank") is not None
    return ArchConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(cfg.get("num_hidden_layers", 0)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        vocab_size=int(cfg.get("vocab_size", 0)),
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if experts else 0)),
        num_shared_experts=int(cfg.get("n_shared_experts") or (1 if cfg.get("shared_expert_intermediate_size") else 0)),
        first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        uses_mla=uses_mla,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        v_head_dim=cfg.get("v_head_dim"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class CollectiveCall:
    op: str            # all_reduce | all_gather | gather
    where: str         # embedding | attention_out | mlp_out | moe_out | logits
    count: int         # calls per decode step
    msg_bytes: int     # per-rank input bytes of one call
    dtype: str


def collective_schedule(arch: ArchConfig, tp: int, batch: int = 1, dtype: str = "bf16",
                        logits_dtype: str = "bf16") -> list[CollectiveCall]:
    """The collectives of one decode step (batch = sequences decoded together, one token each)."""
    if tp <= 1:
        return []
    elt = DTYPE_BYTES[dtype]
    act_bytes = batch * arch.hidden_size * elt
    dense_layers = arch.num_layers - arch.moe_layers
    calls = [
        CollectiveCall("all_reduce", "embedding", 1, act_bytes, dtype),
        CollectiveCall("all_reduce", "attention_out", arch.num_layers, act_bytes, dtype),
    ]
    if dense_layers:
        calls.append(CollectiveCall("all_reduce", "mlp_out", dense_layers, act_bytes, dtype))
    if arch.moe_layers:
        calls.append(CollectiveCall("all_reduce", "moe_out", arch.moe_layers, act_bytes, dtype))
    vocab_shard = -(-arch.vocab_size // tp)
    calls.append(CollectiveCall("all_gather", "logits", 1, batch * vocab_shard * DTYPE_BYTES[logits_dtype],
                                logits_dtype))
    return calls


def schedule_frame(calls: list[CollectiveCall]) -> pd.DataFrame:
    return pd.DataFrame([asdict(c) for c in calls],
                        columns=["op", "where", "count", "msg_bytes", "dtype"])


def layer_all_reduces_per_step(arch: ArchConfig, tp: int) -> int:
    """The all-reduces that decoder layers issue per step: the mission's '61 layers x 2 = 122'."""
    return 0 if tp <= 1 else 2 * arch.num_layers


def expected_all_reduces_per_step(arch: ArchConfig, tp: int) -> int:
    return sum(c.count for c in collective_schedule(arch, tp) if c.op == "all_reduce")
