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
import sys
from pathlib import Path

from scratchlm.config import TORCH_DTYPE_NAMES
from scratchlm.model_args import add_cs336_checkpoint_arguments, load_model_for_command

DTYPES = ("fp32", "bf16")  # train.dtype names (config.TORCH_DTYPE_NAMES): weights and KV cache

EPILOG = """examples:
  scratchlm generate --checkpoint runs/demo --prompt "Once upon a time" --max-new-tokens 256
  scratchlm generate --checkpoint runs/demo --temperature 0 --prompt "Lily saw"       # greedy
  scratchlm generate --checkpoint runs/demo --num-samples 3 --seed 0 --top-k 50
  scratchlm generate --checkpoint runs/demo --dtype bf16                             # bf16 weights
  scratchlm generate --cs336-checkpoint ckpt.pt --preset tinystories-17m --tokenizer tok/   # a CS336 model"""
CHAT_EPILOG = """examples:
  scratchlm chat runs/smollm2-instruct
  scratchlm chat runs/story-chat --system "You tell short stories." --temperature 0.7
  echo "Tell me a story about a cat." | scratchlm chat runs/story-chat --seed 0   # one reply, then end of input"""
CHAT_COMMANDS = {"/reset": "start over (keeping --system)", "/exit": "end the chat"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="sample text from a checkpoint (streamed)", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text with a trained model: temperature, top-k and nucleus (top-p) sampling, a KV "
                    "cache, stops at <|endoftext|>. An empty prompt starts a new document (<|endoftext|>).")
    parser.add_argument("--checkpoint", type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--prompt", action="append", help="text to continue (default: start a new document); "
                        "give it again for more prompts, decoded together")
    add_sampling_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--num-samples", type=int, default=1, help="how many samples (default: 1)")
    add_cs336_checkpoint_arguments(parser)
    parser.set_defaults(func=run_generate)
    register_chat(subparsers)


def register_chat(subparsers: argparse._SubParsersAction) -> None:
    """`scratchlm chat RUN`: a terminal chat with the run's model, on generate's sampling flags."""
    parser = subparsers.add_parser(
        "chat", help="talk to a chat model in the terminal (replies streamed)", epilog=CHAT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A multi-turn chat with a model whose tokenizer has a chat template (an imported instruct "
                    "model, or one made by `scratchlm finetune`). Each line you type is a user message; the reply "
                    "is printed as it is sampled and ends at the end of the model's turn. /reset starts over "
                    "(keeping --system), /exit (or end of input) ends.")
    parser.add_argument("checkpoint", type=Path, metavar="RUN", help="run directory or checkpoint directory")
    parser.add_argument("--system", default=None, help="a system message that starts the conversation")
    add_sampling_arguments(parser)
    add_model_arguments(parser)
    parser.set_defaults(func=run_chat, cs336_checkpoint=None, model_config=None, preset=None, model_overrides=[])


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling flags of `generate`, which `chat` takes too."""
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="token budget per sample (default: what the context leaves after the prompt, at most 256)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1]; 1 disables (default: 0.9)")
    parser.add_argument("--top-k", type=int, default=None, help="keep only the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="make sampling reproducible")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The tokenizer, device, dtype and --compile flags of `generate`, `chat` and `serve`."""
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the run's "
                                                                      "copy, RUN/tokenizer)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="weights and KV cache: fp32 (default) or bf16 (half the memory; faster or not depending "
                             "on the hardware)")
    parser.add_argument("--compile", action="store_true",
                        help="decode through a step compiled ahead of time on the CPU (fp32 and bf16): faster per "
                             "token after a build of seconds (worth it for long or many samples; fp16 decodes as "
                             "without)")


def load_model_and_tokenizer(args: argparse.Namespace, command: str):
    """(model in --dtype on --device, its run's tokenizer) for a command with add_model_arguments' flags; the
    tokenizer is the run's own (or --tokenizer), refused when its hash is not the run's."""
    import torch

    from scratchlm.errors import UserError
    from scratchlm.train.setup import select_device
    from scratchlm.train.tokenizer_identity import tokenizer_for_run

    model, config = load_model_for_command(args, device=select_device(args.device))
    model.to(getattr(torch, TORCH_DTYPE_NAMES[args.dtype]))
    tokenizer = tokenizer_for_run(args.checkpoint or args.cs336_checkpoint, config, args.tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}: "
                        f"is --tokenizer the one this model was trained with?")
    say_if_not_compiled(args.compile, model, f"scratchlm {command}")
    return model, tokenizer


def run_generate(args: argparse.Namespace) -> int:
    from scratchlm.errors import UserError
    from scratchlm.generate.decoding import default_max_new_tokens, generate, stream

    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}")
    model, tokenizer = load_model_and_tokenizer(args, "generate")
    eos_id = tokenizer.end_of_text_id
    texts = args.prompt or [""]
    prompts = [tokenizer.encode(text) if text else ([eos_id] if eos_id is not None else []) for text in texts]
    if not all(prompts):
        raise UserError("empty --prompt and the tokenizer has no <|endoftext|> to start a document with")
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = max(0, default_max_new_tokens(max(len(ids) for ids in prompts), model.config.context_length))
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


def run_chat(args: argparse.Namespace) -> int:
    from scratchlm.errors import UserError
    from scratchlm.generate.chat import ChatSession

    model, tokenizer = load_model_and_tokenizer(args, "chat")
    session = ChatSession(model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens,  # refuses a
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,  # model without a
                          seed=args.seed, compile=args.compile)  # chat template, and bad options, in one line
    interactive = sys.stdin.isatty()
    commands = ", ".join(f"{name} {meaning}" for name, meaning in CHAT_COMMANDS.items())
    print(f"scratchlm chat: {args.checkpoint} ({model.num_parameters():,} parameters, context "
          f"{model.config.context_length}); {commands}", file=sys.stderr, flush=True)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            print("(conversation reset)", file=sys.stderr, flush=True)
        elif text.strip().startswith("/") and text.split()[0] not in CHAT_COMMANDS:
            print(f"unknown command {text.split()[0]} ({', '.join(CHAT_COMMANDS)})", file=sys.stderr, flush=True)
        elif text.strip():
            try:
                for piece in session.reply(text):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except UserError as error:  # the conversation outgrew the context: say so, and go on
                print(f"scratchlm chat: {error}", file=sys.stderr, flush=True)
                continue
            print(flush=True)


def write_stream(prompt: str, token_ids, tokenizer, out) -> None:
    """Write the prompt, then each token's text as soon as its UTF-8 characters are complete."""
    from scratchlm.generate.text import TextStream

    stream = TextStream(tokenizer)
    out.write(prompt)
    out.flush()
    for token_id in token_ids:
        if token_id is None:  # the row stopped (end of text)
            break
        if text := stream.add(token_id):
            out.write(text)
            out.flush()
    out.write(stream.finish() + "\n")
    out.flush()


def say_if_not_compiled(asked: bool, model, command: str) -> None:
    """One line on stderr when --compile was given but the model decodes eagerly, and why."""
    from scratchlm.model.kernels.compiled_step import not_compiled_because

    reason = not_compiled_because(model) if asked else None
    if reason is not None:
        print(f"{command}: --compile ignored: {reason}", file=sys.stderr)
