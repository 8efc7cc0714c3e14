"""The GEMM probe's kernels (decodescope.probes.gemm times them): torch's matmul at a shape, the kernels
vLLM's CPU build runs (its linear dispatch, its fused MoE), and vLLM's Marlin W4A16 GEMM and MoE on GPUs.
Each builder returns a callable, or None / a reason when this host's torch or vLLM lacks the kernel."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from decodescope.core.dtypes import INT4_GROUP_SIZE, bytes_per_element

FP8_MIN_DIM = 16
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# int4 weights' group size in the W4A16 probe: the one whose scales dtypes.bytes_per_element counts
MARLIN_GROUP = INT4_GROUP_SIZE


def _vllm_cpu_linear(m: int, n: int, k: int, dt: torch.dtype) -> Optional[Callable]:
    """The linear vLLM's CPU build runs for an unquantized [n, k] weight (its own dispatch: oneDNN with a
    prepacked weight, or sgl's packed kernel for small weights), or None when vllm is not importable."""
    try:
        # vllm: the cpu/gpu extras only; without it this says so instead of failing the import
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except Exception:
        return None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k, dtype=dt), requires_grad=False)
    a = torch.randn(m, k, dtype=dt)
    try:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        # cpu_linear: the function the dispatch just set; nn.Module's __getattr__ is typed Tensor | Module
        layer.cpu_linear(a, layer.weight, None)  # type: ignore[operator]
    except Exception:
        return None
    return lambda: layer.cpu_linear(a, layer.weight, None)  # type: ignore[operator]  # as above


def _vllm_cpu_fused_moe(shape: dict, dt: torch.dtype) -> Optional[tuple[Callable, float]]:
    """vLLM's CPU MoE kernel (`cpu_fused_moe`: w13, the activation and w2 of every hit expert in one
    call) for a moe_w13/moe_w2 shape: (callable, this GEMM's share of the call's FLOPs), or None when
    vllm is not importable. The decode step's tokens (`batch`) each pick top_k of the `groups` hit
    experts, top_k = m x groups / batch (the shape's tokens per expert times the experts hit)."""
    try:
        # vllm: the cpu/gpu extras only; without it this says so instead of failing the import
        from vllm import _custom_ops as ops
        if not hasattr(torch.ops._C, "cpu_fused_moe"):
            return None
    except Exception:
        return None
    groups, batch = int(shape.get("groups", 1)), int(shape.get("batch") or shape["m"])
    top_k = max(1, min(groups, round(shape["m"] * groups / batch)))
    if shape["op"] == "moe_w13":
        hidden, inter = shape["k"], shape["n"] // 2
    else:
        hidden, inter = shape["n"], shape["k"]
    # as the engine picks its experts class (vllm fused_moe/experts/cpu_moe.py): AMX for bf16 activations
    # only (its AMX kernel aborts the process on fp32: "Unsupported data type for TileGemm122"), else vec
    amx = torch.cpu._is_amx_tile_supported() and dt == torch.bfloat16
    isa = "amx" if amx else "vec"
    if amx:  # the process's permission for AMX tile state (Linux arch_prctl), which the engine's processes
        torch._C._cpu._init_amx()  # have; without it the first AMX instruction raises SIGILL
    try:
        w13 = ops.cpu_prepack_moe_weight(torch.randn(groups, 2 * inter, hidden, dtype=dt), isa)
        w2 = ops.cpu_prepack_moe_weight(torch.randn(groups, hidden, inter, dtype=dt), isa)
        x, out = torch.randn(batch, hidden, dtype=dt), torch.empty(batch, hidden, dtype=dt)
        ids = torch.tensor([[(t * top_k + j) % groups for j in range(top_k)] for t in range(batch)], dtype=torch.int32)
        weights = torch.full((batch, top_k), 1.0 / top_k, dtype=torch.float32)
        fn = lambda: ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", isa)  # noqa: E731
        fn()
    except Exception:  # a dtype or shape this build's kernel refuses: the torch.bmm stand-in is timed
        return None
    # FLOPs: w13 2 x batch x top_k x 2 inter x hidden, w2 half of that
    return fn, (2.0 / 3.0 if shape["op"] == "moe_w13" else 1.0 / 3.0)


@dataclass
class EngineKernel:
    """A GEMM as vLLM's CPU build runs it: the callable, this GEMM's share of what one call computes,
    the bytes it moves and how it was made (for the method column)."""
    fn: Callable[[], None]
    share: float
    nbytes: float
    kernel: str


