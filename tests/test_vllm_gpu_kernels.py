"""02's W4A16 probes through vLLM's own Marlin kernels, on a GPU with vLLM (the device machine with the
vLLM GPU bundle on its path: benchmarks/device/h200_campaign.sh). Run through the device tool:
`python -m pytest -m gpu tests/test_vllm_gpu_kernels.py`."""
import pytest

pytestmark = pytest.mark.gpu

# Kimi-K2.5's routed-expert GEMMs at tensor-parallel 1: w13 (2 x 2048 out, 7168 in), w2 (7168 out, 2048 in)
MOE_SHAPES = [("moe_w13", 4096, 7168), ("moe_w2", 7168, 2048)]


def _cuda():
    import torch

    return torch.device("cuda")


@pytest.mark.parametrize("op,n,k", MOE_SHAPES)
def test_the_marlin_moe_probe_computes_each_experts_rows_times_its_dequantised_weight(op, n, k):
    """The call the probe times is the engine's kernel doing the right work: every expert's rows come
    out as the activations times the weight marlin_quantize dequantises back, within bf16 and int4
    rounding."""
    import torch

    from decodescope.probes.gemm_kernels import marlin_moe_call

    call, q_all = marlin_moe_call(3, n, k, 5, _cuda())
    out = call(q_all)
    a, w_ref, _ = call.reference
    ref = a.float() @ w_ref.float()
    err = (out.float() - ref).norm() / ref.norm()
    print(op, tuple(out.shape), f"relative error {err.item():.4f}")
    assert out.shape == (15, n) and torch.isfinite(out).all()
    assert err.item() < 0.02


@pytest.mark.parametrize("batch_rows,groups", [(1, 8), (2, 61)])
def test_the_grouped_int4_probe_times_the_experts_hit_eager_graph_and_cold(batch_rows, groups):
    """measure() on a grouped int4 row (as 02's plan writes one for a quantized checkpoint's experts):
    eager, CUDA-graph and cold-weights timings, none zero, more experts hit costing more."""
    from decodescope.probes.gemm import Flusher, measure

    dev = _cuda()
    rows = {}
    fewer = max(2, groups // 4)
    for g in (groups, fewer):
        shape = {"op": "moe_w13", "layer_kind": "moe_expert", "batch": 1, "m": batch_rows, "n": 4096, "k": 7168,
                 "count": 1, "groups": g, "dtype": "int4"}
        rows[g] = measure(shape, dev, iters=20, warmup=5, flush=Flusher(dev), graph=True)
    r = rows[groups]
    print({g: (x["status"], round(x.get("time_us", 0), 1), round(x.get("cold_weights_time_us", 0), 1),
               round(x.get("gbps", 0))) for g, x in rows.items()})
    assert r["status"] == "ok", r["skip_reason"]
    assert r["eager_time_us"] > 0 and r["graph_time_us"] > 0 and r["cold_weights_time_us"] > 0
    assert rows[fewer]["status"] == "ok" and r["time_us"] > rows[fewer]["time_us"]
    assert r["gbps"] < 5000  # below the H200's 4.8 TB/s HBM, give or take the timer: the weights are read


def test_the_dense_int4_probe_runs_through_gptq_marlin_at_the_attention_shapes():
    from decodescope.probes.gemm import Flusher, measure

    dev = _cuda()
    for n, k in ((2112, 7168), (7168, 8192), (512, 128)):
        r = measure({"op": "x", "batch": 4, "m": 4, "n": n, "k": k, "count": 1, "dtype": "int4"}, dev,
                    iters=20, warmup=5, flush=Flusher(dev), graph=True)
        print(n, k, r["status"], r.get("skip_reason"), round(r.get("time_us", 0), 1))
        assert r["status"] == "ok", r["skip_reason"]
        assert r["time_us"] > 0
