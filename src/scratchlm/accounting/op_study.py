"""Op studies: FLOPs are not runtime. Times our modules against torch's and splits one block by op.

Three tables, all forward passes at one (batch, context, d_model) shape, timed in alternation (every
contender runs once per round, so drift in machine load hits all alike) and reported as medians:
1. ours vs torch: Linear / nn.Linear, RMSNorm / nn.RMSNorm, LayerNorm / nn.LayerNorm, softmax / torch.softmax
   on (B, h, T, T) scores, silu / F.silu, our causal SDPA / F.scaled_dot_product_attention.
2. one pre-norm SwiGLU block, op by op as the model runs them (three Q/K/V projections, the causal mask added
   inside the QKᵀ baddbmm): share of FLOPs vs share of wall time. Matmuls cost 2mnk; elementwise ops
   are charged a documented per-element count (ELEMENTWISE_FLOPS), so the norms show as <0.1% of FLOPs while
   taking a visible share of the time (they are memory-bound: a few FLOPs per byte moved).
3. FFN variants at matched parameter count: SwiGLU (d_ff ≈ 8/3·d, 3 matrices) vs ReLU / GELU / SiLU FFNs
   (d_ff = 4·d, 2 matrices): 8·d² parameters each up to rounding. ReLU and GELU exist for this study only.
Torch's modules are the rivals here (benchmark code, not model code).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scratchlm.model.attention import RotaryPositionalEmbedding, scaled_dot_product_attention
from scratchlm.model.config import swiglu_hidden_size
from scratchlm.model.layers import LayerNorm, Linear, RMSNorm, silu, softmax

# FLOPs charged per output element of the elementwise ops (an estimate: what the math needs, not the kernel).
ELEMENTWISE_FLOPS = {"norm": 4, "softmax": 5, "rope": 3, "mask": 1, "silu_gate": 5, "residual": 1}


@dataclass
class OpStudyConfig:
    d_model: int = 512
    context: int = 256
    batch: int = 8
    num_heads: int = 8
    repeats: int = 10

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"--d-model ({self.d_model}) must split into --heads ({self.num_heads}) heads of even "
                             f"size (RoPE rotates pairs)")


def time_interleaved(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each contender, run in alternation."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.no_grad():
        for round_index in range(warmup + repeats):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                if round_index >= warmup:
                    seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def ours_vs_torch(cfg: OpStudyConfig) -> list[dict]:
    B, T, d, h = cfg.batch, cfg.context, cfg.d_model, cfg.num_heads
    x = torch.randn(B, T, d)  # (B, T, d)
    scores = torch.randn(B, h, T, T)
    hidden = torch.randn(B, T, 4 * d)
    q, k, v = (torch.randn(B, h, T, d // h) for _ in range(3))  # (B, h, T, d_k)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    linear, torch_linear = Linear(d, d), nn.Linear(d, d, bias=False)
    torch_linear.weight.data.copy_(linear.weight.data)
    rms, torch_rms = RMSNorm(d), nn.RMSNorm(d, eps=1e-5)
    ln, torch_ln = LayerNorm(d), nn.LayerNorm(d)
    pairs = {
        "Linear": (lambda: linear(x), lambda: torch_linear(x)),
        "RMSNorm": (lambda: rms(x), lambda: torch_rms(x)),
        "LayerNorm": (lambda: ln(x), lambda: torch_ln(x)),
        "softmax (B,h,T,T)": (lambda: softmax(scores, -1), lambda: torch.softmax(scores, -1)),
        "silu (B,T,4d)": (lambda: silu(hidden), lambda: F.silu(hidden)),
        "causal SDPA": (lambda: scaled_dot_product_attention(q, k, v, causal),
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    rows = []
    for name, (ours, theirs) in pairs.items():
        medians = time_interleaved({"ours": ours, "torch": theirs}, cfg.repeats)
        rows.append({"op": name, "ours_ms": 1e3 * medians["ours"], "torch_ms": 1e3 * medians["torch"],
                     "ratio": medians["ours"] / medians["torch"]})
    return rows


def block_breakdown(cfg: OpStudyConfig) -> list[dict]:
    """Each op of one pre-norm SwiGLU block, as model/ calls it: its FLOPs and median time, and both as shares.

    The attention core is timed op by op over all (B·h, T, T) scores at once. On CPU the model walks the same
    ops in cache-sized chunks (model/kernels/chunked_attention.py), and its softmax runs in place on the scores, so
    there the core costs less than its rows here add up to.
    """
    B, T, d, h = cfg.batch, cfg.context, cfg.d_model, cfg.num_heads
    f, d_k = swiglu_hidden_size(d), d // h
    x = torch.randn(B, T, d)  # (B, T, d)
    norm, w_q, w_k, w_v, w_out = RMSNorm(d), Linear(d, d), Linear(d, d), Linear(d, d), Linear(d, d)
    w1, w2, w3 = Linear(d, f), Linear(f, d), Linear(d, f)
    rope = RotaryPositionalEmbedding(10_000.0, d_k, T)
    q, k, v = (torch.randn(B * h, T, d_k) for _ in range(3))  # (B·h, T, d_k)
    keys_t = k.transpose(1, 2)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(T, T).masked_fill_(~causal, float("-inf")).expand(B * h, T, T)  # 0 or -inf, as attention.py
    scores = torch.baddbmm(bias, q, keys_t, alpha=d_k**-0.5)  # (B·h, T, T)
    probs = softmax(scores, -1)
    heads = torch.randn(B, T, d)
    gate, up = torch.randn(B, T, f), torch.randn(B, T, f)
    hidden = torch.randn(B, T, f)
    tokens, elem = B * T, ELEMENTWISE_FLOPS
    ops: dict[str, tuple[Callable[[], object], int]] = {
        "ln1 (RMSNorm)": (lambda: norm(x), elem["norm"] * tokens * d),
        "Q, K, V projections": (lambda: (w_q(x), w_k(x), w_v(x)), 3 * 2 * tokens * d * d),
        "RoPE (Q and K)": (lambda: (rope(q), rope(k)), 2 * elem["rope"] * tokens * d),
        "QK^T + causal mask": (lambda: torch.baddbmm(bias, q, keys_t, alpha=d_k**-0.5),
                               2 * B * h * T * T * d_k + elem["mask"] * B * h * T * T),
        "softmax": (lambda: softmax(scores, -1), elem["softmax"] * B * h * T * T),
        "probs @ V": (lambda: torch.bmm(probs, v), 2 * B * h * T * T * d_k),
        "output projection": (lambda: w_out(heads), 2 * tokens * d * d),
        "residual adds (2)": (lambda: (x + heads, x + heads), 2 * elem["residual"] * tokens * d),
        "ln2 (RMSNorm)": (lambda: norm(x), elem["norm"] * tokens * d),
        "FFN W1 and W3": (lambda: (w1(x), w3(x)), 2 * 2 * tokens * d * f),
        "SiLU gate": (lambda: silu(gate) * up, elem["silu_gate"] * tokens * f),
        "FFN W2": (lambda: w2(hidden), 2 * tokens * f * d),
    }
    medians = time_interleaved({name: fn for name, (fn, _) in ops.items()}, cfg.repeats)
    total_flops, total_time = sum(fl for _, fl in ops.values()), sum(medians.values())
    return [{"op": name, "flops": fl, "flop_share": fl / total_flops, "ms": 1e3 * medians[name],
             "time_share": medians[name] / total_time} for name, (_, fl) in ops.items()]


def ffn_variants(cfg: OpStudyConfig) -> list[dict]:
    """SwiGLU vs ungated FFNs with ReLU, GELU, SiLU at (nearly) the same parameter count."""
    B, T, d = cfg.batch, cfg.context, cfg.d_model
    x = torch.randn(B, T, d)
    f_gated, f_plain = swiglu_hidden_size(d), 4 * d
    w1, w2, w3 = Linear(d, f_gated), Linear(f_gated, d), Linear(d, f_gated)
    u1, u2 = Linear(d, f_plain), Linear(f_plain, d)
    variants = {
        "SwiGLU": (lambda: w2(silu(w1(x)) * w3(x)), 3 * d * f_gated, 2 * B * T * d * f_gated * 3),
        "ReLU FFN": (lambda: u2(torch.relu(u1(x))), 2 * d * f_plain, 2 * B * T * d * f_plain * 2),
        "GELU FFN": (lambda: u2(F.gelu(u1(x))), 2 * d * f_plain, 2 * B * T * d * f_plain * 2),
        "SiLU FFN": (lambda: u2(silu(u1(x))), 2 * d * f_plain, 2 * B * T * d * f_plain * 2),
    }
    medians = time_interleaved({name: fn for name, (fn, _, _) in variants.items()}, cfg.repeats)
    return [{"ffn": name, "params": params, "matmul_flops": flops, "ms": 1e3 * medians[name],
             "gflops_per_s": flops / medians[name] / 1e9} for name, (_, params, flops) in variants.items()]


def norm_comparison(rows: list[dict]) -> dict:
    """RMSNorm vs LayerNorm, ours and torch's, from the ours-vs-torch rows."""
    by_op = {row["op"]: row for row in rows}
    return {who: by_op["LayerNorm"][f"{who}_ms"] / by_op["RMSNorm"][f"{who}_ms"] for who in ("ours", "torch")}