def cpu_engine_kernel(shape: dict, dtype: str) -> Optional[EngineKernel]:
    """The kernel vLLM's CPU build runs for this GEMM shape (its linear dispatch, or its fused MoE for
    moe_w13/moe_w2 with several experts), or None when vllm is not importable or refuses the shape:
    then torch's stand-in (make_gemm) is timed."""
    dt = TORCH_DTYPES.get(dtype)
    if dt is None:
        return None
    elt = torch.tensor([], dtype=dt).element_size()
    m, n, k, groups = shape["m"], shape["n"], shape["k"], int(shape.get("groups", 1))
    if groups == 1:
        fn = _vllm_cpu_linear(m, n, k, dt)
        return None if fn is None else EngineKernel(
            fn, 1.0, float((m * k + n * k + m * n) * elt),
            "vLLM's CPU linear (dispatch_cpu_unquantized_gemm: oneDNN or packed weights). ")
    if shape["op"] not in ("moe_w13", "moe_w2"):
        return None
    moe = _vllm_cpu_fused_moe(shape, dt)
    if moe is None:
        return None
    fn, share = moe
    return EngineKernel(fn, share, float(groups * n * k * elt),
                        f"vLLM's cpu_fused_moe (w13, activation and w2 in one call) timed whole; this GEMM's "
                        f"{100 * share:.0f}% of its FLOPs. ")


