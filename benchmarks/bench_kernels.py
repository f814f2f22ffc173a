"""Each speed path of model/kernels/ against the readable path it stands in for, and the whole model with and
without them: what each kernel buys on this machine (the figures its docstring points to).

Shapes are tinystories-17m's (batch 8 x 256, 16 heads of 32, d_ff 1,344, fp32): the attention core, RoPE and
SwiGLU's hidden layer forward+backward as in a training step; a Linear of the decoding shape (one and eight rows
through the 10,000 x 512 LM head); the model's forward+backward step, and its greedy decoding of 64 tokens at
batch 1 and 8 (with the kernels: the step `kernels.decoding` yields, as generate() runs). Contenders alternate
(harness.interleave); each row reports medians and the kernel/readable time ratio (< 1: the kernel is faster).

    .venv/bin/python benchmarks/bench_kernels.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy

import torch

from harness import interleave, report
from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels
from scratchlm.model.attention import causal_attention, rotate_pairs
from scratchlm.model.kernels.chunked_attention import chunked_causal_attention
from scratchlm.model.kernels.complex_rope import rotate_as_complex
from scratchlm.model.kernels.few_rows_linear import few_rows_linear
from scratchlm.model.kernels.fused_attention import fused_causal_attention
from scratchlm.model.kernels.fused_swiglu import fused_swiglu
from scratchlm.model.layers import linear
from scratchlm.model.transformer import SwiGLU

B, H, T, D_K, D_FF = 8, 16, 256, 32, 1344


def forward_backward(fn, *inputs: torch.Tensor):
    leaves = [t.detach().requires_grad_() for t in inputs]
    return lambda: fn(*leaves).sum().backward()


def bench_attention(repeats: int) -> None:
    q, k, v = (torch.randn(B, H, T, D_K) for _ in range(3))
    results = interleave({name: forward_backward(fn, q, k, v) for name, fn in (
        ("readable", causal_attention), ("chunked", chunked_causal_attention), ("fused SDPA", fused_causal_attention))},
        repeats=repeats)
    title = f"attention core, forward+backward, ({B}, {H}, {T}, {D_K}) causal"
    report(title + ": chunked vs readable", results, "chunked", "readable")
    report(title + ": chunked vs torch's fused SDPA", results, "chunked", "fused SDPA")


def bench_rope(repeats: int) -> None:
    x = torch.randn(B, T, H, D_K).transpose(1, 2)  # the (B, H, T, d_k) view the attention module rotates
    angles = torch.arange(T)[:, None] * torch.rand(D_K // 2)
    cos, sin = angles.cos(), angles.sin()
    results = interleave({"readable": forward_backward(lambda x: rotate_pairs(x, cos, sin), x),
                          "complex": forward_backward(lambda x: rotate_as_complex(x, cos, sin), x)}, repeats=repeats)
    report(f"RoPE, forward+backward, ({B}, {H}, {T}, {D_K})", results, "complex", "readable")


def bench_swiglu(repeats: int) -> None:
    gate, up = torch.randn(B, T, D_FF), torch.randn(B, T, D_FF)
    results = interleave({"readable": forward_backward(SwiGLU.hidden, gate, up),
                          "fused": forward_backward(fused_swiglu, gate, up)}, repeats=repeats * 5)
    report(f"SwiGLU hidden layer SiLU(gate) * up, forward+backward, ({B}, {T}, {D_FF})", results, "fused", "readable")


def bench_linear(repeats: int) -> None:
    weight = torch.randn(10_000, 512)
    for rows in (1, 8):
        x = torch.randn(rows, 1, 512)
        results = interleave({"readable": lambda x=x: linear(x, weight),
                              "few rows": lambda x=x: few_rows_linear(x, weight)}, repeats=repeats * 20)
        report(f"Linear 512 -> 10,000, {rows} row(s) (a decoding step's LM head)", results, "few rows", "readable")


def bench_model(repeats: int) -> None:
    torch.manual_seed(0)
    readable = TransformerLM(ModelConfig.preset("tinystories-17m"))
    fast = kernels.apply(copy.deepcopy(readable), "cpu")
    ids = torch.randint(0, readable.config.vocab_size, (B, T))

    def step(model):
        return lambda: model(ids).logsumexp(-1).mean().backward()

    results = interleave({"readable": step(readable), "kernels": step(fast)}, repeats=repeats)
    report(f"tinystories-17m forward+backward, batch {B} x {T}", results, "kernels", "readable", B * T, "tokens")
    for batch in (1, 8):
        prompts = torch.randint(0, readable.config.vocab_size, (batch, 16)).tolist()

        def decode(use_kernels: bool, prompts=prompts):
            if not use_kernels:
                return _greedy(kernels.forward_step(readable), readable, prompts, 64)
            with kernels.decoding(readable, batch=len(prompts)) as step:  # what generate() decodes with
                return _greedy(step, readable, prompts, 64)

        results = interleave({"readable": lambda: decode(False), "kernels": lambda: decode(True)}, repeats=repeats)
        report(f"tinystories-17m greedy decoding, 64 tokens, batch {batch} (KV cache)", results, "kernels",
               "readable", batch * 64, "tokens")


@torch.inference_mode()
def _greedy(step: kernels.Step, model: TransformerLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding through `step` (the model's forward, or the step `kernels.decoding` yields): prefill, then
    one cached token at a time."""
    ids = torch.tensor(prompts)
    cache = KVCache.for_model(model, len(prompts))
    next_ids = step(ids, cache)[:, -1].argmax(-1)
    out = [next_ids]
    for _ in range(new_tokens - 1):
        next_ids = step(next_ids[:, None], cache)[:, -1].argmax(-1)
        out.append(next_ids)
    return torch.stack(out, 1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    print(f"{args.threads} threads, fp32, {repeats} interleaved repeats")
    bench_attention(repeats)
    bench_rope(repeats)
    bench_swiglu(repeats)
    bench_linear(repeats)
    bench_model(max(2, repeats // 2))


if __name__ == "__main__":
    main()
