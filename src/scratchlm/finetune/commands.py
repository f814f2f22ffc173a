"""`scratchlm finetune` (a training run on conversations) and `scratchlm data conversations` (demo data).

``finetune`` is ``train`` with other data: the same options (train/commands.py's ``add_run_arguments``: --config,
--set, --budget, --init-from, --resume, ...), the same run directory, checkpoints, metrics and resume; its own flags
only say what to train on, as shorthands for data.* fields, so a resume needs none of them again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FINETUNE_EPILOG = """examples:
  scratchlm finetune --init-from runs/demo --data stories.jsonl --run-dir runs/chat --budget 10m
  scratchlm finetune --init-from SmolLM2-135M-Instruct/ --data mine.jsonl --val-data mine-val.jsonl \\
      --run-dir runs/smol-mine --set train.max_steps=200
  scratchlm finetune --resume --run-dir runs/chat          # continue from the newest valid checkpoint
data: JSON lines of {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]} or
{"prompt": ..., "completion": ...} (two strings, or two lists of messages: the loss counts the completion's
assistant turns) (files, folders, globs); see docs/finetune.md.
exit status: 0 finished, 1 diverged or bad input, 130 interrupted (a checkpoint was saved)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from scratchlm.train.commands import add_run_arguments

    parser = subparsers.add_parser(
        "finetune", help="fine-tune a model on conversations (the loss counts the assistant's tokens)",
        description="Supervised fine-tuning: start from a model (--init-from: a run, a checkpoint, a Hugging Face "
                    "folder), train on conversations or prompt-completion pairs with the loss on the assistant's "
                    "tokens, end of turn included. A tokenizer without a chat template gets ChatML. Writes a run "
                    "directory like `scratchlm train`.",
        epilog=FINETUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, config_default=", else configs/finetune.toml")
    parser.add_argument("--data", nargs="+", metavar="INPUT",
                        help="JSON lines of conversations or prompt-completion pairs: a file, folder or glob; "
                             "shorthand for --set data.train_path=INPUT")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--val-data", metavar="INPUT", help="validation records (shorthand for data.val_path)")
    split.add_argument("--val-fraction", type=float, metavar="F",
                       help="hold out a fraction F of the records for validation (data.val_fraction; default 0.02)")
    parser.add_argument("--train-on-prompt", action="store_true",
                        help="the loss counts every token, the prompt's too (data.train_on_prompt)")
    parser.add_argument("--packing", choices=["packed", "padded"],
                        help="several conversations a sequence, kept apart (packed, default), or one a sequence "
                             "(padded); data.packing")
    parser.set_defaults(func=run_finetune)


def finetune_overrides(args: argparse.Namespace) -> list[str]:
    """The data.* overrides of finetune's own flags (the --set of the same keys, later, win)."""
    from scratchlm.errors import UserError

    overrides = ["data.format=conversations"]
    if args.data:
        if len(args.data) > 1:
            raise UserError("--data takes one file, folder or glob (put several files in a folder, or quote a glob)")
        overrides.append(f"data.train_path={args.data[0]}")
    elif not args.resume:
        raise UserError("--data is required: the conversations to fine-tune on (JSON lines)")
    if args.val_data:
        overrides.append(f"data.val_path={args.val_data}")
    if args.val_fraction is not None:
        overrides += [f"data.val_fraction={args.val_fraction}", "data.val_path="]
    if args.train_on_prompt:
        overrides.append("data.train_on_prompt=true")
    if args.packing:
        overrides.append(f"data.packing={args.packing}")
    return overrides


def run_finetune(args: argparse.Namespace) -> int:
    from scratchlm.finetune.data import ConversationData
    from scratchlm.paths import DEFAULT_FINETUNE
    from scratchlm.train.commands import run_train

    return run_train(args, command="finetune", default_config=DEFAULT_FINETUNE,
                     extra_overrides=finetune_overrides(args), read_data=ConversationData.read)


# ------------------------------------------------------------------------------------ scratchlm data conversations
def register_conversations(actions) -> None:
    """`scratchlm data conversations`: an action of `scratchlm data` (data/commands.py lists it)."""
    parser = actions.add_parser(
        "conversations", help="make fine-tuning conversations (JSON lines) from HH-RLHF or TinyStories",
        description="Write {\"messages\": [...]} JSON lines for `scratchlm finetune`: from Anthropic's HH-RLHF "
                    "(the chosen dialogues' Human:/Assistant: turns), or from TinyStories (a user asks for a story "
                    "with characters or words of a real story, the assistant tells it). Deterministic with --seed.")
    parser.add_argument("--from", dest="kind", required=True, choices=["hh-rlhf", "tinystories"],
                        help="what the input is")
    parser.add_argument("input", metavar="IN", help="HH-RLHF .jsonl(.gz), or a TinyStories text file")
    parser.add_argument("--out", required=True, metavar="OUT.jsonl", help="the JSON lines file to write")
    parser.add_argument("--limit", type=int, metavar="N", help="write only the first N conversations")
    parser.add_argument("--seed", type=int, default=0, help="seeds the TinyStories requests (default: 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.set_defaults(func=run_conversations)


def run_conversations(args: argparse.Namespace) -> int:
    import itertools
    import json
    import os
    import tempfile

    from scratchlm.errors import UserError
    from scratchlm.finetune.builders import hh_rlhf_conversations, tinystories_conversations
    from scratchlm.output_paths import refuse_inputs

    out = Path(args.out)
    refuse_inputs(out, [Path(args.input)])
    if out.exists() and not args.force:
        raise UserError(f"--out {out} exists: choose another, or pass --force to replace it")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be positive, got {args.limit}")
    if not Path(args.input).is_file():
        raise FileNotFoundError(f"{args.input} does not exist")
    records = (hh_rlhf_conversations(args.input) if args.kind == "hh-rlhf"
               else tinystories_conversations(args.input, args.seed))
    count = 0
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            for record in itertools.islice(records, args.limit):
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
        os.replace(temporary, out)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    print(f"{count} conversations -> {out}", file=sys.stderr)
    return 0