def make_gemm(m: int, n: int, k: int, dtype: str, device: torch.device,
              groups: int = 1) -> tuple[Optional[Callable], str, float]:
    """(callable, skip reason, bytes moved). The callable computes A[m,k] @ W[n,k]^T, or with groups > 1
    one batched product over that many experts' weights (torch.bmm, one kernel), as fused MoE runs."""
    if dtype in ("bf16", "fp16", "fp32"):
        dt = TORCH_DTYPES[dtype]
        elt = torch.tensor([], dtype=dt).element_size()
        if groups > 1:
            a = torch.randn(groups, m, k, device=device, dtype=dt)
            w = torch.randn(groups, n, k, device=device, dtype=dt)
            out = torch.empty(groups, m, n, device=device, dtype=dt)
            return (lambda: torch.bmm(a, w.transpose(1, 2), out=out)), "", \
                float(groups * (m * k + n * k + m * n) * elt)
        a = torch.randn(m, k, device=device, dtype=dt)
        w = torch.randn(n, k, device=device, dtype=dt)
        out = torch.empty(m, n, device=device, dtype=dt)
        return (lambda: torch.mm(a, w.t(), out=out)), "", float((m * k + n * k + m * n) * elt)
    if groups > 1 and dtype == "int4":
        return _marlin_moe_w4a16(m, n, k, groups, device)
    if groups > 1:
        return None, f"grouped (MoE) {dtype} GEMMs are not probed: bf16/fp16/fp32 through torch.bmm, int4 through vLLM's Marlin MoE", 0.0
    if dtype == "fp8":
        if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
            return None, "fp8 needs a CUDA GPU with float8 (Hopper or newer)", 0.0
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9:
            return None, f"fp8 tensor cores need compute capability 9.0+, this GPU is {major}.x", 0.0
        if n % FP8_MIN_DIM or k % FP8_MIN_DIM:
            return None, f"torch._scaled_mm needs N and K multiples of {FP8_MIN_DIM} (N={n}, K={k})", 0.0
        mp = max(m, FP8_MIN_DIM) if m % FP8_MIN_DIM else m  # rows padded as serving kernels pad them
        a = torch.randn(mp, k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return (lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), "", \
            float(mp * k + n * k + mp * n * 2)
    if dtype == "int4":
        return _marlin_w4a16(m, n, k, device)
    return None, f"unknown dtype {dtype!r}; valid: bf16, fp16, fp32, fp8, int4", 0.0


def accepted_kwargs(fn: Callable, given: dict) -> dict:
    """The arguments of `given` that fn takes, by name."""
    names = inspect.signature(fn).parameters
    return {name: value for name, value in given.items() if name in names}


def marlin_unavailable(device: torch.device) -> str:
    """Why vLLM's Marlin kernels cannot run here ("" when they can)."""
    try:
        # optional: vLLM is only on a GPU host's path, never a dependency of the probe itself
        from vllm import _custom_ops  # noqa: F401
        from vllm.model_executor.layers.quantization.utils import marlin_utils_test  # noqa: F401
    except Exception as e:  # vllm missing or built without Marlin: recorded, not fatal
        return f"W4A16 needs vLLM's Marlin kernels: vllm not importable here ({type(e).__name__}: {e})"
    if device.type != "cuda":
        return "Marlin W4A16 runs on CUDA GPUs only"
    return ""


def _marlin_workspace(device: torch.device, n: int) -> torch.Tensor:
    """The kernel's lock workspace: one int per thread block vLLM may launch (its own helper where this
    vLLM has it; the older n/64 x 16 rule under-sizes it on 132-SM GPUs for n < 528)."""
    try:
        # optional, as in _marlin_unavailable
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        return marlin_make_workspace_new(device, 4)
    except ImportError:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return torch.zeros(max(n // 64 * 16, 4 * sms), dtype=torch.int, device=device)


def marlin_moe_block_size_m(tokens: int, top_k: int, experts: int) -> int:
    """The M block vLLM's fused_marlin_moe picks for this many routed tokens (its selection loop)."""
    for block in (8, 16, 32, 48, 64):
        if tokens * top_k / experts / block < 0.9:
            return block
    return 64


def _marlin_moe_w4a16(m: int, n: int, k: int, groups: int, device: torch.device):
    """One of fused MoE's two W4A16 GEMMs as vLLM runs them (ops.moe_wna16_marlin_gemm, the kernel the
    engine launches per MoE layer and GEMM): `groups` experts with m routed rows each."""
    why = marlin_unavailable(device)
    if why:
        return None, why, 0.0
    try:
        call, q_all = marlin_moe_call(m, n, k, groups, device)
        fn = lambda: call(q_all)  # noqa: E731
        fn()
        return fn, "", float(groups * (m * k * 2 + n * k * bytes_per_element("int4", MARLIN_GROUP) + m * n * 2))
    except Exception as e:
        return None, f"Marlin MoE W4A16 call failed on this vLLM build: {type(e).__name__}: {e}", 0.0


def marlin_moe_call(m: int, n: int, k: int, groups: int, device: torch.device):
    """(call(weights), weights): ops.moe_wna16_marlin_gemm over `groups` experts of m rows each, one
    expert per row (top-1 routing gives the kernel the same rows per expert as top-k over fewer tokens).
    One expert's weights are quantised and copied to all of them: the kernel's time does not depend on
    the values, and each expert's copy is its own memory, read once per call as in the engine. Also
    returns what a check needs: see marlin_moe_reference."""
    # optional, as in _marlin_unavailable
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types

    rows = m * groups
    a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    # False: act_order in older vLLM; 0.32 (installed) takes input_dtype 4th, where False fails (.itemsize)
    w_ref, q_w, s, _, _, _ = marlin_quantize(torch.randn(k, n, device=device, dtype=torch.bfloat16),
                                             scalar_types.uint4b8, MARLIN_GROUP, False)
    q_all = q_w.unsqueeze(0).repeat(groups, 1, 1).contiguous()
    s_all = s.unsqueeze(0).repeat(groups, 1, 1).contiguous()
    topk_ids = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m).view(rows, 1)
    block = marlin_moe_block_size_m(rows, 1, groups)
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, block, groups)
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    given = {"input": a, "output": out, "b_bias": None, "b_scales": s_all,
             "a_scales": None, "global_scale": None, "b_qzeros": None, "g_idx": None, "perm": None,
             "workspace": _marlin_workspace(device, n), "sorted_token_ids": sorted_ids,
             "expert_ids": expert_ids, "num_tokens_past_padded": post_padded,
             "topk_weights": torch.ones(rows, 1, device=device, dtype=torch.float32),
             "moe_block_size": block, "top_k": 1, "mul_topk_weights": False,
             "b_q_type": scalar_types.uint4b8, "size_m": rows, "size_n": n, "size_k": k,
             "is_k_full": True, "use_atomic_add": False, "use_fp32_reduce": True, "is_zp_float": False}
    kwargs = accepted_kwargs(ops.moe_wna16_marlin_gemm, {**given, "b_qweight": None})
    kwargs.pop("b_qweight", None)

    def call(weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_wna16_marlin_gemm(b_qweight=weights, **kwargs)

    # the activations, the dequantised weight [k, n], the output buffer (mypy types no function attributes)
    call.reference = (a, w_ref, out)  # type: ignore[attr-defined]
    return call, q_all


def _marlin_w4a16(m: int, n: int, k: int, device: torch.device):
    why = marlin_unavailable(device)
    if why:
        return None, why, 0.0
    try:
        from vllm import _custom_ops as ops  # optional, as in _marlin_unavailable
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types

        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        # False: act_order, as in marlin_moe_call (0.32's 4th parameter is input_dtype: see there)
        _, q_w, s, g_idx, sort_idx, _ = marlin_quantize(
            w, scalar_types.uint4b8, MARLIN_GROUP, False)
        ws = _marlin_workspace(device, n)
        # by name: the positional order changed between vLLM releases (b_bias, a_scales were added)
        given = {"a": a, "c": None, "b_q_weight": q_w, "b_bias": None, "b_scales": s, "a_scales": None,
                 "global_scale": None, "b_zeros": None, "g_idx": g_idx, "perm": sort_idx, "workspace": ws,
                 "b_q_type": scalar_types.uint4b8, "size_m": m, "size_n": n, "size_k": k, "is_k_full": True}
        # vLLM 0.26 renamed gptq_marlin_gemm to marlin_gemm, with the same arguments
        marlin_gemm = getattr(ops, "marlin_gemm", None) or ops.gptq_marlin_gemm
        kwargs = accepted_kwargs(marlin_gemm, given)
        fn = lambda: marlin_gemm(**kwargs)  # noqa: E731
        fn()
        return fn, "", float(m * k * 2 + n * k * bytes_per_element("int4", MARLIN_GROUP) + m * n * 2)
    except Exception as e:
        return None, f"Marlin W4A16 call failed on this vLLM build: {type(e).__name__}: {e}", 0.0
