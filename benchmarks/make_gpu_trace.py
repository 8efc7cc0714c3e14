"""GPU traces of a real model's decode under torch.profiler, for the trace benchmark and the
categorizer's GPU check. Runs on a GPU host (no vLLM needed): a Qwen3-MoE built from its config with
random weights (transformers), batch decode with a KV cache, each step in a record_function named as
vLLM names its steps, profiled with stacks like vLLM's profiler does.

python benchmarks/make_gpu_trace.py OUT_DIR --steps N [--layers L] [--with-stack]
"""
import argparse
import gzip
import os
import shutil
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def build_model(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                         num_experts_per_tok=8, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


@torch.inference_mode()
def decode(model, steps: int, batch: int, prompt: int, prof=None):
    ids = torch.randint(0, 32000, (batch, prompt), device="cuda")
    with record_function(f"execute_context_{batch}({batch * prompt})_generation_0(0)"):
        out = model(input_ids=ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        with record_function(f"execute_context_0(0)_generation_{batch}({batch})"):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = torch.softmax(out.logits[:, -1].float(), -1).argmax(-1, keepdim=True)
        if prof is not None:
            prof.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--with-stack", action="store_true")
    ap.add_argument("--name", default="h200")
    ap.add_argument("--gzip", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    model = build_model(args.layers)
    decode(model, 4, args.batch, 64)  # warm-up
    torch.cuda.synchronize()
    t0 = time.time()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.with_stack,
                 record_shapes=True) as prof:
        decode(model, args.steps, args.batch, 64)
        torch.cuda.synchronize()
    path = os.path.join(args.out_dir, f"{args.name}_rank0.{os.getpid()}.pt.trace.json")
    prof.export_chrome_trace(path)
    if args.gzip:
        with open(path, "rb") as s, gzip.open(path + ".gz", "wb", compresslevel=6) as d:
            shutil.copyfileobj(s, d)
        os.unlink(path)
        path += ".gz"
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB, {args.steps} steps in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
