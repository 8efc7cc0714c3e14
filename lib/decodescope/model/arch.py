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

from decodescope.core.dtypes import INT4_GROUP_SIZE, bytes_per_element, element_bytes


def activation_bytes(dtype: str) -> int:
    """Bytes per element of an activation (what collectives move); int4 is a weight format only."""
    elt = element_bytes(dtype)
    if elt != elt:
        raise KeyError(f"{dtype!r} is not an activation dtype; use bf16, fp16, fp32 or fp8")
    return int(elt)


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
    elt = activation_bytes(dtype)
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
    calls.append(CollectiveCall("all_gather", "logits", 1, batch * vocab_shard * activation_bytes(logits_dtype),
                                logits_dtype))
    return calls


def schedule_frame(calls: list[CollectiveCall]) -> pd.DataFrame:
    return pd.DataFrame([asdict(c) for c in calls],
                        columns=["op", "where", "count", "msg_bytes", "dtype"])


def expected_all_reduces_per_step(arch: ArchConfig, tp: int) -> int:
    return sum(c.count for c in collective_schedule(arch, tp) if c.op == "all_reduce")


# ---- GEMM shapes, bytes and FLOPs of a decode step -------------------------------------------------
@dataclass(frozen=True)
class GemmShape:
    op: str            # e.g. qkv_proj, o_proj, moe_w13
    layer_kind: str    # attention | dense_mlp | moe_expert | shared_expert | router | lm_head
    m: int             # tokens (rows of the activation)
    n: int             # output features on this rank
    k: int             # input features on this rank
    count: int         # calls per decode step on one rank
    sharding: str      # column | row | replicated | expert
    groups: int = 1    # experts in one grouped call (fused MoE kernels run all hit experts at once)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count * self.groups


def active_experts(batch: int, top_k: int, experts: int, skew: float = 0.0) -> float:
    """Expected distinct experts hit by batch x top_k uniform picks; `skew` in [0, 1) shrinks the
    set towards top_k (all tokens choosing the same experts at skew -> 1)."""
    if not experts:
        return 0.0
    picks = batch * top_k
    uniform = experts * (1.0 - (1.0 - 1.0 / experts) ** picks)
    return max(float(min(top_k, experts)), uniform * (1.0 - skew) + min(top_k, experts) * skew)


