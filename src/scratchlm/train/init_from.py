"""Starting a run from existing weights: ``train.init_from`` (``scratchlm train --init-from PATH``).

PATH, opened by scratchlm/init_source.py, is a run directory (its newest valid checkpoint), a checkpoint
directory, or a Hugging Face model folder (read as ``import hf`` reads it). The run takes the weights and their
model config, whole (the config's [model] table does not apply), and the source's tokenizer as data.tokenizer
(another one given is refused); the optimizer, schedule, step counter, budget and seed start fresh. A model field
the caller set on purpose (``stated``: the CLI's ``--set model.*``) must agree with the source's; ``stated=None``
states all of config.model, so a library caller gets no silent replacement. On ``--resume`` with checkpoints the
run's own model wins and the source is not read (resolve.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from scratchlm.config import RunConfig
from scratchlm.errors import UserError
from scratchlm.init_source import InitSource
from scratchlm.model.config import ModelConfig


def adopt(config: RunConfig, source: InitSource, stated: Mapping[str, Any] | None) -> RunConfig:
    """``config`` with the source's model and tokenizer (see the module docstring)."""
    return with_tokenizer(with_model(config, source.model, source.where, stated), source)


def with_model(config: RunConfig, model: ModelConfig, where: str, stated: Mapping[str, Any] | None) -> RunConfig:
    """``config`` with ``model`` as its model, once each ``stated`` field agrees with it (None: all of config.model;
    ``where`` names the model's origin in the refusal)."""
    stated = dataclasses.asdict(config.model) if stated is None else stated
    if "preset" in stated:
        raise UserError(f"model.preset cannot be set with train.init_from: the model is that of {where}")
    for key, value in stated.items():
        if not _agrees(model, key, value):
            raise UserError(f"model.{key} = {value!r} conflicts with the model of {where} ({key} = "
                            f"{getattr(model, key)!r}): with train.init_from the model is the source's; leave "
                            f"model.{key} out")
    return dataclasses.replace(config, model=model)


def _agrees(model: ModelConfig, key: str, value: Any) -> bool:
    """Is ``key = value`` what ``model`` has? A value the config resolves to the model's agrees too (d_ff = none
    is the FFN kind's default size): compared after the config's own resolution."""
    if value == getattr(model, key):
        return True
    try:
        return dataclasses.replace(model, **{key: value}) == model
    except ValueError:
        return False


def with_tokenizer(config: RunConfig, source: InitSource) -> RunConfig:
    """``config`` whose data.tokenizer (and its hash) is the source's; another tokenizer given is refused."""
    from scratchlm.train.tokenizer_identity import short

    expected, data = source.tokenizer_hash, config.data
    if expected is None:
        return config  # the source records no tokenizer: the data settings stand
    given = {"data.tokenizer_hash": data.tokenizer_hash}
    if data.tokenizer:
        from scratchlm.tokenizer.tokenizer import Tokenizer

        given[f"data.tokenizer {data.tokenizer}"] = Tokenizer.load(data.tokenizer).hash
    for name, found in given.items():
        if found and found != expected:
            copy = f" ({source.tokenizer})" if source.tokenizer else ""
            raise UserError(f"{name} is tokenizer {short(found)}, but the model of {source.where} was trained with "
                            f"tokenizer {short(expected)}: leave data.tokenizer out to use that one{copy}, and "
                            f"encode the data with it")
    tokenizer = str(source.tokenizer) if source.tokenizer else data.tokenizer
    return dataclasses.replace(config, data=dataclasses.replace(data, tokenizer=tokenizer, tokenizer_hash=expected))
