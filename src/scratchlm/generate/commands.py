"""`scratchlm generate`: sample text from a checkpoint, streamed to the terminal as it is produced.

The model and its config come from `load_for_inference` (a run directory -> its newest valid checkpoint); the
tokenizer is the run's copy (RUN/tokenizer), its `data.tokenizer` or `--tokenizer`, refused when its hash is not
the run's (train/tokenizer_identity.py). Tokens are decoded incrementally: a token can end
in the middle of a multi-byte UTF-8 character, so an incremental decoder keeps the undecoded trailing bytes
until the character completes (and flushes any leftover as U+FFFD at the end). With `--num-samples N` the
samples are drawn one after another (sample i uses seed S + i), each streamed live.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from pathlib import Path

from scratchlm.config import TORCH_DTYPE_NAMES
from scratchlm.model_args import add_cs336_checkpoint_arguments, load_model_for_command

EOS_TOKEN = "<|endoftext|>"
DTYPES = ("fp32", "bf16")  # train.dtype names (config.TORCH_DTYPE_NAMES): weights and KV cache

EPILOG = """examples:
  scratchlm generate --checkpoint runs/demo --prompt "Once upon a time" --max-new-tokens 256
  scratchlm generate --checkpoint runs/demo --temperature 0 --prompt "Lily saw"       # greedy
  scratchlm generate --checkpoint runs/demo --num-samples 3 --seed 0 --top-k 50
  scratchlm generate --checkpoint runs/demo --dtype bf16                             # bf16 weights
  scratchlm generate --cs336-checkpoint ckpt.pt --preset tinystories-17m --tokenizer tok/   # a CS336 model"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="sample text from a checkpoint (streamed)", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text with a trained model: temperature, top-k and nucleus (top-p) sampling, a KV "
                    "cache, stops at <|endoftext|>. An empty prompt starts a new document (<|endoftext|>).")
    parser.add_argument("--checkpoint", type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--prompt", action="append", help="text to continue (default: start a new document); "
                        "give it again for more prompts, decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="token budget per sample (default: what the context leaves after the prompt, at most 256)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1]; 1 disables (default: 0.9)")
    parser.add_argument("--top-k", type=int, default=None, help="keep only the k most likely tokens")
    parser.add_argument("--num-samples", type=int, default=1, help="how many samples (default: 1)")
    parser.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the run's "
                                                                      "copy, RUN/tokenizer)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="weights and KV cache: fp32 (default) or bf16 (half the memory; faster or not depending "
                             "on the hardware)")
    parser.add_argument("--compile", action="store_true",
                        help="decode a bf16 model on the CPU through torch.compile: faster per token after a "
                             "compile of seconds (worth it for long or many samples; other dtypes decode as without)")
    add_cs336_checkpoint_arguments(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.errors import UserError
    from scratchlm.generate.decoding import generate, stream
    from scratchlm.train.setup import select_device
    from scratchlm.train.tokenizer_identity import tokenizer_for_run

    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}")
    model, config = load_model_for_command(args, device=select_device(args.device))
    model.to(getattr(torch, TORCH_DTYPE_NAMES[args.dtype]))
    # The run's own tokenizer (or --tokenizer); refuses one whose hash is not the run's.
    tokenizer = tokenizer_for_run(args.checkpoint or args.cs336_checkpoint, config, args.tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}: "
                        f"is --tokenizer the one this model was trained with?")
    eos_id = tokenizer.special_id(EOS_TOKEN) if EOS_TOKEN in tokenizer.special_tokens else None
    say_if_not_compiled(args.compile, model, "scratchlm generate")
    texts = args.prompt or [""]
    prompts = [tokenizer.encode(text) if text else ([eos_id] if eos_id is not None else []) for text in texts]
    if not all(prompts):
        raise UserError("empty --prompt and the tokenizer has no <|endoftext|> to start a document with")
    context = model.config.context_length
    max_new = args.max_new_tokens
    if max_new is None:  # the last new token is never fed back: prompt + max_new - 1 fits the context
        max_new = max(0, min(256, context + 1 - max(len(ids) for ids in prompts)))
    # Every sample of every prompt decodes in one batch, row r seeded seed + r (one prompt: sample s, seed + s).
    rows = [(text, ids) for text, ids in zip(texts, prompts) for _ in range(args.num_samples)]
    # vocab_limit: a model's vocabulary may be padded past the tokenizer's, and those ids have no text
    options = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, eos_id=eos_id,
                   vocab_limit=tokenizer.vocab_size, compile=args.compile)
    try:
        if len(rows) == 1:  # one sample: printed as it is sampled
            steps = stream(model, prompts[0], max_new, seed=args.seed, **options)
            write_stream(texts[0], (step[0] for step in steps), tokenizer, sys.stdout)
            return 0
        samples = generate(model, [ids for _, ids in rows], max_new, seed=args.seed, **options)
    except ValueError as error:  # a prompt too long for the context with --max-new-tokens
        raise UserError(str(error)) from None
    for index, ((text, _), new) in enumerate(zip(rows, samples)):
        print(f"--- prompt {index // args.num_samples + 1}, sample {index % args.num_samples + 1}"
              f"/{args.num_samples} ---" if len(texts) > 1 else f"--- sample {index + 1}/{args.num_samples} ---")
        write_stream(text, new, tokenizer, sys.stdout)
    return 0


def write_stream(prompt: str, token_ids, tokenizer, out) -> None:
    """Write the prompt, then each token's text as soon as its UTF-8 characters are complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(prompt)
    out.flush()
    for token_id in token_ids:
        if token_id is None:  # the row stopped (end of text)
            break
        if text := decoder.decode(tokenizer.decode_bytes([token_id])):
            out.write(text)
            out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()


def say_if_not_compiled(asked: bool, model, command: str) -> None:
    """One line on stderr when --compile was given but the model decodes eagerly, and why."""
    from scratchlm.model.kernels.compiled_step import not_compiled_because

    reason = not_compiled_because(model) if asked else None
    if reason is not None:
        print(f"{command}: --compile ignored: {reason}", file=sys.stderr)
