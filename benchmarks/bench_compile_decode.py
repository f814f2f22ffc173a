"""Would torch.compile (inductor, on the CPU) decode faster than our fused step? Issue 23 asks to measure it.

    .venv/bin/python benchmarks/bench_compile_decode.py [--quick] [--threads 2]

The contender is a compile-friendly copy of decode_step.py's math for tinystories-17m (random weights): the same
fused q/k/v and W1/W3 products, RMSNorm in float32, RoPE in real arithmetic (inductor has no code for complex
tensors), attention over the whole preallocated cache with the positions past the current one masked, and the
position as a tensor, so that every step has the same shapes and the graph compiles once (an int length would
recompile at every step). Compiled with `fullgraph=True` and inductor's `freezing` (the weights are constants, so
it packs them for oneDNN as our tuned_linear.py does). Ours is `kernels.decoding`'s step. Both decode the same
100 steps at positions 22-121 of a KV cache, fp32 and bf16, batch 1 and 8; reported: median ms a step, the ratio,
and the compile time (the first call, which every new process pays again unless inductor's on-disk cache holds
the graph). Not used by generate() or serve: see docs/benchmarks.md for why.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels

PRESET = "tinystories-17m"
STEPS = 100
QUICK_STEPS = 30


def frozen(*tensors: torch.Tensor) -> nn.Parameter:
    """The tensors concatenated along their first dimension, as a parameter without gradient."""
    return nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=False)


class StaticStep(nn.Module):
    """One decoding step of a pre-norm SwiGLU TransformerLM with static shapes: (ids (B,), position ()) -> (B, V)."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        layers = model.layers
        self.embedding, self.head = model.token_embeddings.weight, model.lm_head.weight
        self.qkv = nn.ParameterList(frozen(b.attn.q_proj.weight, b.attn.k_proj.weight, b.attn.v_proj.weight)
                                    for b in layers)
        self.out = nn.ParameterList(b.attn.output_proj.weight for b in layers)
        self.up = nn.ParameterList(frozen(b.ffn.w1.weight, b.ffn.w3.weight) for b in layers)
        self.down = nn.ParameterList(b.ffn.w2.weight for b in layers)
        self.norms = [(b.ln1, b.ln2) for b in layers]
        self.final_norm = model.ln_final
        attention = layers[0].attn
        self.heads, self.kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.register_buffer("cos", attention.rope.cos.float())
        self.register_buffer("sin", attention.rope.sin.float())

    @staticmethod
    def _norm(norm, x: torch.Tensor) -> torch.Tensor:
        real = x.float()
        return (real * torch.rsqrt(real.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).to(x.dtype)

    def forward(self, ids: torch.Tensor, position: torch.Tensor, keys: list, values: list) -> torch.Tensor:
        rows, heads, kv_heads, d = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        at = position.view(1)
        cos, sin = self.cos.index_select(0, at).view(1, 1, -1), self.sin.index_select(0, at).view(1, 1, -1)
        later = torch.arange(keys[0].shape[2], device=ids.device) > position  # (S,): not yet written
        x = self.embedding[ids]
        for index, (norm1, norm2) in enumerate(self.norms):
            qk, v = (self._norm(norm1, x) @ self.qkv[index].t()).split(((heads + kv_heads) * d, kv_heads * d), -1)
            pairs = qk.view(rows, heads + kv_heads, d // 2, 2).float()
            even, odd = pairs[..., 0], pairs[..., 1]
            qk = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2).to(x.dtype)
            q, k = qk.split((heads, kv_heads), dim=1)
            keys[index].index_copy_(2, at, k.view(rows, kv_heads, 1, d))
            values[index].index_copy_(2, at, v.view(rows, kv_heads, 1, d))
            grouped = q.float().view(rows, kv_heads, heads // kv_heads, d)
            scores = (grouped @ keys[index].float().transpose(-2, -1) / math.sqrt(d)).masked_fill(later, -math.inf)
            attended = (torch.softmax(scores, -1) @ values[index].float()).to(x.dtype).view(rows, heads * d)
            x = x + attended @ self.out[index].t()
            gate, up = (self._norm(norm2, x) @ self.up[index].t()).chunk(2, -1)
            x = x + (gate * torch.sigmoid(gate) * up) @ self.down[index].t()
        return self._norm(self.final_norm, x) @ self.head.t()


def median_ms(step, steps: int) -> float:
    times = []
    for position in range(22, 22 + steps):
        start = time.perf_counter()
        step(position)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(dtype: torch.dtype, rows: int, steps: int) -> tuple[float, float, float]:
    """(ours ms a step, compiled ms a step, compile seconds)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset(PRESET), dtype=dtype).eval()
    ids = torch.zeros(rows, dtype=torch.long)
    with torch.inference_mode():
        with kernels.decoding(model, rows) as ours:
            cache = KVCache.for_model(model, rows)
            ours(ids[:, None].expand(rows, 22).contiguous(), cache)

            def our_step(position: int) -> None:
                ours(ids[:, None], cache)

            ours_ms = median_ms(our_step, steps)
        static = torch.compile(StaticStep(model).eval(), fullgraph=True, dynamic=False)
        cache = KVCache.for_model(model, rows)
        start = time.perf_counter()
        static(ids, torch.tensor(0), cache.keys, cache.values)
        compile_s = time.perf_counter() - start
        compiled_ms = median_ms(lambda position: static(ids, torch.tensor(position), cache.keys, cache.values),
                                steps)
    return ours_ms, compiled_ms, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps instead of {STEPS}")
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config
    inductor_config.freezing = True
    print(f"{PRESET}, {args.threads} threads, median of {steps} steps at positions 22-{21 + steps}")
    print("| dtype, batch | ours (kernels.decoding) ms | torch.compile ms | compiled / ours | compile s |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8):
            ours_ms, compiled_ms, compile_s = measure(dtype, rows, steps)
            print(f"| {str(dtype).removeprefix('torch.')}, {rows} | {ours_ms:.2f} | {compiled_ms:.2f} | "
                  f"{compiled_ms / ours_ms:.2f} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