def gemm_shapes(arch: ArchConfig, tp: int, batch: int, ep: int = 1, skew: float = 0.0) -> list[GemmShape]:
    """Every GEMM of one decode step on one rank, after tensor (and expert) parallel sharding."""
    b, h = batch, arch.hidden_size
    shapes: list[GemmShape] = []
    L = arch.num_layers
    heads = arch.num_attention_heads // tp
    if arch.uses_mla:
        nope, rope, v = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        kv_lora = arch.kv_lora_rank
        # an MLA config without these dims already failed below (None in `+`/`*` raised TypeError)
        assert nope is not None and rope is not None and v is not None and kv_lora is not None
        if arch.q_lora_rank:
            shapes.append(GemmShape("fused_qkv_a_proj", "attention", b, arch.q_lora_rank + kv_lora + rope, h, L, "replicated"))
            shapes.append(GemmShape("q_b_proj", "attention", b, heads * (nope + rope), arch.q_lora_rank, L, "column"))
        else:
            shapes.append(GemmShape("q_proj", "attention", b, heads * (nope + rope), h, L, "column"))
            shapes.append(GemmShape("kv_a_proj", "attention", b, kv_lora + rope, h, L, "replicated"))
        # absorbed MLA decode: q_nope x W_UK and the attention output x W_UV, each one batched GEMM over
        # the rank's heads per layer (vLLM's MLA decode: torch.bmm over heads), not a call per head
        shapes.append(GemmShape("mla_w_uk", "attention", b, kv_lora, nope, L, "column", heads))
        shapes.append(GemmShape("mla_w_uv", "attention", b, v, kv_lora, L, "column", heads))
        shapes.append(GemmShape("o_proj", "attention", b, h, heads * v, L, "row"))
    else:
        kv = max(1, arch.num_key_value_heads // tp)
        d = arch.head_dim
        shapes.append(GemmShape("qkv_proj", "attention", b, (heads + 2 * kv) * d, h, L, "column"))
        shapes.append(GemmShape("o_proj", "attention", b, h, heads * d, L, "row"))
    dense = L - arch.moe_layers
    if dense:
        inter = arch.intermediate_size // tp
        shapes.append(GemmShape("gate_up_proj", "dense_mlp", b, 2 * inter, h, dense, "column"))
        shapes.append(GemmShape("down_proj", "dense_mlp", b, h, inter, dense, "row"))
    if arch.moe_layers:
        E, k = arch.num_experts, arch.top_k
        moe_tp = 1 if ep > 1 else tp
        inter = arch.moe_intermediate_size // moe_tp
        tokens_on_rank = b  # with EP every rank sees all tokens' routes
        experts_here = E // ep
        hit = active_experts(tokens_on_rank, k, E, skew) * experts_here / E
        per_expert = max(1, round(tokens_on_rank * k / max(active_experts(tokens_on_rank, k, E, skew), 1.0)))
        n_hit = max(1, round(hit))
        shapes.append(GemmShape("router", "router", b, E, h, arch.moe_layers, "replicated"))
        shapes.append(GemmShape("moe_w13", "moe_expert", per_expert, 2 * inter, h, arch.moe_layers, "expert", n_hit))
        shapes.append(GemmShape("moe_w2", "moe_expert", per_expert, h, inter, arch.moe_layers, "expert", n_hit))
        if arch.num_shared_experts:
            sh = arch.moe_intermediate_size * arch.num_shared_experts // tp
            shapes.append(GemmShape("shared_gate_up", "shared_expert", b, 2 * sh, h, arch.moe_layers, "column"))
            shapes.append(GemmShape("shared_down", "shared_expert", b, h, sh, arch.moe_layers, "row"))
    shapes.append(GemmShape("lm_head", "lm_head", b, -(-arch.vocab_size // tp), h, 1, "column"))
    return shapes


# the layer kinds a quantized checkpoint stores in model.weight_dtype (routed experts, as in Kimi-K2.5 INT4,
# whose attention, shared experts and dense MLP stay bf16); the rest are bf16
QUANTIZED_KINDS = ("moe_expert",)


def weight_bytes_per_step(shapes: list[GemmShape], weight_dtype: str = "bf16", group_size: int = INT4_GROUP_SIZE,
                          quantized_kinds: tuple[str, ...] = QUANTIZED_KINDS) -> dict:
    """Weight bytes one rank reads per decode step, split by dtype: `weight_dtype` for the layer kinds
    that are quantized (routed experts by default, as in Kimi-K2.5 INT4), bf16 for the rest."""
    out: dict[str, float] = {}
    for s in shapes:
        dt = weight_dtype if s.layer_kind in quantized_kinds else "bf16"
        out[dt] = out.get(dt, 0.0) + s.n * s.k * s.count * s.groups * bytes_per_element(dt, group_size)
    out["total"] = sum(out.values())
    return out


def kv_cache_bytes_per_step(arch: ArchConfig, tp: int, batch: int, context: int, kv_dtype: str = "bf16") -> float:
    """KV-cache bytes one rank reads per decode step (every layer reads the whole context)."""
    elt = activation_bytes(kv_dtype)
    if arch.uses_mla:  # the latent cache is replicated on every rank
        # an MLA config without these dims already failed here (None in `+` raised TypeError)
        assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
        per_token_layer = (arch.kv_lora_rank + arch.qk_rope_head_dim) * elt
    else:
        per_token_layer = 2 * max(1, arch.num_key_value_heads // tp) * arch.head_dim * elt
    return float(per_token_layer * arch.num_layers * context * batch)


def all_to_all_bytes(arch: ArchConfig, ep: int, tokens_per_gpu: int, dtype: str = "bf16") -> dict:
    """Expert-parallel dispatch/combine per MoE layer and rank: each token goes to top_k experts, of
    which (ep-1)/ep live on other ranks on average."""
    elt = activation_bytes(dtype)
    sent = tokens_per_gpu * arch.top_k * arch.hidden_size * elt * (ep - 1) / ep if ep > 1 else 0.0
    return {"dispatch_bytes": sent, "combine_bytes": sent, "layers": arch.moe_layers,
            "per_step_bytes": 2 * sent * arch.moe_layers}


# ---- one decode step in model order (for the step replay probe) ------------------------------------
_LAYER_PARTS = {"attention": ("attention",), "dense": ("dense_mlp",), "moe": ("router", "moe_expert", "shared_expert")}


def step_program(arch: ArchConfig, tp: int, batch: int, ep: int = 1, skew: float = 0.0,
                 dtype: str = "bf16") -> list[dict]:
    """One rank's decode step as the ordered list of what it runs: per layer the attention GEMMs, the
    attention all-reduce, the MLP or MoE GEMMs (router, grouped experts, shared experts), the MLP/MoE
    all-reduce; the embedding all-reduce first, lm_head and the logits gather last. Built from
    gemm_shapes and collective_schedule, so it is the same step the micro-benchmarks measure in pieces.
    Each item: {"kind": "gemm", op, m, n, k, groups} or {"kind": "all_reduce"|"all_gather", where, msg_bytes}."""
    shapes = gemm_shapes(arch, tp, batch, ep, skew)
    calls = {c.where: c for c in collective_schedule(arch, tp, batch, dtype)}
    moe_layers = arch.moe_layers
    dense_layers = arch.num_layers - moe_layers

    def per_layer(kinds: tuple[str, ...], layers: int) -> list[dict]:
        out = []
        for s in shapes:
            if s.layer_kind in kinds and layers:
                # count is over the whole step: per layer count / layers calls, each as gemm_shapes (and
                # so the GEMM probe) accounts for it (e.g. MLA's per-head products as separate calls)
                for _ in range(max(1, s.count // layers)):
                    out.append({"kind": "gemm", "op": s.op, "m": s.m, "n": s.n, "k": s.k, "groups": s.groups})
        return out

    def coll(where: str) -> list[dict]:
        c = calls.get(where)
        return [{"kind": c.op, "where": where, "msg_bytes": c.msg_bytes}] if c and tp > 1 else []

    program = coll("embedding")
    attention = per_layer(_LAYER_PARTS["attention"], arch.num_layers)
    dense = per_layer(_LAYER_PARTS["dense"], dense_layers)
    moe = per_layer(_LAYER_PARTS["moe"], moe_layers)
    for layer in range(arch.num_layers):
        is_moe = layer >= dense_layers if moe_layers else False
        program += attention + coll("attention_out")
        program += (moe + coll("moe_out")) if is_moe else (dense + coll("mlp_out"))
    program += [{"kind": "gemm", "op": s.op, "m": s.m, "n": s.n, "k": s.k, "groups": 1}
                for s in shapes if s.layer_kind == "lm_head"]
    program += coll("logits")
    return program
