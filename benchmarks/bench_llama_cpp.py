"""Decoding and prompt processing, scratchlm against llama.cpp on the same CPU threads, in one run.

    .venv/bin/python benchmarks/bench_llama_cpp.py                 # demo, 17m and 125m models; 200 new tokens, 3 rounds
    .venv/bin/python benchmarks/bench_llama_cpp.py --quick         # demo and 17m; 32 new tokens, 1 round
    .venv/bin/python benchmarks/bench_llama_cpp.py --models demo --threads 1

llama.cpp is llama-cpp-python 0.3.36 built from source by scripts/setup_llama_cpp.sh (its own venv, driven over a
pipe by benchmarks/llama_cpp_driver.py, which times inside that process). The models, with random weights:
``demo`` the demo's Qwen3-shaped model (configs/recipes/modern.toml: d_model 256, 4 layers, QK-norm, vocab 4,096),
``17m`` the tinystories-17m preset (Llama), ``125m`` GPT-2 small's shape with tied embeddings (Llama, ~124M
parameters). Each is exported with `scratchlm export gguf` as f32 and f16; ours runs in fp32 and bf16.

Measured, per model, with the median over rounds (contenders in ABBA order, harness.round_order):
- prompt processing: one forward over a `--prompt-tokens` prompt (ours: the model on the whole prompt under
  inference_mode; llama.cpp: one llama_decode of it), tokens/s;
- decoding at batch 1: `--new-tokens` greedy tokens after a 16-token prompt (ours: `generate(temperature=0)`, the
  engine every entry point shares, eagerly and with `compile=True`, whose steps are compiled ahead of time: their
  build is not timed; llama.cpp: eval one token, numpy argmax, repeat), new tokens/s;
- 8 sequences: ours decodes 8 prompts at once through the same engine, llama.cpp (one sequence at a time in
  llama-cpp-python) decodes them one after the other; new tokens/s over all 8.
llama.cpp runs as llama-cpp-python configures it by default (KV cache in f16, flash attention off).
The table prints tokens/s and ours/llama.cpp as a speed ratio (> 1: ours is faster), with the machine line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import machine_line, round_order
from llama_cpp_client import llama_cpp_python, llama_cpp_venv, run_llama_cpp
from scratchlm.compat.commands import write_run
from scratchlm.generate.decoding import generate
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

MODELS = {
    "demo": dict(vocab_size=4096, context_length=256, d_model=256, num_layers=4, num_heads=4, qk_norm=True),
    "17m": ModelConfig.preset("tinystories-17m").to_dict(),
    "125m": {**ModelConfig.preset("gpt2-small").to_dict(), "tie_embeddings": True, "context_length": 512},
}
PROMPT = 16
SEQUENCES = 8


def write_model(name: str, folder: Path) -> tuple[TransformerLM, dict[str, Path]]:
    """The model with random weights, and its f32 and f16 GGUF exports (a byte-level tokenizer: ids only)."""
    from scratchlm.cli import main

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_dict(MODELS[name])).eval()
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)} | {256: b"th"}, [(b"t", b"h")], ["<|endoftext|>"])
    write_run(model, tokenizer, folder / name)
    files = {}
    for gguf_type in ("f32", "f16"):
        files[gguf_type] = folder / f"{name}.{gguf_type}.gguf"
        assert main(["export", "gguf", "--checkpoint", str(folder / name), "--out", str(files[gguf_type]),
                     "--type", gguf_type]) == 0
    return model, files


def time_ours(model: TransformerLM, prompts: list[list[int]], long_prompt: list[int], new_tokens: int,
              compile: bool = False) -> dict:
    """Seconds for one prompt forward, one batch-1 decode and one 8-sequence decode (`compile`: generate's)."""
    with torch.inference_mode():
        start = time.perf_counter()
        model(torch.tensor([long_prompt]))
        prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(model, prompts[0], new_tokens, temperature=0, compile=compile)
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(model, prompts, new_tokens, temperature=0, compile=compile)
    return {"prompt": prompt_s, "decode": decode_s, "batch": time.perf_counter() - start}


def time_llama_cpp(path: Path, prompts: list[list[int]], long_prompt: list[int], new_tokens: int, threads: int,
                   n_ctx: int) -> dict:
    """The same three, timed inside llama.cpp's process (its model load is not counted)."""
    jobs = [{"op": "time_prompt", "tokens": long_prompt, "repeats": 1},
            {"op": "time_decode", "prompt": prompts[0], "tokens": new_tokens, "repeats": 1},
            *({"op": "time_decode", "prompt": p, "tokens": new_tokens, "repeats": 1} for p in prompts)]
    results = run_llama_cpp([{"model": str(path), "n_ctx": n_ctx, "n_threads": threads, "logits_all": False,
                              "jobs": jobs}])["results"][0]
    return {"prompt": results[0][0], "decode": results[1][0], "batch": sum(r[0] for r in results[2:])}


def bench_model(name: str, folder: Path, args) -> list[dict]:
    model32, files = write_model(name, folder)
    cfg = model32.config
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (SEQUENCES, PROMPT), generator=generator).tolist()
    long_prompt = torch.randint(0, 256, (min(args.prompt_tokens, cfg.context_length),), generator=generator).tolist()
    new_tokens = min(args.new_tokens, cfg.context_length - PROMPT)
    model16 = TransformerLM(cfg, dtype=torch.bfloat16).eval()
    model16.load_state_dict(model32.state_dict())
    for model in (model32, model16):  # --compile builds its libraries (one row, several) at their first calls
        start = time.perf_counter()
        generate(model, prompts[0], 2, temperature=0, compile=True)
        generate(model, prompts[:2], 2, temperature=0, compile=True)
        print(f"{name}: the {model.lm_head.weight.dtype} --compile step built in {time.perf_counter() - start:.1f} s "
              f"(not timed)", file=sys.stderr)
    contenders = {
        "scratchlm fp32": lambda: time_ours(model32, prompts, long_prompt, new_tokens),
        "scratchlm fp32 --compile": lambda: time_ours(model32, prompts, long_prompt, new_tokens, compile=True),
        "scratchlm bf16": lambda: time_ours(model16, prompts, long_prompt, new_tokens),
        "scratchlm bf16 --compile": lambda: time_ours(model16, prompts, long_prompt, new_tokens, compile=True),
        "llama.cpp f32": lambda: time_llama_cpp(files["f32"], prompts, long_prompt, new_tokens, args.threads,
                                                cfg.context_length),
        "llama.cpp f16": lambda: time_llama_cpp(files["f16"], prompts, long_prompt, new_tokens, args.threads,
                                                cfg.context_length),
    }
    seconds: dict[str, list[dict]] = {contender: [] for contender in contenders}
    for round_index in range(args.warmup + args.rounds):
        for contender in round_order(list(contenders), round_index):
            measured = contenders[contender]()
            if round_index >= args.warmup:
                seconds[contender].append(measured)
    work = {"prompt": len(long_prompt), "decode": new_tokens, "batch": SEQUENCES * new_tokens}
    rows = []
    for contender, runs in seconds.items():
        rates = {kind: work[kind] / statistics.median(run[kind] for run in runs) for kind in work}
        rows.append({"model": name, "contender": contender, **{f"{kind}_tokens_per_s": rate
                                                                 for kind, rate in rates.items()}})
    print(f"\n## {name}: {sum(p.numel() for p in model32.parameters()) / 1e6:.1f}M parameters, "
          f"{args.threads} thread(s), prompt {len(long_prompt)} tokens, {new_tokens} new tokens, "
          f"median of {args.rounds}")
    print(machine_line())
    print("| contender | prompt tokens/s | decode tokens/s (batch 1) | tokens/s, 8 sequences |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['contender']} | {row['prompt_tokens_per_s']:,.0f} | {row['decode_tokens_per_s']:,.0f} | "
              f"{row['batch_tokens_per_s']:,.0f} |")
    by = {row["contender"]: row for row in rows}
    for ours, theirs in (("scratchlm fp32", "llama.cpp f32"), ("scratchlm fp32 --compile", "llama.cpp f32"),
                         ("scratchlm bf16", "llama.cpp f16"), ("scratchlm bf16 --compile", "llama.cpp f16")):
        ratios = {kind: by[ours][f"{kind}_tokens_per_s"] / by[theirs][f"{kind}_tokens_per_s"] for kind in work}
        print(f"speed {ours} / {theirs}: prompt {ratios['prompt']:.2f}x, decode {ratios['decode']:.2f}x, "
              f"8 sequences {ratios['batch']:.2f}x (> 1: ours is faster)")
    print("JSON " + json.dumps(rows))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="demo and 17m, 32 new tokens, 64-token prompt, 1 round")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="which models (default: all; --quick: "
                                                                            "demo 17m)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads for both (default: torch's default here)")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.prompt_tokens, args.rounds, args.warmup = 32, 64, 1, 0
        args.models = args.models or ["demo", "17m"]
    if llama_cpp_python() is None:
        print(f"no llama.cpp at {llama_cpp_venv()}: run scripts/setup_llama_cpp.sh first", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models or list(MODELS):
            bench_model(name, Path(folder), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
