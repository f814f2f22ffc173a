"""Fine-tuning throughput: packed conversations (document-masked) vs padded ones vs the same tokens as plain text.

What `scratchlm finetune` trains on: TinyStories turned into conversations (finetune/builders.py; or HH-RLHF's
dialogues with --conversations hh-rlhf), rendered with
ChatML and a BPE tokenizer trained here on the start of TinyStories-valid, the loss on the assistant's tokens. Three
contenders train the same model (the modern recipe's shape unless --quick: d_model 256, 4 layers, context 256;
fp32, AdamW, batch 16) from the same initial weights, steps interleaved (ABBA, harness.py):

- packed: several conversations a row, attention kept inside each (TransformerLM(document_ids=...)), masked loss;
- padded: one conversation a row, each batch cut to its longest row, masked loss;
- plain: the rendered conversations concatenated into one token stream, random windows, every token counted (what
  `scratchlm train` would do with them): the cost of the masking and the document mask.

Reported: real tokens per second (padding left out), and the assistant tokens (the ones the loss counts) per
second, which is what a fine-tuning buys; also per CPU second of this process (all its threads), which other
jobs on a shared machine disturb less than the wall clock. docs/finetune.md has the figures and the default
they chose.

    .venv/bin/python benchmarks/bench_finetune.py [--quick] [--steps 6] [--threads 2] [--conversations hh-rlhf]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_line, round_order  # noqa: E402
from scratchlm.config import load_config  # noqa: E402
from scratchlm.data.batches import BatchSampler  # noqa: E402
from scratchlm.finetune.builders import hh_rlhf_conversations, tinystories_conversations  # noqa: E402
from scratchlm.finetune.conversations import checked_example  # noqa: E402
from scratchlm.finetune.packing import RowSampler, build_rows  # noqa: E402
from scratchlm.finetune.rendering import render_example  # noqa: E402
from scratchlm.paths import shared_data_file  # noqa: E402
from scratchlm.tokenizer import Tokenizer  # noqa: E402
from scratchlm.tokenizer.train_bpe import train_bpe  # noqa: E402
from scratchlm.train.loss import IGNORED  # noqa: E402
from scratchlm.train.setup import build_model, build_optimizer  # noqa: E402
from scratchlm.train.step import train_step  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "modern.toml"
BATCH = 16
HH_RLHF = "chat/hh-rlhf/helpful-base/test.jsonl.gz"


def tokenizer_and_examples(stories: Path, source: str, count: int, vocab_size: int):
    with tempfile.TemporaryDirectory() as folder:
        sample = Path(folder) / "sample.txt"
        sample.write_text(stories.read_text(encoding="utf-8")[:400_000], encoding="utf-8")
        tokenizer = Tokenizer(*train_bpe(str(sample), vocab_size, ["<|endoftext|>"], num_workers=1),
                              ["<|endoftext|>"]).with_chatml()
    if source == "hh-rlhf":
        records = itertools.islice(hh_rlhf_conversations(shared_data_file(HH_RLHF)), count)
    else:
        records = itertools.islice(tinystories_conversations(stories, seed=0), count)
    return tokenizer, [render_example(checked_example(r, f"story {i}"), tokenizer) for i, r in enumerate(records)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps: checks the script runs")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per contender (default: 6)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", choices=["tinystories", "hh-rlhf"], default="tinystories",
                        help="TinyStories as story requests (default), or HH-RLHF's dialogues (shorter, more varied)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stories = shared_data_file("tinystories/TinyStories-valid.txt") or shared_data_file(
        "fixtures/tinystories_sample.txt")
    if stories is None:
        print("bench_finetune: no TinyStories file in the shared data folder", file=sys.stderr)
        return 1
    if args.conversations == "hh-rlhf" and shared_data_file(HH_RLHF) is None:
        print(f"bench_finetune: no {HH_RLHF} in the shared data folder", file=sys.stderr)
        return 1
    tokenizer, examples = tokenizer_and_examples(stories, args.conversations, 200 if args.quick else 1500,
                                                 1000 if args.quick else 2048)
    shape = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.context_length=128"] \
        if args.quick else []
    config = load_config(RECIPE, [f"model.vocab_size={tokenizer.vocab_size}", "optim.optimizer=adamw",
                                  "train.dtype=fp32", f"data.batch_size={BATCH}", "train.device=cpu", *shape])
    row = config.model.context_length + 1
    examples = [e if len(e) <= row else type(e)(e.ids[:row], e.counted[:row], e.where) for e in examples]
    stream = np.concatenate([e.ids for e in examples])
    samplers = {"packed": RowSampler(build_rows(examples, row, "packed"), BATCH, "cpu", seed=0),
                "padded": RowSampler(build_rows(examples, row, "padded"), BATCH, "cpu", seed=0),
                "plain": BatchSampler(stream, BATCH, config.model.context_length, "cpu", seed=0)}
    trained = {}
    for name in samplers:
        model = build_model(config, torch.device("cpu"))  # the same seeded init for each
        trained[name] = (model, build_optimizer(model, config))
    totals = {name: {"seconds": 0.0, "cpu_seconds": 0.0, "tokens": 0, "counted": 0} for name in samplers}
    for step in range(args.steps + 1):  # step 0 warms up, untimed
        for name in round_order(list(samplers), step):
            batch = samplers[name].next()
            targets = batch[1]
            real = batch[0].numel() if name == "plain" else _real_tokens(samplers[name], batch)
            start, cpu_start = time.perf_counter(), time.process_time()
            loss, _ = train_step(*trained[name], [batch], lr=1e-4, grad_clip=1.0)
            loss.item()
            if step:
                totals[name]["seconds"] += time.perf_counter() - start
                totals[name]["cpu_seconds"] += time.process_time() - cpu_start
                totals[name]["tokens"] += real
                totals[name]["counted"] += int((targets != IGNORED).sum()) if name != "plain" else targets.numel()
    mean = np.mean([len(e) for e in examples])
    print(f"{len(examples)} {args.conversations} conversations, mean {mean:.0f} tokens (rows of {row}); "
          f"d_model {config.model.d_model}, {config.model.num_layers} layers, batch {BATCH}, {args.threads} threads")
    print(machine_line())
    print("| layout | s/step | real tokens/s | counted tokens/s | counted tokens/CPU-s |\n|---|---:|---:|---:|---:|")
    for name, total in totals.items():
        seconds = total["seconds"]
        print(f"| {name} | {seconds / args.steps:.3f} | {total['tokens'] / seconds:,.0f} | "
              f"{total['counted'] / seconds:,.0f} | {total['counted'] / total['cpu_seconds']:,.0f} |")
    print("JSON " + json.dumps({"title": "finetune throughput", **totals}))
    return 0


def _real_tokens(sampler: RowSampler, batch) -> int:
    """The batch's input tokens that are not padding: each drawn row's filled slots, at most its input width."""
    return int(sampler.rows.lengths[sampler.last_rows].clip(max=batch.inputs.shape[1]).sum())


if __name__ == "__main__":
    raise SystemExit(main())