def run_op_study(cfg: OpStudyConfig) -> dict:
    pairs = ours_vs_torch(cfg)
    return {"shape": asdict(cfg), "threads": torch.get_num_threads(), "ours_vs_torch": pairs,
            "layernorm_over_rmsnorm_time": norm_comparison(pairs), "block": block_breakdown(cfg),
            "ffn_variants": ffn_variants(cfg), "elementwise_flops_per_element": ELEMENTWISE_FLOPS}


def format_study(study: dict) -> str:
    shape = study["shape"]
    lines = [f"shape: batch {shape['batch']} x context {shape['context']}, d_model {shape['d_model']}, "
             f"{shape['num_heads']} heads; forward only; medians of {shape['repeats']}; {study['threads']} threads",
             "", "| op | ours ms | torch ms | ours/torch |", "|---|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['ours_ms']:.3f} | {r['torch_ms']:.3f} | {r['ratio']:.2f} |"
              for r in study["ours_vs_torch"]]
    norms = study["layernorm_over_rmsnorm_time"]
    lines += ["", f"LayerNorm / RMSNorm time: ours {norms['ours']:.2f}x, torch {norms['torch']:.2f}x", "",
              "| block op | FLOPs | FLOP share | ms | time share |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['flops']:.3g} | {r['flop_share']:.2%} | {r['ms']:.3f} | {r['time_share']:.1%} |"
              for r in study["block"]]
    lines += ["", "| FFN (matched params) | params | ms | GFLOP/s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['ffn']} | {r['params']:,} | {r['ms']:.3f} | {r['gflops_per_s']:.1f} |"
              for r in study["ffn_variants"]]
    return "\n".join(lines)
