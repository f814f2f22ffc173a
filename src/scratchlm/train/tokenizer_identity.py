"""Which tokenizer a run belongs to: its hash in the run's config, a copy in RUN/tokenizer/, and a vocabulary that
holds every one of its ids.

Why: a path is no identity (a folder can be retrained, and any tokenizer of the same size decodes garbage without
error). So ``train`` records ``data.tokenizer_hash`` (of data.tokenizer, else of the token files' headers) and keeps
its own copy, which data.tokenizer then names; ``generate``, ``eval``, ``export`` and ``--resume`` refuse a
tokenizer with another hash. The hash is of the content (vocab, merges, special tokens), never of a file layout.
model.vocab_size left out is the tokenizer's size (rounded up to model.pad_vocab_to); one that is set must hold
every id.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.config import RunConfig
from scratchlm.errors import UserError

if TYPE_CHECKING:
    from scratchlm.data.token_file import TokenFile
    from scratchlm.tokenizer.tokenizer import Tokenizer

RUN_TOKENIZER_DIR = "tokenizer"


def short(tokenizer_hash: str) -> str:
    """The first 16 hex digits: enough to tell tokenizers apart in a message."""
    return tokenizer_hash[:16]


def bind_tokenizer(config: RunConfig, tokenizer: Tokenizer | None, train: TokenFile,
                   val: TokenFile | None) -> RunConfig:
    """``config`` with data.tokenizer_hash set, after checking that everything it names agrees on it: the train
    and validation token files (even without data.tokenizer), data.tokenizer (``tokenizer``, as loaded), and a
    hash already recorded (a resumed run's config.toml)."""
    data = config.data
    train_hash, val_hash = train.tokenizer_hash, val.tokenizer_hash if val is not None else None
    if train_hash and val_hash and train_hash != val_hash:
        raise UserError(f"data.train_path {data.train_path} was encoded with tokenizer {short(train_hash)} but "
                        f"data.val_path {data.val_path} with tokenizer {short(val_hash)}: encode both with one "
                        f"tokenizer")
    found, source = train_hash or val_hash, "the token files"
    if tokenizer is not None:
        found, source = tokenizer.hash, f"data.tokenizer {data.tokenizer}"
    recorded = data.tokenizer_hash
    if recorded and found and recorded != found:
        raise UserError(f"{source} has tokenizer hash {short(found)}, but this run was trained with tokenizer "
                        f"{short(recorded)} (data.tokenizer_hash): use the run's own copy in "
                        f"{Path(config.train.run_dir) / RUN_TOKENIZER_DIR}")
    return dataclasses.replace(config, data=dataclasses.replace(data, tokenizer_hash=found or recorded))


def check_same_tokenizer(saved: str | None, current: str | None, where: str) -> None:
    """Resume: the checkpoint's tokenizer hash must be the one this run now trains with."""
    if saved and current and saved != current:
        raise UserError(f"{where} was trained with tokenizer {short(saved)}, but this config's data gives "
                        f"tokenizer {short(current)}: resume with the original tokenizer and token files")


def keep_tokenizer_copy(config: RunConfig, tokenizer: Tokenizer | None, run_dir: Path) -> RunConfig:
    """Save ``tokenizer`` (data.tokenizer, as loaded) as RUN/tokenizer/ (unless that copy already is this
    tokenizer); return ``config`` with data.tokenizer naming the copy, so the run's config.toml and checkpoints
    point inside the run."""
    if tokenizer is None:
        return config
    from scratchlm.tokenizer.tokenizer import Tokenizer

    copy = run_dir / RUN_TOKENIZER_DIR
    if copy.resolve() != Path(config.data.tokenizer).resolve():
        if copy.is_dir() and Tokenizer.load(copy).hash != tokenizer.hash:
            shutil.rmtree(copy)  # a copy from an earlier attempt that never checkpointed (the run lock is held)
        if not copy.is_dir():
            tokenizer.save(copy)
    return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(copy)))


def bind_vocab_size(config: RunConfig) -> RunConfig:
    """``fit_vocab_size`` for a config whose tokenizer is not read yet (a sweep's point): reads data.tokenizer,
    else the header of data.train_path."""
    from scratchlm.data.token_file import open_token_file
    from scratchlm.tokenizer.tokenizer import Tokenizer

    data = config.data
    tokenizer = Tokenizer.load(data.tokenizer) if data.tokenizer else None
    train = open_token_file(data.train_path) if data.train_path and tokenizer is None else None
    return fit_vocab_size(config, tokenizer, train)


def fit_vocab_size(config: RunConfig, tokenizer: Tokenizer | None, train: TokenFile | None) -> RunConfig:
    """``config`` with model.vocab_size set to the tokenizer's when left out, or checked to hold all its ids.

    The tokenizer's size is that of data.tokenizer (``tokenizer``, as loaded), else the one data.train_path's
    header records (``train``: the size of the tokenizer that encoded it)."""
    model = config.model
    if tokenizer is not None:
        size, source = tokenizer.vocab_size, f"tokenizer {config.data.tokenizer}"
    elif train is not None:
        size, source = train.vocab_size, f"the tokenizer of data.train_path {config.data.train_path}"
    elif model.vocab_size is None:
        raise UserError("model.vocab_size is not set, and neither data.tokenizer nor data.train_path names a "
                        "tokenizer to take it from")
    else:
        return config
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=size)  # rounded up to model.pad_vocab_to on construction
    elif model.vocab_size < size:
        raise UserError(f"model.vocab_size {model.vocab_size} is smaller than the {size} ids of {source}: set it to "
                        f"at least {size}, or to none to take the tokenizer's")
    return dataclasses.replace(config, model=model)


def run_tokenizer_dir(checkpoint: Path, config: RunConfig) -> Path | None:
    """The run's tokenizer directory: its copy (RUN/tokenizer), else data.tokenizer; None when it names none."""
    from scratchlm.train.checkpoint import run_dir_of

    copy = run_dir_of(checkpoint) / RUN_TOKENIZER_DIR
    if copy.is_dir():
        return copy
    return Path(config.data.tokenizer) if config.data.tokenizer else None


def tokenizer_for_run(checkpoint: Path, config: RunConfig, given: Path | None):
    """The tokenizer to decode or export a run with: ``given`` (--tokenizer), else the run's copy, else
    data.tokenizer; refused when its hash is not the run's recorded one."""
    from scratchlm.tokenizer.tokenizer import Tokenizer

    directory = given or run_tokenizer_dir(checkpoint, config)
    if directory is None:
        raise UserError(f"the run at {checkpoint} records no tokenizer (data.tokenizer); pass --tokenizer DIR")
    if not Path(directory).is_dir():
        raise UserError(f"tokenizer directory {directory} not found (from the run's data.tokenizer or --tokenizer)")
    tokenizer = Tokenizer.load(directory)
    expected = config.data.tokenizer_hash
    if expected and tokenizer.hash != expected:
        raise UserError(f"tokenizer {directory} has hash {short(tokenizer.hash)}, but the run at {checkpoint} was "
                        f"trained with tokenizer {short(expected)}: leave out --tokenizer to use the run's copy")
    return tokenizer
